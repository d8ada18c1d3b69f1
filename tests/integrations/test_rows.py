"""`RowsCache`: the caches of several requests (each its own length, policy and budget) as the rows of one model
forward decode exactly as each cache does alone; and what it refuses."""

import pytest
import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import QuestConfig
from tandem.integrations.rows import RowsCache
from tests.tiny import tiny_model

STEPS = 8


def _config(policy: str) -> TandemConfig:
    # window 16 + 4 sinks: prompts of 39-71 tokens put most of themselves in the host tier
    return TandemConfig(
        policy=policy,
        sink_tokens=4,
        window_tokens=16,
        block_size=16,
        **({"quest": QuestConfig(budget=0.5)} if policy == "quest" else {}),
    )


def _prefill(model, ids: torch.Tensor, config: TandemConfig):
    """A cache holding the prompt ids [1, T], and the first greedy token [1, 1]."""
    cache = TandemCache.for_model(model, config)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache))
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


def _step(model, tokens, positions, cache):
    """Logits [B, V] of one decode step: tokens, positions [B, 1]."""
    out = model(
        input_ids=tokens, position_ids=positions, use_cache=True, **generate_cache_kwargs(model, cache)
    )
    return out.logits[:, -1].float()


@pytest.mark.model
@torch.inference_mode()
def test_rows_decode_like_each_cache_alone(smollm, prose):
    """Three requests of different lengths and policies (full, hgca, quest) in one batch."""
    model, tok = smollm
    policies = ("hgca", "full", "quest")
    ids = tok(prose, return_tensors="pt").input_ids
    prompts = [ids[:, 100:139], ids[:, 300:371], ids[:, 500:553]]  # 39, 71, 53 tokens
    alone_tokens, alone_logits = [], []
    for prompt, policy in zip(prompts, policies):
        cache, token = _prefill(model, prompt, _config(policy))
        tokens, logits = [int(token)], []
        for step in range(STEPS):
            logits.append(_step(model, token, torch.tensor([[prompt.shape[1] + step]]), cache)[0])
            token = logits[-1].argmax().view(1, 1)
            tokens.append(int(token))
        alone_tokens.append(tokens)
        alone_logits.append(torch.stack(logits))
        assert cache.stats()["host_rows"] > 0

    caches, firsts = zip(*(_prefill(model, p, _config(policy)) for p, policy in zip(prompts, policies)))
    token = torch.cat(firsts)  # [3, 1]
    rows_tokens, rows_logits = [token[:, 0].tolist()], []
    lengths = torch.tensor([[p.shape[1]] for p in prompts])
    for step in range(STEPS):
        rows_logits.append(_step(model, token, lengths + step, RowsCache(list(caches))))
        token = rows_logits[-1].argmax(-1, keepdim=True)
        rows_tokens.append(token[:, 0].tolist())
    assert [list(t) for t in zip(*rows_tokens)] == alone_tokens
    for b in range(3):  # a batch of 3 runs other matmul kernels than one row: test_model.py's tolerance
        logits = torch.stack([step[b] for step in rows_logits])
        torch.testing.assert_close(logits, alone_logits[b], atol=2e-3, rtol=1e-4)
    for cache, prompt in zip(caches, prompts):
        assert cache.get_seq_length() == prompt.shape[1] + STEPS


# ---- refusals (a small random-weight model) -------------------------------------------------------------------
@pytest.fixture
def tiny():
    return tiny_model("Llama")


def test_rows_needs_tandem_caches(tiny):
    with pytest.raises(ValueError, match="at least one"):
        RowsCache([])
    cache = TandemCache.for_model(tiny, _config("full"))
    with pytest.raises(ValueError, match="row 1 is a DynamicCache, not a TandemCache"):
        RowsCache([cache, DynamicCache()])


def test_rows_of_models_of_different_depths_are_refused(tiny):
    deeper = tiny_model("Llama", num_hidden_layers=3)
    caches = [TandemCache.for_model(tiny, _config("full")), TandemCache.for_model(deeper, _config("full"))]
    with pytest.raises(ValueError, match=r"different depths: \[2, 3\] layers"):
        RowsCache(caches)


@torch.inference_mode()
def test_a_batch_that_is_not_one_token_per_row_is_refused_and_the_caches_stay_usable(tiny):
    prompts = [torch.arange(1, 20)[None], torch.arange(5, 38)[None]]
    caches, firsts = zip(*(_prefill(tiny, p, _config("hgca")) for p in prompts))
    rows = RowsCache(list(caches))
    three = torch.cat([*firsts, firsts[0]])
    with pytest.raises(ValueError, match="holds 2 requests; the new tokens come as a batch of 3"):
        _step(tiny, three, torch.tensor([[19], [33], [19]]), rows)
    assert [c.get_seq_length() for c in caches] == [19, 33]  # nothing was stored
    logits = _step(tiny, torch.cat(firsts), torch.tensor([[19], [33]]), RowsCache(list(caches)))
    assert logits.shape == (2, tiny.config.vocab_size) and torch.isfinite(logits).all()


def test_rows_refuse_what_only_generate_would_ask(tiny):
    rows = RowsCache([TandemCache.for_model(tiny, _config("full"))])
    for call in (lambda: rows.crop(1), lambda: rows.reorder_cache(torch.tensor([0])), rows.reset):
        with pytest.raises(NotImplementedError, match="RowsCache"):
            call()
