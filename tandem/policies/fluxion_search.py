"""Fluxion's output-aware budgets (its Eq. 2) and the budget-granularity law (Eq. 1).

For one decode query per request and head, `min_budgets` finds the smallest share of the host (CPU) segment a
head must attend, at a given logical block size, for its attention output to stay within `tau` of full
attention, the error normalised by the largest full output of the layer's heads at that step:

    ||o_h(bgt, blk) - o_h|| / max_h' ||o_h'|| <= tau                                        (Eq. 2)

The hot segment (sinks + recent window) is always attended; blocks of the host segment are added best first by
Quest's bound on q.k (`blk` = 1 ranks by the exact logit). "Smallest" means the smallest budget from which every
larger one also meets tau, so a budget meets tau exactly when it is at least this one (the error of adding
blocks best first is not monotone; the rule makes "meets tau" a threshold, which is what a predicted budget is
judged by). Budgets count attended rows over the segment's real (non-padding) rows.

A head whose error with nothing of the host segment attended is within tau is a streaming head at that step.
"""

from __future__ import annotations

import math

import torch

from ..kernels.reference import coarsen_digest

CALIBRATION_BLOCKS = (1, 16, 32, 64, 128)  # Eq. 1 is fitted over these (Fluxion §5.2)
SELECTION_BLOCKS = (16, 32, 64, 128)  # what the selector chooses from (§5.3)


def block_digests(keys: torch.Tensor, mask: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dim min/max of keys over each block of `block` rows, padding excluded.

    keys: [B, Hkv, T, D]; mask: [B, T] bool (True = real row). T need not be a multiple of `block`: the last
    block is short. Returns (key_min, key_max) [B, Hkv, ceil(T / block), D]; an all-padding block is (+inf, -inf).
    """
    keys = keys.float()
    real = mask[:, None, :, None]
    # a row is its own digest; coarsening takes the min of mins and max of maxes, a short last block included
    return coarsen_digest(keys.masked_fill(~real, math.inf), keys.masked_fill(~real, -math.inf), block)


def head_block_bounds(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q.k over each block, per query head (not combined over the group).

    q: [B, Hq, D]; key_min / key_max: [B, Hkv, nblk, D]. Returns [B, Hq, nblk] float32; an all-padding block
    (min > max) scores -inf.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_min.shape[1]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, 1, head_dim)
    kmin, kmax = key_min.float()[:, :, None], key_max.float()[:, :, None]
    bound = torch.nan_to_num(torch.maximum(qg * kmin, qg * kmax), nan=0.0, posinf=0.0, neginf=0.0).sum(-1)
    empty = (key_min > key_max).any(dim=-1)[:, :, None]  # [B, Hkv, 1, nblk]
    return bound.masked_fill(empty, -math.inf).view(batch, num_q_heads, -1)


def _logits(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, Hkv, G, T] scaled logits, -inf at padding rows."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    logits = torch.einsum("bhgd,bhtd->bhgt", qg, keys.float()) * scale
    return logits.masked_fill(~mask[:, None, None, :], -math.inf)


def prefix_errors(
    q: torch.Tensor,
    hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cpu: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 2's error for every budget of one block size: the hot segment plus the best `j` host blocks.

    q: [B, Hq, D]; hot, cpu: (keys [B, Hkv, T, D], values, mask [B, T]) of each segment; the hot segment must hold
    at least one real row per request. Returns (errors [B, Hq, nblk + 1], rows [B, Hq, nblk + 1]): entry j is
    the error with the j best blocks attended, and the real host rows those blocks hold. Entry nblk is full
    attention (error exactly 0).
    """
    k_hot, v_hot, m_hot = hot
    k_cpu, v_cpu, m_cpu = cpu
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, rows = k_cpu.shape[1], k_cpu.shape[2]
    group = num_q_heads // num_kv_heads
    s_hot = _logits(q, k_hot, m_hot, scale)
    s_cpu = _logits(q, k_cpu, m_cpu, scale)
    top = torch.maximum(s_hot.amax(-1), s_cpu.amax(-1) if rows else s_hot.amax(-1))  # finite: hot not empty
    w_hot = torch.exp(s_hot - top[..., None])
    num = torch.einsum("bhgt,bhtd->bhgd", w_hot, v_hot.float())  # [B, Hkv, G, D]
    den = w_hot.sum(-1)
    nblk = -(-rows // block)
    pad = nblk * block - rows
    w_cpu = torch.exp(s_cpu - top[..., None])
    values = v_cpu.float()
    real = m_cpu
    if pad:
        w_cpu = torch.nn.functional.pad(w_cpu, (0, pad))
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        real = torch.nn.functional.pad(real, (0, pad), value=False)
    w_blk = w_cpu.view(batch, num_kv_heads, group, nblk, block)
    block_num = torch.einsum(
        "bhgnk,bhnkd->bhgnd", w_blk, values.view(batch, num_kv_heads, nblk, block, head_dim)
    )
    block_den = w_blk.sum(-1)  # [B, Hkv, G, nblk]
    block_rows = real.view(batch, nblk, block).sum(-1)  # [B, nblk]
    if block == 1:
        bounds = s_cpu.reshape(batch, num_q_heads, rows) / scale  # Quest's bound at one row is q.k itself
    else:
        bounds = head_block_bounds(q, *block_digests(k_cpu, m_cpu, block))
    order = torch.argsort(bounds.view(batch, num_kv_heads, group, nblk), dim=-1, descending=True, stable=True)
    num_sorted = torch.gather(block_num, 3, order[..., None].expand(-1, -1, -1, -1, head_dim))
    den_sorted = torch.gather(block_den, 3, order)
    rows_sorted = torch.gather(block_rows[:, None, None, :].expand(-1, num_kv_heads, group, -1), 3, order)
    zero = num.new_zeros(batch, num_kv_heads, group, 1)
    cum_num = torch.cat([zero[..., None].expand(-1, -1, -1, -1, head_dim), num_sorted.cumsum(3)], dim=3)
    cum_den = torch.cat([zero, den_sorted.cumsum(3)], dim=3)
    cum_rows = torch.cat([zero.long(), rows_sorted.cumsum(3)], dim=3)
    outs = (num[:, :, :, None] + cum_num) / (den[:, :, :, None] + cum_den)[
        ..., None
    ]  # [B, Hkv, G, nblk+1, D]
    full = outs[:, :, :, -1:]
    scale_ref = full.norm(dim=-1).amax(dim=(1, 2)).clamp_min(1e-30)  # [B, 1]: max_h' ||o_h'||
    errors = (outs - full).norm(dim=-1) / scale_ref[:, None, None]
    return errors.view(batch, num_q_heads, nblk + 1), cum_rows.view(batch, num_q_heads, nblk + 1)


def min_budgets(
    q: torch.Tensor,
    hot: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cpu: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    blocks: tuple[int, ...],
    taus: tuple[float, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest Eq. 2 budget of each head at each block size and threshold, and its error with none.

    Returns (budgets [B, Hq, len(blocks), len(taus)] in [0, 1], share of the host segment's real rows;
    streaming_error [B, Hq], the error with only the hot segment attended). A request with no real host row
    gets budget 0 and error 0.
    """
    real_rows = cpu[2].sum(-1).float()  # [B]
    tau = torch.tensor(taus, dtype=torch.float32, device=q.device)
    per_block = []
    errors = None
    for block in blocks:
        errors, rows = prefix_errors(q, hot, cpu, scale, block)
        suffix_max = errors.flip(-1).cummax(-1).values.flip(-1)  # [B, Hq, n+1]
        ok = suffix_max[..., None] <= tau  # [B, Hq, n+1, T]
        first = ok.float().argmax(dim=2)  # the first budget from which every larger one meets tau
        attended = torch.gather(rows[..., None].expand(-1, -1, -1, len(taus)), 2, first[:, :, None]).squeeze(
            2
        )
        per_block.append(attended.float() / real_rows.clamp_min(1)[:, None, None])
    budgets = torch.stack(per_block, dim=2).clamp(0.0, 1.0)
    streaming_error = errors[..., 0] if errors is not None else q.new_zeros(q.shape[:2])
    return budgets, streaming_error.where(real_rows[:, None] > 0, torch.zeros_like(streaming_error))


def fit_budget_law(budgets: torch.Tensor, blocks: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 1, bgt(blk) = bgt0 + k log2(blk), fitted by least squares over `blocks` with bgt0 the measured budget
    at the first (finest) block size, as Fluxion §5.2 sets it.

    budgets: [..., len(blocks)]. Returns (bgt0 [...], k [...]).
    """
    if blocks[0] != 1 or len(blocks) < 2:
        raise ValueError(
            f"blocks={blocks}: Eq. 1's bgt0 is the budget at block size 1, so blocks must start at 1"
        )
    x = torch.tensor([math.log2(b) for b in blocks], dtype=torch.float32, device=budgets.device)
    bgt0 = budgets[..., 0]
    k = ((budgets - bgt0[..., None]) * x).sum(-1) / (x * x).sum()
    return bgt0, k


def budget_at(bgt0: torch.Tensor, k: torch.Tensor, block: int | torch.Tensor) -> torch.Tensor:
    """Eq. 1: the budget at logical block size `block`, clamped to [0, 1]. A Python number stays one (nothing is
    copied to the device, so this runs inside a CUDA graph capture)."""
    if isinstance(block, (int, float)):
        log_block = math.log2(block)
    else:
        log_block = torch.log2(block.to(device=bgt0.device, dtype=torch.float32))
    return (bgt0 + k * log_block).clamp(0.0, 1.0)
