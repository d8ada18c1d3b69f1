"""Launchers of the step's task-queue kernels (`queue_kernels`). Each validates its inputs, then launches."""

from __future__ import annotations

import torch

from ._common import _block_d, _check, _dot_options, _group_pad, _guard, _positive_int, _sm_count, interpreted
from .attention import BLOCK_N

try:
    import triton

    from . import queue_kernels as _kernels
except ImportError:  # the torch references remain usable without triton
    triton = _kernels = None


def claim_probe(counter: torch.Tensor, owner: torch.Tensor, n: int, programs: int) -> None:
    """Queue `programs` GPU programs that claim indices [0, n) from `counter` ([1] int32, pinned) with
    system-scope atomic adds, each writing its program id + 1 into `owner` ([n] int32, pinned) at the indices it
    took (`benchmarks/bench_queue_claims.py`)."""
    _check(
        counter.is_pinned() and counter.dtype == torch.int32 and counter.numel() == 1,
        "counter must be [1] int32 pinned",
    )
    _check(
        owner.is_pinned() and owner.dtype == torch.int32 and owner.numel() >= n,
        "owner must be [>= n] int32 pinned",
    )
    _check(_positive_int(programs), f"programs must be a positive int, got {programs!r}")
    device = torch.device("cuda", torch.cuda.current_device())
    with _guard(device):
        _kernels.claim_probe_kernel[(programs,)](counter, owner, n)


def queue_attention(
    q, keys, values, valid, ids, plan, control, cursor, part_out, part_lse, first, count, out, lse,
    limit, pieces_max, piece_blocks, block_size, scale, programs=None,
):  # fmt: skip
    """The GPU's side of a step's task queue (`tandem.attention.queue`): `programs` persistent programs take
    pieces of the plan from the front and attend them into (part_out, part_lse), then one program per (request,
    query head) merges its segment's pieces into (out, lse). The caller zeroes `cursor` and fills `part_lse` with
    -inf before (both on the stream, so a recorded graph does it each step).

    q [B, Hq, D] on CUDA; keys / values [B, Hkv, T, D] q's dtype, pinned or on q's device; valid [B, T] bool next
    to them; ids [B, Hkv, K] int64 on q's device; plan [2 + P + B * Hkv + 3P] int32 on q's device and control its
    pinned copy (the flags live there); cursor [1] int32; part_out [P, G, D], part_lse [P, G], out [B, Hq, D],
    lse [B, Hq] float32; first / count [B * Hkv] int32.
    """
    device = q.device
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_rows = keys.shape[1], keys.shape[2]
    group = num_q_heads // num_kv_heads
    capacity = part_lse.shape[0]
    nseg = batch * num_kv_heads
    _check(keys.dtype == q.dtype and values.dtype == q.dtype, "keys / values must have q's dtype")
    _check(ids.dtype == torch.int64 and ids.shape[:2] == (batch, num_kv_heads) and ids.stride(-1) == 1,
           "ids must be [B, Hkv, K] int64, contiguous in K")  # fmt: skip
    _check(plan.numel() == 2 + capacity + nseg + 3 * capacity and control.numel() == plan.numel(),
           "plan / control must hold 2 + P + B * Hkv + 3P int32")  # fmt: skip
    _check(part_out.shape == (capacity, group, head_dim), "part_out must be [P, G, D]")
    if programs is None:
        programs = _sm_count(device)
    base = 2 + capacity + nseg
    gpu_flags = control[base : base + capacity]
    cpu_flags = control[base + capacity : base + 2 * capacity]
    decided = control[base + 2 * capacity : base + 3 * capacity]
    group_pad = _group_pad(group)
    with _guard(device):
        _kernels.queue_attention_kernel[(programs,)](
            q, keys, values, valid.view(torch.uint8), ids, plan, cursor, gpu_flags, cpu_flags, decided,
            part_out, part_lse, num_rows, ids.shape[2], int(limit), num_kv_heads, group, int(pieces_max),
            capacity, float(scale), *q.stride()[:2], *keys.stride()[:3], *values.stride()[:3], *valid.stride(),
            *ids.stride()[:2],
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), GROUP_PAD=group_pad, BLOCK_N=BLOCK_N,
            BLOCK_SIZE=int(block_size), PIECE_BLOCKS=int(piece_blocks),
            RNE_BF16=interpreted() and q.dtype == torch.bfloat16, **_dot_options(q.dtype), num_warps=4,
        )  # fmt: skip
        _kernels.queue_combine_kernel[(batch, num_q_heads)](
            part_out, part_lse, first, count, out, lse, num_kv_heads, group, *out.stride()[:2], *lse.stride(),
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
            PIECES_PAD=min(64, triton.next_power_of_2(max(int(pieces_max), 1))), num_warps=4,
        )  # fmt: skip
    return out, lse
