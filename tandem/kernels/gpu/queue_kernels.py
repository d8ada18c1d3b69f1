"""Kernels of the step's task queue on the device (`tandem.attention.queue`): the GPU's worker, which takes pieces
of the step's sparse attention from a counter in pinned host memory with system-scope atomics, and the merge of
the pieces it took. Only `@triton.jit` functions live here; `queue.py` validates and launches.
"""

import triton
import triton.language as tl

from ._common_kernels import _empty_state, _finish
from .attention_kernels import _and_valid, _attend_rows, _query_group


@triton.jit
def claim_probe_kernel(counter_ptr, owner_ptr, n):
    """Grid (P,): each program claims indices from the pinned counter until they reach n, marking owner = pid + 1."""
    pid = tl.program_id(0)
    index = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")
    while index < n:
        tl.store(owner_ptr + index, pid + 1)
        index = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="sys")


@triton.jit
def _fence_sc_sys(x):
    """A sequentially consistent fence at system scope (orders this thread's earlier stores to pinned host memory
    before its later loads from it, as the queue's handshake needs); returns x."""
    return tl.inline_asm_elementwise(
        "fence.sc.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def queue_attention_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [B, Hkv, T, D] (pinned host memory read through UVA, or device memory)
    v_ptr,
    valid_ptr,  # [B, T] uint8
    ids_ptr,  # [B, Hkv, K] int64: each segment's blocks, the valid ones (< limit) first
    plan_ptr,  # [2 + P] int32 on the device: n, split, then the pieces (segment * pieces_max + piece)
    cursor_ptr,  # [1] int32 on the device, 0 before the launch
    gpu_flags_ptr,  # [P] int32 pinned: 1 once this side reached the piece
    cpu_flags_ptr,  # [P] int32 pinned: the CPU's flags
    decided_ptr,  # [P] int32 pinned: 1 taken, 2 yielded (written by this side)
    part_out_ptr,  # [P, G, D] fp32: the pieces this side took
    part_lse_ptr,  # [P, G] fp32 (-inf before the launch)
    num_rows,
    width,
    limit,
    num_kv_heads,
    group,
    pieces_max,
    capacity,
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_mb,
    stride_mt,
    stride_ib,
    stride_ih,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PIECE_BLOCKS: tl.constexpr,
    RNE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (programs,): the GPU's worker of a step's task queue (`tandem.attention.queue`; the protocol is
    described in kernels/cpu/csrc/queue.cpp). Each program takes pieces from the front with the device cursor;
    with split == n it settles each with the CPU first (flag, fence, the CPU's flag) and stops at the first piece
    the CPU reached, else it keeps to [0, split). A piece it takes is attended into its part slot."""
    n = tl.load(plan_ptr)
    split = tl.load(plan_ptr + 1)
    shared = split >= n
    end = tl.where(shared, n, split)
    u = tl.atomic_add(cursor_ptr, 1)
    go = u < end
    while go:
        take = u >= 0
        if shared:
            tl.store(gpu_flags_ptr + u, 1)
            seen = tl.load(cpu_flags_ptr + _fence_sc_sys(u), volatile=True)
            take = seen == 0
            tl.store(decided_ptr + u, tl.where(take, 1, 2))
            _fence_sc_sys(u)
        if take:
            entry = tl.load(plan_ptr + 2 + u)
            seg = (entry // pieces_max).to(tl.int64)
            piece = (entry % pieces_max).to(tl.int64)
            b = seg // num_kv_heads
            kv_head = seg % num_kv_heads
            q, head, row_ok, d, d_ok = _query_group(
                q_ptr + b * stride_qb, kv_head, group, stride_qh, HEAD_DIM, BLOCK_D, GROUP_PAD
            )
            ids_base = ids_ptr + b * stride_ib + kv_head * stride_ih
            first = piece * PIECE_BLOCKS
            length = tl.load(plan_ptr + 2 + capacity + seg).to(tl.int64)
            stop = tl.minimum(tl.minimum(length, width), first + PIECE_BLOCKS)
            n_off = tl.arange(0, BLOCK_N)
            k_base = k_ptr + b * stride_kb + kv_head * stride_kh
            v_base = v_ptr + b * stride_vb + kv_head * stride_vh
            valid_base = valid_ptr + b * stride_mb
            m_i, l_i, acc = _empty_state(GROUP_PAD, BLOCK_D)
            for start in range(0, PIECE_BLOCKS * BLOCK_SIZE, BLOCK_N):
                n_row = start + n_off
                entry_i = first + n_row // BLOCK_SIZE
                in_range = entry_i < stop
                block = tl.load(ids_base + entry_i, mask=in_range, other=limit).to(tl.int64)
                block_ok = in_range & (block >= 0) & (block < limit)
                row = tl.where(block_ok, block, 0) * BLOCK_SIZE + n_row % BLOCK_SIZE
                live = _and_valid(block_ok & (row < num_rows), valid_base, row, stride_mt)
                m_i, l_i, acc = _attend_rows(
                    q, k_base, v_base, row, stride_kt, stride_vt, d, live, d_ok, live[None, :], m_i, l_i, acc,
                    scale, q_ptr, q_ptr, 1, 0, RNE_BF16, DOT_PRECISION, UPCAST,
                )  # fmt: skip
            out, lse = _finish(m_i, l_i, acc)
            g = tl.arange(0, GROUP_PAD)
            slot = u * group + g
            tl.store(
                part_out_ptr + slot[:, None] * HEAD_DIM + d[None, :],
                out,
                mask=row_ok[:, None] & d_ok[None, :],
            )
            tl.store(part_lse_ptr + slot, lse, mask=row_ok)
        u = tl.atomic_add(cursor_ptr, 1)
        go = take & (u < end)


@triton.jit
def queue_combine_kernel(
    part_out_ptr,  # [P, G, D] fp32
    part_lse_ptr,  # [P, G] fp32: -inf for the pieces the GPU did not take
    first_ptr,  # [B * Hkv] int32: each segment's first piece in the plan
    count_ptr,  # [B * Hkv] int32: its number of pieces
    out_ptr,  # [B, Hq, D] fp32
    lse_ptr,  # [B, Hq] fp32
    num_kv_heads,
    group,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PIECES_PAD: tl.constexpr,
):
    """Grid (B, Hq): the LSE merge of the pieces of one query head's segment that the GPU took (0, -inf if none)."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    seg = b * num_kv_heads + head // group
    g = head % group
    first = tl.load(first_ptr + seg).to(tl.int64)
    count = tl.load(count_ptr + seg).to(tl.int64)
    p = tl.arange(0, PIECES_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, count, PIECES_PAD):
        live = start + p < count
        slot = first + start + p
        lse = tl.load(part_lse_ptr + slot * group + g, mask=live, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        keep = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - m_safe))
        part = tl.load(
            part_out_ptr + (slot[:, None] * group + g) * HEAD_DIM + d[None, :],
            mask=live[:, None] & d_ok[None, :] & (lse != float("-inf"))[:, None],
            other=0.0,
        )
        acc = acc * keep + tl.sum(part * weight[:, None], axis=0)
        total = total * keep + tl.sum(weight, axis=0)
        m = m_new
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    lse_out = tl.where(
        empty, float("-inf"), tl.where(m == float("-inf"), 0.0, m) + tl.log(tl.where(empty, 1.0, total))
    )
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out, mask=d_ok)
    tl.store(lse_ptr + b * stride_lb + head * stride_lh, lse_out)
