"""End-to-end on the real default model (SmolLM2-135M-Instruct, Llama architecture, GQA 3) and on small
random-weight Qwen2 / Mistral / MHA models: Tandem with every entry kept reproduces DynamicCache exactly."""

import random

import pytest
import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import HgcaConfig, QuestConfig
from tests.tiny import tiny_model

pytestmark = pytest.mark.model


def _generate(model, ids, cache, new_tokens, **kwargs):
    kwargs.setdefault("do_sample", False)
    return model.generate(
        ids,
        max_new_tokens=new_tokens,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **generate_cache_kwargs(model, cache),
        **kwargs,
    )


def test_full_policy_greedy_matches_dynamic_cache(smollm, prose):
    model, tok = smollm
    ids = tok(prose, return_tensors="pt").input_ids[:, :1100]
    base = _generate(model, ids, DynamicCache(), 16)
    cache = TandemCache.for_model(model, TandemConfig(policy="full", sink_tokens=16, window_tokens=64))
    ours = _generate(model, ids, cache, 16)
    assert torch.equal(base.sequences, ours.sequences)
    for b, o in zip(base.scores, ours.scores):
        torch.testing.assert_close(o, b, atol=2e-3, rtol=1e-4)
    stats = cache.stats()
    assert stats["host_rows"] >= 1000 - 64 - 16 - 16  # most of the prompt lives in the host tier
    assert stats["mean_fraction_attended"] == 1.0


def test_ragged_batch_matches_dynamic_cache(smollm, prose):
    model, tok = smollm
    texts = [prose[:1500], prose[3000:5200]]
    enc = tok(texts, return_tensors="pt", padding=True)
    assert not enc.attention_mask.all()  # really ragged: the first row is left-padded
    base = _generate(model, enc.input_ids, DynamicCache(), 10, attention_mask=enc.attention_mask)
    cache = TandemCache.for_model(
        model, TandemConfig(policy="full", sink_tokens=8, window_tokens=48, block_size=16)
    )
    ours = _generate(model, enc.input_ids, cache, 10, attention_mask=enc.attention_mask)
    assert torch.equal(base.sequences, ours.sequences)


def test_sampling_matches_dynamic_cache_with_same_seed(smollm, prose):
    model, tok = smollm
    ids = tok(prose, return_tensors="pt").input_ids[:, :400]
    runs = []
    for cache in (
        DynamicCache(),
        TandemCache.for_model(model, TandemConfig(policy="full", window_tokens=32)),
    ):
        torch.manual_seed(1234)
        runs.append(_generate(model, ids, cache, 12, do_sample=True, temperature=0.9, top_p=0.95).sequences)
    assert torch.equal(runs[0], runs[1])


def _needle_prompt(tok, prose, n_tokens, depth, number):
    hay = tok.decode(tok(prose).input_ids[:n_tokens])
    cut = hay.rfind(". ", 0, int(len(hay) * depth)) + 2
    doc = hay[:cut] + f" The special magic number is {number}. " + hay[cut:]
    question = (
        "Read the text and answer the question.\n\n"
        + doc
        + "\n\nQuestion: What is the special magic number mentioned in the text?"
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tok(text + "The special magic number is", return_tensors="pt").input_ids


@pytest.mark.parametrize(
    "config",
    [
        TandemConfig(policy="quest", quest=QuestConfig(budget=0.1), window_tokens=256),
        pytest.param(
            TandemConfig(policy="hgca", hgca=HgcaConfig(beta=4.0), window_tokens=256), marks=pytest.mark.slow
        ),
    ],
    ids=["quest", "hgca"],
)
def test_sparse_policies_retrieve_a_planted_fact(smollm, prose, config, record_property):
    model, tok = smollm
    number = random.Random(7).randint(1_000_000, 9_999_999)
    ids = _needle_prompt(tok, prose, 2200, 0.4, number)
    assert ids.shape[1] >= 2000
    cache = TandemCache.for_model(model, config)
    out = _generate(model, ids, cache, 8).sequences
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    fraction = cache.stats()["mean_fraction_attended"]
    record_property("fraction_attended", fraction)
    print(f"{config.policy}: answer {answer!r}, host entries attended {fraction:.3f}")
    assert str(number) in answer
    assert fraction < 0.5  # it really is sparse

    streaming = TandemCache.for_model(model, TandemConfig(policy="streaming", window_tokens=256))
    out = _generate(model, ids, streaming, 8).sequences
    assert str(number) not in tok.decode(out[0, ids.shape[1] :])  # the fact is out of the window


def test_context_longer_than_model_maximum_is_refused(smollm):
    model, _ = smollm
    limit = model.config.max_position_embeddings
    cache = TandemCache.for_model(model, TandemConfig(policy="full"))
    ids = torch.ones(1, limit + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"exceeds the model's maximum of {limit}"):
        model(ids, use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache))


def test_cache_detects_a_model_not_using_tandem_attention(smollm):
    # pins the update -> attention hand-off: a model attending with another function must not run silently
    model, tok = smollm
    cache = TandemCache.for_model(model, TandemConfig(policy="full"))
    ids = tok("hello there", return_tensors="pt").input_ids
    model.set_attn_implementation("sdpa")
    try:
        model(ids, use_cache=True, **generate_cache_kwargs(model, cache))
        with pytest.raises(RuntimeError, match="tandem"):
            model(ids[:, :1], use_cache=True, **generate_cache_kwargs(model, cache))
    finally:
        model.set_attn_implementation("tandem")


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
        ),
    ],
)
@pytest.mark.parametrize(
    "arch,overrides",
    [("Qwen2", {}), ("Mistral", {"sliding_window": None}), ("Llama", {"num_key_value_heads": 4})],
    ids=["qwen2-gqa", "mistral-gqa", "llama-mha"],
)
def test_other_architectures_match_dynamic_cache(arch, overrides, device):
    model = tiny_model(arch, **overrides).to(device)
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    base = _generate(model, ids, DynamicCache(), 20, attention_mask=mask)
    cache = TandemCache.for_model(
        model, TandemConfig(policy="full", sink_tokens=4, window_tokens=16, block_size=8)
    )
    ours = _generate(model, ids, cache, 20, attention_mask=mask)
    assert torch.equal(base.sequences, ours.sequences)
    assert cache.stats()["host_rows"] > 0


def test_layer_kinds_tandem_does_not_run_are_refused_by_name():
    """Global and sliding-window layers run (tests/integrations/test_sliding.py); any other kind is refused at
    `for_model`, naming it, and the model's attention is left as it was."""
    model = tiny_model("Llama")
    model.config.layer_types = ["full_attention", "linear_attention"]
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="unsupported attention layer type 'linear_attention'"):
        TandemCache.for_model(model, TandemConfig())
    assert model.config._attn_implementation == before
