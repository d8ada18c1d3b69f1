"""Fluxion's granularity-budget selector (its §5.3): per GQA group, the logical block size that minimises
the data a step reads (Eq. 3), then each head's own top blocks at that size, unioned over the group.

Logical blocks are made of the host tier's 16-token blocks: the coarser digests come from the 16-token ones
(min of mins, max of maxes, `reference.coarsen_digest`), and the selection is returned as 16-token block ids, so
the CPU kernels read exactly what they read for `quest`.

Everything here is fixed-shape tensor code with no host synchronisation: it runs on the compute device inside a
decode step (and can be recorded in a CUDA graph).
"""

from __future__ import annotations

import math

import torch

from ..kernels.reference import coarsen_digest
from .base import NONE, Selection
from .fluxion_search import budget_at, head_block_bounds


def data_volume(budgets: torch.Tensor, host_rows: torch.Tensor, blocks: torch.Tensor, num_kv_heads: int):
    """Eq. 3 for every GQA group and candidate block size:
    V(blk) = 2 * L / blk + 2 * L * sum_h bgt_h(blk)   (digest reads + KV reads, in units of D elements).

    budgets: [B, Hq, len(blocks)] each head's budget at each block size (0 for a head that selects nothing);
    host_rows: [B] L, the host tier's rows; blocks: [len(blocks)] the candidate sizes (a tensor on the budgets'
    device, so nothing is copied to the device here). Returns [B, Hkv, len(blocks)] float32.
    """
    batch, num_q_heads, n = budgets.shape
    rows = host_rows.float()[:, None, None]
    per_group = budgets.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, n).sum(2)
    metadata = 2.0 * rows / blocks.float()
    return metadata + 2.0 * rows * per_group


def choose_granularity(budgets: torch.Tensor, host_rows: torch.Tensor, blocks: torch.Tensor,
                       num_kv_heads: int) -> torch.Tensor:  # fmt: skip
    """[B, Hkv] index into `blocks` minimising Eq. 3 per group (the smaller block size on a tie)."""
    return data_volume(budgets, host_rows, blocks, num_kv_heads).argmin(dim=-1)


def head_budgets(bgt0: torch.Tensor, k: torch.Tensor, active: torch.Tensor, blocks: tuple[int, ...]):
    """Eq. 1 at every candidate block size: [B, Hq, len(blocks)], 0 for inactive (skipped) heads."""
    per_block = torch.stack([budget_at(bgt0, k, b) for b in blocks], dim=-1)
    return per_block * active[..., None]


def select_blocks(
    q: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    budgets: torch.Tensor,
    choice: torch.Tensor,
    host_rows: torch.Tensor,
    blocks: tuple[int, ...],
    base_block: int,
) -> torch.Tensor:
    """Each head's top `ceil(bgt_h(blk) * L / blk)` logical blocks by its own Quest bound, at its group's block
    size `blocks[choice]`, unioned over the group and given as base blocks.

    q: [B, Hq, D]; key_min / key_max: [B, Hkv, nblk, D] digests of base blocks (`base_block` rows each; an empty
    block is (+inf, -inf)); budgets: [B, Hq, len(blocks)] from `head_budgets`; choice: [B, Hkv]; host_rows: [B].
    Returns a mask [B, Hkv, nblk] bool of the base blocks to attend: never an empty one, though a logical block
    that ends past the live rows (or holds all-padding base blocks) is ranked by the live ones it holds.
    """
    batch, num_kv_heads, nblk, _ = key_min.shape
    num_q_heads = q.shape[1]
    group = num_q_heads // num_kv_heads
    chosen = torch.zeros(batch, num_kv_heads, nblk, dtype=torch.bool, device=q.device)
    for j, block in enumerate(blocks):
        factor = block // base_block
        kmin, kmax = coarsen_digest(key_min, key_max, factor)
        bounds = head_block_bounds(q, kmin, kmax)  # [B, Hq, n]
        n = bounds.shape[-1]
        count = torch.ceil(budgets[..., j] * host_rows.float()[:, None] / block).long().clamp(0, n)  # [B, Hq]
        order = torch.argsort(bounds, dim=-1, descending=True)
        take = torch.arange(n, device=q.device) < count[..., None]
        picked = torch.zeros_like(take).scatter_(-1, order, take) & torch.isfinite(bounds)
        union = picked.view(batch, num_kv_heads, group, n).any(dim=2)
        base = (
            union[..., None].expand(-1, -1, -1, factor).reshape(batch, num_kv_heads, n * factor)[..., :nblk]
        )
        chosen |= base & (choice == j)[..., None]
    # an empty base block (past the live rows, or all padding) holds none of the cache's tokens: never send the
    # CPU to read it
    return chosen & ~(key_min > key_max).any(dim=-1)


def mask_to_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, n] bool -> [B, Hkv, n] int64, contiguous: the selected block ids ascending, then n (past every
    block)."""
    n = mask.shape[-1]
    if n == 0:
        return torch.empty(mask.shape, dtype=torch.long, device=mask.device)
    # each selected id goes to its rank among the selected (a running count), the others to the last slot, which
    # only a row with nothing left out fills with a selected id: O(n), faster on a CPU than sorting the ids,
    # and no spare column, so that the result stays contiguous (`ids_selection` bisects its rows)
    ranks = mask.cumsum(-1)
    slot = torch.where(mask, ranks - 1, n - 1)
    ids = torch.full(mask.shape, n, dtype=torch.long, device=mask.device)
    ids.scatter_(-1, slot, torch.arange(n, device=mask.device).expand_as(slot))
    ids[..., -1].masked_fill_(ranks[..., -1] < n, n)
    return ids


def ids_selection(from_device: torch.Tensor, block_size: int | None):
    """The Selection of `mask_to_ids` output [B, Hkv, n] on the host: each KV head's ids up to its first invalid
    pick (n), as blocks of `block_size` rows or, with None, as rows; NONE when no head selected anything. The
    lengths are found by bisection (the rows are sorted), so only the first `max(lengths)` columns are read:
    the rows are as wide as the host tier's capacity, and the selection a fraction of it."""
    width = from_device.shape[-1]
    bound = torch.full(
        (*from_device.shape[:-1], 1), width, dtype=from_device.dtype, device=from_device.device
    )
    lengths = torch.searchsorted(from_device, bound).squeeze(-1)
    most = int(lengths.max()) if lengths.numel() else 0
    if most == 0:
        return NONE
    ids = from_device[..., :most]
    return Selection(
        "blocks" if block_size else "rows", ids.masked_fill(ids >= width, 0), lengths, block_size
    )


def blocks_for_budget(budget: float, host_rows: int, block: int) -> int:
    """Blocks a head with `budget` attends at logical block size `block` (what `select_blocks` counts)."""
    return math.ceil(budget * host_rows / block)
