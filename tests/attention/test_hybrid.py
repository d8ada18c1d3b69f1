"""Hybrid attention over the tiered cache against plain dense attention (kernels.reference)."""

from types import SimpleNamespace

import pytest
import torch

from tandem.attention import TaskPool, attend
from tandem.attention.hybrid import causal_mask
from tandem.cache import LayerKV
from tandem.config import HgcaConfig, QuestConfig, TandemConfig
from tandem.kernels import reference
from tandem.kernels.ops import native_cpu_available
from tests.tolerances import TOLERANCES

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
    ),
]


class Sequence:
    """Random q/k/v for `total` tokens of a ragged batch (left padding) and the dense reference."""

    def __init__(self, batch, num_q_heads, num_kv_heads, head_dim, total, pads, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(batch, num_q_heads, total, head_dim, generator=g).to(dtype)
        self.k = torch.randn(batch, num_kv_heads, total, head_dim, generator=g).to(dtype)
        self.v = torch.randn(batch, num_kv_heads, total, head_dim, generator=g).to(dtype)
        self.valid = torch.ones(batch, total, dtype=torch.bool)
        for b, pad in enumerate(pads):
            self.valid[b, :pad] = False
        self.scale = head_dim**-0.5

    def feed(self, layer, pool, start, end, device="cpu"):
        out = attend(
            layer,
            self.q[:, :, start:end].to(device),
            self.k[:, :, start:end].to(device),
            self.v[:, :, start:end].to(device),
            self.valid[:, start:end].to(device),
            self.scale,
            pool,
        )
        return out.cpu()

    def dense(self, start, end):
        mask = causal_mask(self.valid, start, end, 0, end)
        out, _ = reference.attention_lse(
            self.q[:, :, start:end], self.k[:, :, :end], self.v[:, :, :end], self.scale, mask
        )
        return out


def _check(actual, expected, valid, dtype):
    # padding queries' outputs are never used; compare real tokens only
    rows = valid[:, None, :, None].expand_as(expected)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.float()[rows], expected[rows], **TOLERANCES[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_policy_equals_dense_over_many_decode_steps(group, dtype, device):
    num_kv_heads, prompt, steps = 2, 61, 45
    seq = Sequence(3, num_kv_heads * group, num_kv_heads, 16, prompt + steps, pads=[0, 7, 23], dtype=dtype)
    cfg = TandemConfig(
        policy="full", sink_tokens=5, window_tokens=13, block_size=4, prefill_chunk=16, device="cpu"
    )
    layer = LayerKV(cfg, 0, num_kv_heads * group, num_kv_heads, 16)
    pool = TaskPool(2)
    out = seq.feed(layer, pool, 0, prompt, device)
    _check(out, seq.dense(0, prompt), seq.valid[:, :prompt], dtype)
    evicted_before = layer.host.rows
    assert layer.hot.keys.device.type == device and layer.host.keys.device.type == "cpu"
    assert layer.host.keys.is_pinned() == (device == "cuda")
    for t in range(prompt, prompt + steps):
        out = seq.feed(layer, pool, t, t + 1, device)
        _check(out, seq.dense(t, t + 1), seq.valid[:, t : t + 1], dtype)
    assert layer.host.rows > evicted_before  # decode evicted blocks to the host tier
    assert layer.rows_attended == layer.rows_available  # full attends every real host entry


@pytest.mark.parametrize("device", DEVICES)
def test_decode_from_a_prompt_inside_the_hot_tier_stays_dense_as_blocks_start_to_move_to_the_host(device):
    """While nothing is offloaded the decode path skips the CPU part and the merge (CPU); every step still equals
    dense attention, before and after the first block reaches the host tier."""
    seq = Sequence(2, 8, 2, 16, 6 + 40, pads=[0, 2])
    cfg = TandemConfig(
        policy="full", sink_tokens=5, window_tokens=13, block_size=4, prefill_chunk=16, device="cpu"
    )
    layer = LayerKV(cfg, 0, 8, 2, 16)
    pool = TaskPool(1)
    _check(seq.feed(layer, pool, 0, 6, device), seq.dense(0, 6), seq.valid[:, :6], torch.float32)
    host_rows = []
    for t in range(6, 46):
        host_rows.append(layer.host.rows if layer.host is not None else 0)
        out = seq.feed(layer, pool, t, t + 1, device)
        _check(out, seq.dense(t, t + 1), seq.valid[:, t : t + 1], torch.float32)
    assert host_rows[0] == 0 and host_rows[-1] > 0  # both branches ran


@pytest.mark.parametrize("device", DEVICES)
def test_append_on_nonempty_cache_is_exact(device):
    seq = Sequence(2, 8, 2, 32, 150, pads=[0, 11])
    cfg = TandemConfig(
        policy="full", sink_tokens=4, window_tokens=20, block_size=8, prefill_chunk=32, device="cpu"
    )
    layer = LayerKV(cfg, 0, 8, 2, 32)
    pool = TaskPool(1)
    seq.feed(layer, pool, 0, 70, device)
    for t in range(70, 75):
        seq.feed(layer, pool, t, t + 1, device)
    out = seq.feed(layer, pool, 75, 150, device)  # a second prompt turn, 75 tokens, 3 query chunks
    _check(out, seq.dense(75, 150), seq.valid[:, 75:150], torch.float32)


@pytest.mark.parametrize("policy", ["streaming", "hgca", "quest"])
def test_sparse_policies_run_and_report_fraction(policy):
    seq = Sequence(2, 8, 2, 16, 260, pads=[0, 5])
    cfg = TandemConfig(
        policy=policy,
        sink_tokens=4,
        window_tokens=32,
        block_size=8,
        **({"quest": QuestConfig(budget=0.25)} if policy == "quest" else {}),
        device="cpu",
    )
    layer = LayerKV(cfg, 0, 8, 2, 16)
    pool = TaskPool(2)
    seq.feed(layer, pool, 0, 200)
    errs = []
    for t in range(200, 260):
        out = seq.feed(layer, pool, t, t + 1)
        assert torch.isfinite(out).all()
        errs.append((out - seq.dense(t, t + 1)).abs().max().item())
    fraction = layer.rows_attended / layer.rows_available
    if policy == "streaming":
        assert fraction == 0.0
    elif policy == "quest":
        assert 0.2 <= fraction <= 0.3  # budget 25% of blocks (rounded up)
    else:
        assert 0.0 < fraction < 1.0
    assert max(errs) > 1e-4  # sparse: not silently dense


@pytest.mark.parametrize("device", DEVICES)
def test_quest_with_full_budget_and_hgca_with_zero_threshold_equal_dense(device):
    seq = Sequence(2, 8, 4, 16, 180, pads=[3, 0])
    for cfg in (
        TandemConfig(
            policy="quest",
            quest=QuestConfig(budget=1.0),
            sink_tokens=4,
            window_tokens=16,
            block_size=4,
            device="cpu",
        ),
        TandemConfig(
            policy="hgca",
            hgca=HgcaConfig(beta=1e-30),
            sink_tokens=4,
            window_tokens=16,
            block_size=4,
            device="cpu",
        ),
    ):
        layer = LayerKV(cfg, 0, 8, 4, 16)
        pool = TaskPool(2)
        seq.feed(layer, pool, 0, 120, device)
        for t in range(120, 180):
            out = seq.feed(layer, pool, t, t + 1, device)
            _check(out, seq.dense(t, t + 1), seq.valid[:, t : t + 1], torch.float32)


@pytest.mark.parametrize("policy", ["quest", "full"])
@pytest.mark.parametrize("inference_mode", [False, True])
def test_task_pool_threads_do_not_change_results(policy, inference_mode):
    # worker threads must inherit the caller's inference mode (it is thread-local): generate() callers use it
    seq = Sequence(3, 8, 4, 16, 140, pads=[0, 2, 9])
    outs = []
    for threads in (1, 3):
        cfg = TandemConfig(
            policy=policy,
            **({"quest": QuestConfig(budget=0.3)} if policy == "quest" else {}),
            sink_tokens=4,
            window_tokens=16,
            block_size=4,
            device="cpu",
        )
        layer = LayerKV(cfg, 0, 8, 4, 16)
        pool = TaskPool(threads)
        with torch.inference_mode(inference_mode):
            seq.feed(layer, pool, 0, 100)
            outs.append(torch.cat([seq.feed(layer, pool, t, t + 1) for t in range(100, 140)], dim=2))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not native_cpu_available(), reason="no compiled CPU kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_hot_tier_call_matches_the_reference(dtype):
    """On the CPU the hot tier is attended by one prepared compiled call (`DecodeBuffers.hot_call`): the same
    out / lse as the torch reference, invalid ring slots left out, within the dtype's tolerance; a hot tier that
    moves gets a new call."""
    from tandem.attention.decode import DecodeBuffers, hot_part
    from tests.tolerances import assert_close

    gen = torch.Generator().manual_seed(0)
    batch, hq, hkv, slots, dim = 2, 6, 2, 40, 16
    layer = SimpleNamespace(
        hot=SimpleNamespace(
            keys=torch.randn(batch, hkv, slots, dim, generator=gen).to(dtype),
            values=torch.randn(batch, hkv, slots, dim, generator=gen).to(dtype),
            valid=torch.rand(batch, slots, generator=gen) > 0.3,
            generation=0,
            maw=None,
        ),
        policy=SimpleNamespace(needs_maw=False),
        config=SimpleNamespace(host=SimpleNamespace(threads=1)),
    )
    layer.hot.valid[:, 0] = True
    bufs = DecodeBuffers(batch, hq, dim, dtype, torch.device("cpu"))
    for _ in range(2):  # the second call reuses the prepared one
        q = torch.randn(batch, hq, dim, generator=gen).to(dtype)
        out, lse = hot_part(layer, q, 0.25, bufs)
        hot = layer.hot
        want_out, want_lse = reference.hot_decode_attention(q, hot.keys, hot.values, hot.valid, 0.25)
        assert_close(out, want_out.float(), dtype, "out")
        assert_close(lse, want_lse.float(), dtype, "lse")
    first = bufs._hot_call
    layer.hot.keys = layer.hot.keys.clone()  # the tier moved
    layer.hot.generation = 1
    hot_part(layer, q, 0.25, bufs)
    assert bufs._hot_call is not first
