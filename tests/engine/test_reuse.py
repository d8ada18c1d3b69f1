"""State one cache leaves in the process must never change another cache's tokens.

The cause found on the GPU: a host tier's stores came from allocators that recycle freed memory with its old
bytes (torch's pinned-memory cache), uninitialised, and fluxion's coarse logical blocks sent the CPU to the base
blocks past the live rows, whose `valid` flags were another cache's leftovers. The tests here pin both halves on
CPU: host stores start zeroed, and no policy reads a row past the live ones even when those rows hold garbage
marked valid. The seeded many-builds stress test is `test_reuse_stress.py`.
"""

import pytest
import torch

from tandem import TandemCache, TandemConfig
from tandem.cache.memory import host_zeros
from tandem.engine import TandemRunner
from tandem.policies.granularity import select_blocks
from tests.engine.test_engine import DEVICES, _run, _tiny

HOT = {"sink_tokens": 4, "window_tokens": 16}
POLICIES = {
    "full": {"policy": "full"},
    "quest": {"policy": "quest", "quest": {"budget": 0.3}},
    "hgca": {"policy": "hgca"},
    "streaming": {"policy": "streaming"},
    "fluxion-tau0": {"policy": "fluxion", "fluxion": {"tau": 0.0}},
    "quest-epsilon": {"policy": "quest", "certified": {"epsilon": 0.05}, "quest": {"gpu_share": 0.0}},
    "fluxion-tau0-epsilon": {"policy": "fluxion", "fluxion": {"tau": 0.0}, "certified": {"epsilon": 0.05}},
    "quest-int8": {"policy": "quest", "quest": {"budget": 0.3}, "host": {"dtype": "int8"}},
}


def test_host_stores_start_zeroed_whatever_the_allocator_recycles():
    for shape, dtype in (((2, 1024), torch.bool), ((2, 2, 1024, 16), torch.float32)):
        dirty = torch.full(shape, 1, dtype=dtype)
        del dirty  # its block goes back to the allocator, bytes and all
        assert not host_zeros(shape, dtype, pin=False).any()


@torch.inference_mode()
def _poison_past_live_rows(runner) -> None:
    """Rows past each host tier's live ones become garbage marked valid: what a recycled store held before."""
    for layer in runner.layers:
        host = layer.host
        rows = host.rows
        assert host.capacity > rows + host.block_size  # room past the live rows to poison
        host.valid[:, rows:] = True
        codes = host.keys.dtype == torch.int8
        for store in (host.keys, host.values):
            store[:, :, rows:] = 77 if codes else float("nan")
        if codes:
            first = -(-rows // host.block_size)
            host.key_scale[:, :, first:] = float("nan")
            host.value_scale[:, :, first:] = float("nan")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(POLICIES))
def test_no_policy_reads_host_rows_past_the_live_ones(name, device):
    """Every policy decodes the same tokens whether the host rows past the live ones are zeros or garbage
    flagged valid: none selects, attends or counts them. (On CUDA fluxion ranks the device's capacity-wide digest
    mirror, whose coarse blocks once reached past the live rows.)"""
    model = _tiny(device=device)
    ids = torch.randint(0, 128, (2, 211), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    config = TandemConfig(**HOT, **POLICIES[name])
    clean, reference = _run(model, ids, mask, config, 12, chunk_tokens=64)
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    first = runner.prefill(ids, mask, chunk_tokens=64, max_new_tokens=12).argmax(-1)
    _poison_past_live_rows(runner)
    tokens, _ = runner.decode(first, 11)
    assert torch.equal(torch.cat([first.cpu()[:, None], tokens], dim=1), clean)
    assert runner.cache.stats()["mean_fraction_attended"] == pytest.approx(
        reference.cache.stats()["mean_fraction_attended"]
    )


def test_fluxion_selection_never_names_an_empty_base_block():
    """A logical block that ends past the live rows keeps only its live base blocks."""
    gen = torch.Generator().manual_seed(0)
    batch, kv_heads, q_heads, nblk, dim = 2, 2, 4, 13, 8
    live = torch.tensor([10, 7])  # base blocks holding rows, per request; the rest are empty
    key_min = torch.randn(batch, kv_heads, nblk, dim, generator=gen)
    key_max = key_min + torch.rand(batch, kv_heads, nblk, dim, generator=gen)
    empty = torch.arange(nblk)[None, :] >= live[:, None]  # [B, nblk]
    key_min = key_min.masked_fill(empty[:, None, :, None], float("inf"))
    key_max = key_max.masked_fill(empty[:, None, :, None], float("-inf"))
    q = torch.randn(batch, q_heads, dim, generator=gen)
    blocks = (16, 64, 128)
    budgets = torch.ones(batch, q_heads, len(blocks))
    host_rows = live * 16
    for j in range(len(blocks)):
        choice = torch.full((batch, kv_heads), j)
        mask = select_blocks(q, key_min, key_max, budgets, choice, host_rows, blocks, 16)
        assert not (mask & empty[:, None, :]).any(), f"block size {blocks[j]} selected an empty base block"
        assert mask[~empty[:, None, :].expand_as(mask)].all()  # at budget 1 every live block
