"""Models with sliding-window layers: Gemma 3's mix of local and global layers and Mistral's window. Sliding
layers keep their window on the device (`cache.SlidingKV`), global layers the tiered cache; with policy "full" the
logits and greedy tokens equal DynamicCache's (prefill in one piece or in chunks, one prompt or a left-padded
batch, the drop-in and the engine). Layer kinds Tandem does not run are refused by name."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.cache.sliding import SlidingKV
from tandem.engine import TandemRunner
from tandem.engine.rows import RowsRunner
from tandem.integrations.hf import layer_windows, restore_attention
from tests.tiny import tiny_model

WINDOW = 8  # the models' sliding window: prompts of 40 tokens pass it
GEMMA_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# 4 sinks + a 16-token window: the global layers offload most of a 40-token prompt
CONFIG = TandemConfig(policy="full", sink_tokens=4, window_tokens=16, block_size=16)
STEPS = 12


def _gemma():
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=WINDOW,
        layer_types=GEMMA_LAYERS,
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


def _mistral():
    return tiny_model("Mistral", sliding_window=WINDOW)


MODELS = {"gemma3": _gemma, "mistral": _mistral}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _prompt(length: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def _decode(model, ids, cache, mask=None, chunks=(None,)):
    """Greedy tokens [B, STEPS] and each step's logits [B, STEPS, V] over `cache` (None: DynamicCache): the prompt
    in pieces ending at `chunks` (None: its end), then STEPS one-token steps."""
    kwargs = generate_cache_kwargs(model, cache) if cache is not None else {}
    batch, total = ids.shape
    mask = torch.ones_like(ids) if mask is None else mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    start = 0
    for end in chunks:
        end = total if end is None else end
        out = model(
            input_ids=ids[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
            use_cache=True, **kwargs,
        )  # fmt: skip
        kwargs = kwargs or generate_cache_kwargs(model, out.past_key_values)
        start = end
    tokens, logits = [], []
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    position = positions[:, -1:] + 1
    for _ in range(STEPS):
        tokens.append(token)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        out = model(input_ids=token, attention_mask=mask, position_ids=position, use_cache=True, **kwargs)
        logits.append(out.logits[:, -1].float())
        token, position = out.logits[:, -1].argmax(-1, keepdim=True), position + 1
    return torch.cat(tokens, dim=1), torch.stack(logits, dim=1)


def _check_equal(model, ids, mask=None, chunks=(None,)):
    restore_attention(model)
    want_tokens, want_logits = _decode(model, ids, None, mask, chunks)
    cache = TandemCache.for_model(model, CONFIG)
    tokens, logits = _decode(model, ids, cache, mask, chunks)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, want_tokens)
    restore_attention(model)
    return cache


def test_full_policy_equals_dynamic_cache(model):
    cache = _check_equal(model, _prompt(40, 0))
    stats = cache.stats()
    windows = layer_windows(model.config)
    sliding = sum(w is not None for w in windows)
    assert sliding and stats["layers"] == {"global": len(windows) - sliding, "sliding": sliding}
    assert stats["tokens"] == 40 + STEPS
    # a sliding layer holds its window: window - 1 tokens before the next one
    assert all(kv.keys.shape[2] == WINDOW - 1 for kv in cache.sliding_layers())
    if stats["layers"]["global"]:
        assert stats["host_rows"] > 0  # the global layers offloaded: the tiers were exercised


def test_chunked_prefill_and_padded_batch_equal_dynamic_cache(model):
    _check_equal(model, _prompt(40, 1), chunks=(13, 30, None))  # pieces shorter and longer than the window
    ids = _prompt(37, 2, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # the first row left-padded by 9
    _check_equal(model, ids, mask)


def test_dynamic_cache_on_a_model_set_to_tandem_keeps_the_window(model):
    """After `for_model` the model attends through Tandem's function; with another cache it falls back to SDPA,
    which must keep the sliding layers' window."""
    restore_attention(model)
    ids = _prompt(40, 6)
    want_tokens, want_logits = _decode(model, ids, None, chunks=(17, None))
    TandemCache.for_model(model, CONFIG)  # switches the model's attention to Tandem's
    tokens, logits = _decode(model, ids, None, chunks=(17, None))
    restore_attention(model)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, want_tokens)


def test_the_window_matters():
    """A wider window attends more keys, and the logits change: the tests above could tell."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 30, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    valid = torch.ones(1, 30, dtype=torch.bool)
    narrow = SlidingKV(0, WINDOW, 2, 16, 64).attend(q, k, v, valid, 0.25)
    wide = SlidingKV(0, 2 * WINDOW, 2, 16, 64).attend(q, k, v, valid, 0.25)
    assert torch.allclose(narrow[:, :, :WINDOW], wide[:, :, :WINDOW])  # the first queries see the same keys
    assert not torch.allclose(narrow[:, :, WINDOW:], wide[:, :, WINDOW:])


@torch.inference_mode()
def test_sliding_window_by_query_chunks_equals_one_piece():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 50, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    valid = torch.ones(2, 50, dtype=torch.bool)
    valid[1, :5] = False
    whole = SlidingKV(0, WINDOW, 2, 16, 64).attend(q, k, v, valid, 0.25)
    pieces = SlidingKV(0, WINDOW, 2, 16, 7).attend(q, k, v, valid, 0.25)
    torch.testing.assert_close(pieces, whole)


@torch.inference_mode()
def test_engine_decodes_sliding_models_eagerly(model):
    restore_attention(model)
    ids = _prompt(40, 3)
    want, _ = _decode(model, ids, None)
    runner = TandemRunner(model, TandemCache.for_model(model, CONFIG))
    assert runner.forward == "hf" and not runner.use_graphs  # transformers' layers, no graphs
    logits = runner.prefill(ids)
    tokens, _ = runner.decode(logits.argmax(-1), STEPS - 1)
    assert torch.equal(torch.cat([logits.argmax(-1, keepdim=True), tokens], dim=1), want)
    # the server's rows: two requests of other lengths decode as each alone
    prompts = [_prompt(40, 4), _prompt(23, 5)]
    alone = [_decode(model, p, TandemCache.for_model(model, CONFIG))[0][0].tolist() for p in prompts]
    rows = RowsRunner(model)
    caches, next_tokens = [], []
    for p in prompts:
        cache = TandemCache.for_model(model, CONFIG)
        out = model(input_ids=p, use_cache=True, **generate_cache_kwargs(model, cache))
        caches.append(cache)
        next_tokens.append([int(out.logits[0, -1].argmax())])
    for step in range(STEPS - 1):
        positions = [p.shape[1] + step for p in prompts]
        chosen = rows.step(caches, [t[-1] for t in next_tokens], positions).argmax(-1).tolist()
        for t, token in zip(next_tokens, chosen, strict=True):
            t.append(token)
    assert next_tokens == alone
    restore_attention(model)


def test_layer_kinds_from_the_config():
    gemma = Gemma3TextConfig(num_hidden_layers=4, sliding_window=WINDOW, layer_types=GEMMA_LAYERS)
    assert layer_windows(gemma) == [WINDOW, WINDOW, None, WINDOW]
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=WINDOW)) == [WINDOW] * 3
    assert layer_windows(MistralConfig(num_hidden_layers=3, sliding_window=None)) == [None] * 3
    linear = Gemma3TextConfig(num_hidden_layers=2)
    # set after construction: transformers 5.17's config checks refuse the type before layer_windows could
    linear.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="unsupported attention layer type 'linear_attention'"):
        layer_windows(linear)
    windowless = Gemma3TextConfig(num_hidden_layers=2, sliding_window=None, layer_types=GEMMA_LAYERS[:2])
    with pytest.raises(ValueError, match="sliding_window is None"):
        layer_windows(windowless)


def test_use_graphs_is_refused_for_sliding_layers():
    model = _mistral()
    with pytest.raises(ValueError, match="sliding-window layers"):
        TandemRunner(model, TandemCache.for_model(model, CONFIG), use_graphs=True)


@torch.inference_mode()
def test_a_wrong_batch_is_refused_and_the_cache_stays_usable():
    model = _gemma()
    cache = TandemCache.for_model(model, CONFIG)
    kwargs = generate_cache_kwargs(model, cache)
    model(input_ids=_prompt(20, 7), use_cache=True, **kwargs)
    with pytest.raises(ValueError, match="holds a batch of 1"):
        model(
            input_ids=_prompt(1, 8, batch=2),
            position_ids=torch.tensor([[20], [20]]),
            use_cache=True,
            **kwargs,
        )
    out = model(input_ids=_prompt(1, 9), position_ids=torch.tensor([[20]]), use_cache=True, **kwargs)
    assert out.logits.shape[:2] == (1, 1) and cache.get_seq_length() == 21
    restore_attention(model)
