"""Where a prompt's chunks end (`engine.prefill.chunk_end`), and that the engine and the server's turn-by-turn
prefill leave the cache one whole prefill would, hgca's observation of the prompt included."""

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import HgcaConfig
from tandem.engine import TandemRunner
from tandem.engine.prefill import chunk_end, observed_tokens
from tandem.engine.rows import RowsRunner
from tests.tiny import tiny_model

HGCA = TandemConfig(
    policy="hgca", sink_tokens=2, window_tokens=8, block_size=4, hgca=HgcaConfig(observation_tokens=6)
)


def _ends(total, chunk, observed):
    ends, start = [], 0
    while start < total:
        start = chunk_end(start, total, chunk, observed)
        ends.append(start)
    return ends


def test_the_last_chunk_holds_the_observed_tokens():
    assert _ends(20, 8, 0) == [8, 16, 20]
    assert _ends(20, 8, 6) == [8, 14, 20]  # 16 would leave 4 < 6 behind: stop where the last 6 begin
    assert _ends(20, 3, 6) == [3, 6, 9, 12, 14, 20]
    assert _ends(20, 64, 6) == [20] and _ends(5, 2, 6) == [5]  # starts inside the observed tokens
    assert observed_tokens(HGCA) == 6 and observed_tokens(TandemConfig(policy="quest")) == 0
    for bad in (dict(start=20), dict(start=-1), dict(chunk_tokens=0)):
        kwargs = dict(start=0, total=20, chunk_tokens=8, observed=0) | bad
        with pytest.raises(ValueError, match="start|chunk_tokens"):
            chunk_end(**kwargs)


def _state(cache):
    """What hgca keeps of the prompt, per layer: the hot tier's moving averages in the order of its tokens (the
    ring's slots may lie elsewhere after chunks) and each head's selected host rows."""
    state = []
    for kv in cache.tandem_layers():
        hot, policy = kv.hot, kv.policy
        slots = hot.valid[0].nonzero().flatten()
        order = slots[hot.keys[0, 0, slots, 0].argsort()]  # random keys: distinct, the same in both caches
        selected = [
            sorted(policy.indices[0, h, : policy.lengths[0, h]].tolist())
            for h in range(policy.lengths.shape[1])
        ]
        state.append((hot.maw[0][:, order].clone(), selected))
    return state


def _assert_same(a, b):
    for (maw_a, selected_a), (maw_b, selected_b) in zip(a, b, strict=True):
        torch.testing.assert_close(maw_a, maw_b, atol=1e-5, rtol=1e-5)
        assert selected_a == selected_b


@pytest.mark.parametrize("chunk", [8, 13])
def test_a_chunked_prefill_observes_the_prompt_as_one_whole_prefill(chunk):
    """41 tokens in chunks of 8 or 13 would end with a chunk of 1 or 2 tokens; hgca's 6 observed tokens are
    its last chunk whichever runs it: TandemRunner.prefill or RowsRunner.prefill_chunk turn by turn."""
    model = tiny_model("Llama")
    ids = torch.randint(0, 128, (1, 41), generator=torch.Generator().manual_seed(3))
    whole = TandemCache.for_model(model, HGCA)
    with torch.inference_mode():
        reference = model(input_ids=ids, use_cache=True, **generate_cache_kwargs(model, whole)).logits[:, -1]
    engine = TandemRunner(model, TandemCache.for_model(model, HGCA))
    logits = engine.prefill(ids, chunk_tokens=chunk)
    rows, cache, start = RowsRunner(model), TandemCache.for_model(model, HGCA), 0
    while start < ids.shape[1]:
        end = chunk_end(start, ids.shape[1], chunk, observed_tokens(HGCA))
        row_logits = rows.prefill_chunk(cache, ids[:, start:end], start, last=end == ids.shape[1])
        start = end
    for got in (logits, row_logits):
        torch.testing.assert_close(got, reference.float(), atol=1e-4, rtol=1e-4)
    _assert_same(_state(engine.cache), _state(whole))
    _assert_same(_state(cache), _state(whole))
    assert all(kv.observe_appends for kv in cache.tandem_layers())  # reset for the decode steps


def test_a_chunk_must_continue_its_prompt():
    model = tiny_model("Llama")
    rows, cache = RowsRunner(model), TandemCache.for_model(model, HGCA)
    ids = torch.arange(10)[None]
    rows.prefill_chunk(cache, ids[:, :6], 0, last=False)
    with pytest.raises(ValueError, match=r"start must be the tokens the cache holds \(6\)"):
        rows.prefill_chunk(cache, ids[:, 6:], 5, last=True)
    with pytest.raises(ValueError, match="cache must be a TandemCache"):
        rows.prefill_chunk(object(), ids, 0, last=True)
    assert rows.prefill_chunk(cache, ids[:, 6:], 6, last=True).shape == (1, model.config.vocab_size)


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_later_chunks_attend_the_host_rows_from_the_layers_device_copy(device, monkeypatch):
    """A prompt prefilled in chunks: each layer keeps a device copy of the rows it sends to the host tier
    (`LayerKV.keep_prompt_rows`), and later chunks attend those instead of copying the host rows back. The logits
    equal those of a prefill that copies them back, bit for bit (the same pieces), and so do the greedy tokens
    after; the host tier's rows are never read during the prefill, and the last chunk frees every copy. No copy
    is kept without the memory for it or for chunks past PROMPT_ROWS_MAX_CHUNK. On CPU tensors the copy is
    switched on and the flash kernel runs under Triton's interpreter (CUDA's path)."""
    from tandem.attention import hybrid
    from tandem.cache import host as host_module
    from tandem.cache import layer as layer_module
    from tandem.engine import prefill as prefill_module
    from tandem.kernels import gpu

    if device == "cpu":
        if not gpu.triton_available("cpu"):
            pytest.skip("no Triton interpreter")
        monkeypatch.setattr(layer_module, "PROMPT_ROWS_DEVICES", frozenset({"cpu", "cuda"}))
        monkeypatch.setattr(hybrid, "flash_prefill_available", lambda q: True)
    model = tiny_model("Llama").to(device)
    ids = torch.randint(0, 128, (2, 90), generator=torch.Generator().manual_seed(5)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=16, block_size=4)
    reads = []
    pieces = host_module.HostTier.pieces

    def counted(self, *args):
        reads.append(self)
        return pieces(self, *args)

    monkeypatch.setattr(host_module.HostTier, "pieces", counted)
    runs = []
    # kept; not kept without the memory; not kept for chunks longer than PROMPT_ROWS_MAX_CHUNK
    for keep, room, longest in ((True, 1 << 30, 20), (False, 0, 20), (False, 1 << 30, 19)):
        monkeypatch.setattr(prefill_module, "prompt_rows_budget", lambda d, n, room=room: room)
        monkeypatch.setattr(prefill_module, "PROMPT_ROWS_MAX_CHUNK", longest)
        reads.clear()
        runner = TandemRunner(model, TandemCache.for_model(model, config), use_graphs=False)
        first = runner.prefill(ids, mask, chunk_tokens=20, max_new_tokens=8)
        layers = runner.cache.tandem_layers()
        assert all(kv.host.rows > 0 and kv.prompt_rows is None for kv in layers)
        assert bool(reads) is not keep  # with the copies, no host row crossed back during the prefill
        tokens, _ = runner.decode(first.argmax(-1), 6)
        runs.append((first, tokens))
    for first, tokens in runs[1:]:
        assert torch.equal(runs[0][0], first) and torch.equal(runs[0][1], tokens)
