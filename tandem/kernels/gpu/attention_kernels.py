"""Attention kernels of the GPU path: hot-tier decode (with HGCA's moving average), zero-copy attention over
selected blocks of a host store with its split combine, the in-place LSE merge, and prefill flash attention.
Only `@triton.jit` functions live here; `attention.py` validates and launches.

Shared conventions: fp32 accumulation, natural-log lse, and a query row with nothing to attend ends with
out = 0 and lse = -inf (never NaN). One program serves a whole GQA query group: the group's rows are padded
up to GROUP_PAD (>= 16, what `tl.dot` needs) and masked. Batch and head offsets are computed in int64 so
stores larger than 2**31 elements address correctly.
"""

import triton
import triton.language as tl

from ._common_kernels import _attend_tile, _dot, _empty_state, _finish, _load_rows


@triton.jit
def _query_group(
    q_ptr, kv_head, group, stride_qh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP_PAD: tl.constexpr
):
    """The decode queries of KV head kv_head's GQA group from one request's q [Hq, D] at q_ptr.

    Returns q [GROUP_PAD, BLOCK_D] (0 past the group and past HEAD_DIM), the query heads head [GROUP_PAD] and
    row_ok (which of them are real), the columns d [BLOCK_D] and d_ok (which lie within HEAD_DIM).
    """
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    d_ok = d < HEAD_DIM
    head = kv_head * group + g
    row_ok = g < group
    q = tl.load(
        q_ptr + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0
    )
    return q, head, row_ok, d, d_ok


@triton.jit
def _and_valid(ok, valid_ptr, row, stride):
    """ok [N] and the validity byte of each row (valid_ptr[row * stride], a bool viewed as uint8), read where ok."""
    return ok & (tl.load(valid_ptr + row * stride, mask=ok, other=0) != 0)


@triton.jit
def _attend_rows(
    q,
    k_base,
    v_base,
    row,
    stride_k,
    stride_v,
    d,
    read,
    d_ok,
    live,
    m_i,
    l_i,
    acc,
    scale,
    k_scale_base,
    v_scale_base,
    scale_group,
    QUANT: tl.constexpr,
    RNE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One step of a kernel's key loop: K and V rows `row` [N] of one head, read where `read` [N] (see
    `_load_rows`; with QUANT 0 the scale arguments are never read), attended where `live` ([1, N] or [ROWS, N])
    and folded into the running (m_i, l_i, acc) by `_attend_tile`."""
    k = _load_rows(k_base, row, stride_k, d, read, d_ok, k_scale_base, scale_group, q.dtype, QUANT, RNE_BF16)
    v = _load_rows(v_base, row, stride_v, d, read, d_ok, v_scale_base, scale_group, q.dtype, QUANT, RNE_BF16)
    m_i, l_i, acc = _attend_tile(q, k, v, live, m_i, l_i, acc, scale, DOT_PRECISION, UPCAST)
    return m_i, l_i, acc


@triton.jit
def hot_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [B, Hkv, S, D]
    v_ptr,  # [B, Hkv, S, D]
    valid_ptr,  # [B, S] uint8 (a bool tensor viewed as bytes)
    out_ptr,  # [B, Hq, D] fp32
    lse_ptr,  # [B, Hq] fp32
    maw_ptr,  # [B, Hq, S] fp32, read only when HAS_MAW
    num_slots,
    group,
    scale,
    alpha,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_mb,
    stride_ms,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    stride_wb,
    stride_wh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_MAW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (B, Hkv): one decode query group over all S slots of the hot tier, tiled by BLOCK_S."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    q, head, row_ok, d, d_ok = _query_group(
        q_ptr + b * stride_qb, kv_head, group, stride_qh, HEAD_DIM, BLOCK_D, GROUP_PAD
    )
    s_off = tl.arange(0, BLOCK_S)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    valid_base = valid_ptr + b * stride_mb

    m_i, l_i, acc = _empty_state(GROUP_PAD, BLOCK_D)
    for start in range(0, num_slots, BLOCK_S):
        s = start + s_off
        live = _and_valid(s < num_slots, valid_base, s, stride_ms)
        m_i, l_i, acc = _attend_rows(
            q, k_base, v_base, s, stride_ks, stride_vs, d, live, d_ok, live[None, :], m_i, l_i, acc, scale,
            k_base, v_base, 1, QUANT=0, RNE_BF16=False, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST,
        )  # fmt: skip
    out, lse = _finish(m_i, l_i, acc)
    tl.store(
        out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + b * stride_lb + head * stride_lh, lse, mask=row_ok)

    if HAS_MAW:
        # HGCA's moving average needs each slot's final softmax weight, so the logits are recomputed
        lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
        maw_base = maw_ptr + b * stride_wb + head[:, None] * stride_wh
        for start in range(0, num_slots, BLOCK_S):
            s = start + s_off
            in_range = s < num_slots
            live = _and_valid(in_range, valid_base, s, stride_ms)
            k = tl.load(
                k_base + s[:, None] * stride_ks + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0
            )
            qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale
            p = tl.where(live[None, :], tl.exp(qk - lse_safe[:, None]), 0.0)
            tile_ok = row_ok[:, None] & in_range[None, :]
            maw = tl.load(maw_base + s[None, :], mask=tile_ok, other=0.0)
            tl.store(maw_base + s[None, :], (1.0 - alpha) * maw + alpha * p, mask=tile_ok)


@triton.jit
def block_attention_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [B, Hkv, T, D] (pinned host memory read through UVA, or device memory)
    v_ptr,  # [B, Hkv, T, D]
    valid_ptr,  # [B, T] uint8
    ids_ptr,  # [B, Hkv, S] int32 / int64 block ids
    lengths_ptr,  # [B, Hkv] int32 / int64
    out_ptr,  # [B, Hq, splits, D] fp32
    lse_ptr,  # [B, Hq, splits] fp32
    k_scale_ptr,  # [B, Hkv, T // G] fp32, read only when QUANT
    v_scale_ptr,  # [B, Hkv, T // G] fp32
    num_rows,
    width,
    entries_per_split,
    group,
    scale,
    scale_group,  # G: rows per scale
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
    stride_is,
    stride_nb,
    stride_nh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ksb,
    stride_ksh,
    stride_vsb,
    stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    RNE_BF16: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (B, Hkv, splits): one query group over its selected blocks [split * entries_per_split, ...).

    The selected blocks are flattened into rows (entry = n // BLOCK_SIZE, row = id * BLOCK_SIZE + n % BLOCK_SIZE)
    and walked BLOCK_N rows at a time. Rows outside [0, num_rows) or marked invalid are neither read nor attended.
    QUANT (see `_load_rows`): 0 a store of q's dtype; 1 / 2 int8 / float8 codes, decoded to q's dtype in registers.
    """
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    q, head, row_ok, d, d_ok = _query_group(
        q_ptr + b * stride_qb, kv_head, group, stride_qh, HEAD_DIM, BLOCK_D, GROUP_PAD
    )
    n_off = tl.arange(0, BLOCK_N)

    length = tl.load(lengths_ptr + b * stride_nb + kv_head * stride_nh).to(tl.int64)
    length = tl.minimum(tl.maximum(length, 0), width)
    first = split * entries_per_split
    last = tl.minimum(first + entries_per_split, length)
    num_selected_rows = tl.maximum(last - first, 0) * BLOCK_SIZE

    ids_base = ids_ptr + b * stride_ib + kv_head * stride_ih
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    valid_base = valid_ptr + b * stride_mb
    k_scale_base = k_scale_ptr + b * stride_ksb + kv_head * stride_ksh
    v_scale_base = v_scale_ptr + b * stride_vsb + kv_head * stride_vsh

    m_i, l_i, acc = _empty_state(GROUP_PAD, BLOCK_D)
    for start in range(0, num_selected_rows, BLOCK_N):
        n = start + n_off
        in_range = n < num_selected_rows
        entry = first + n // BLOCK_SIZE
        block = tl.load(ids_base + entry * stride_is, mask=in_range, other=0).to(tl.int64)
        # the id is range-checked before it is scaled: id * BLOCK_SIZE of an id near the int64 extremes wraps
        block_ok = (block >= 0) & (block < (num_rows + BLOCK_SIZE - 1) // BLOCK_SIZE)
        row = tl.where(block_ok, block, 0) * BLOCK_SIZE + n % BLOCK_SIZE
        live = _and_valid(in_range & block_ok & (row < num_rows), valid_base, row, stride_mt)
        m_i, l_i, acc = _attend_rows(
            q, k_base, v_base, row, stride_kt, stride_vt, d, live, d_ok, live[None, :], m_i, l_i, acc, scale,
            k_scale_base, v_scale_base, scale_group, QUANT, RNE_BF16, DOT_PRECISION, UPCAST,
        )  # fmt: skip
    out, lse = _finish(m_i, l_i, acc)
    out_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + head * stride_lh + split * stride_ls, lse, mask=row_ok)


@triton.jit
def combine_splits_kernel(
    part_out_ptr,  # [B, Hq, splits, D] fp32
    part_lse_ptr,  # [B, Hq, splits] fp32
    out_ptr,  # [B, Hq, D] fp32
    lse_ptr,  # [B, Hq] fp32
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_sb,
    stride_sh,
    stride_ss,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Grid (B, Hq): LSE-merge the per-split partial attentions of one query head."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    d_ok = d < HEAD_DIM
    split_ok = s < num_splits
    part_lse = tl.load(
        part_lse_ptr + b * stride_sb + head * stride_sh + s * stride_ss, mask=split_ok, other=float("-inf")
    )
    m = tl.max(part_lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.where(part_lse == float("-inf"), 0.0, tl.exp(part_lse - m_safe))
    total = tl.sum(weight, axis=0)
    part_ptrs = part_out_ptr + b * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :]
    part = tl.load(part_ptrs, mask=split_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out, mask=d_ok)
    tl.store(lse_ptr + b * stride_lb + head * stride_lh, lse)


@triton.jit
def merge_lse_kernel(
    out_a_ptr,  # [N, D] fp32, overwritten with the merge
    lse_a_ptr,  # [N] fp32, overwritten with the merge
    out_b_ptr,  # [N, D] fp32
    lse_b_ptr,  # [N] fp32
    num_rows,
    head_dim,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(N, BLOCK_R),): exact LSE merge of two partial attentions over disjoint key sets, in place."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < num_rows
    lse_a = tl.load(lse_a_ptr + r, mask=r_ok, other=float("-inf"))
    lse_b = tl.load(lse_b_ptr + r, mask=r_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.where(lse_a == float("-inf"), 0.0, tl.exp(lse_a - m_safe))
    w_b = tl.where(lse_b == float("-inf"), 0.0, tl.exp(lse_b - m_safe))
    total = w_a + w_b
    empty = total == 0.0
    norm = tl.where(empty, 1.0, total)
    offs = r[:, None] * head_dim + d[None, :]
    mask = r_ok[:, None] & (d[None, :] < head_dim)
    out_a = tl.load(out_a_ptr + offs, mask=mask, other=0.0)
    out_b = tl.load(out_b_ptr + offs, mask=mask, other=0.0)
    # an empty side contributes nothing even if its out holds garbage (0 * NaN would poison the merge)
    part_a = tl.where(w_a[:, None] > 0.0, out_a * w_a[:, None], 0.0)
    part_b = tl.where(w_b[:, None] > 0.0, out_b * w_b[:, None], 0.0)
    tl.store(out_a_ptr + offs, (part_a + part_b) / norm[:, None], mask=mask)
    tl.store(lse_a_ptr + r, tl.where(empty, float("-inf"), m_safe + tl.log(norm)), mask=r_ok)


@triton.jit
def prefill_attention_kernel(
    q_ptr,  # [B, Hq, Lq, D]
    k_ptr,  # [B, Hkv, T, D]
    v_ptr,  # [B, Hkv, T, D]
    valid_ptr,  # [B, T] uint8, read when HAS_VALID
    out_ptr,  # [B, Hq, Lq, D] fp32; the running output when ACCUMULATE
    lse_ptr,  # [B, Hq, Lq] fp32; the running lse when ACCUMULATE
    q_len,
    num_keys,
    num_q_heads,
    group,
    causal_offset,
    scale,
    stride_qb,
    stride_qh,
    stride_ql,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_mb,
    stride_mt,
    stride_ob,
    stride_oh,
    stride_ol,
    stride_lb,
    stride_lh,
    stride_ll,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_VALID: tl.constexpr,
    CAUSAL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Grid (cdiv(Lq, BLOCK_M), B * Hq): BLOCK_M queries of one head over all T keys, flash-attention style.

    CAUSAL: query i sits at key position causal_offset + i; later keys are masked, and the key at its own
    position is attended even when invalid (a padding query attends itself, so no row is empty).
    ACCUMULATE: (out, lse) hold a partial result over other keys; this one is merged into it (exactly, by LSE)."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_q_heads
    head = bh % num_q_heads
    kv_head = head // group
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    tile_ok = row_ok[:, None] & d_ok[None, :]

    q = tl.load(
        q_ptr + b * stride_qb + head * stride_qh + rows[:, None] * stride_ql + d[None, :],
        mask=tile_ok,
        other=0.0,
    )
    out_ptrs = out_ptr + b * stride_ob + head * stride_oh + rows[:, None] * stride_ol + d[None, :]
    lse_ptrs = lse_ptr + b * stride_lb + head * stride_lh + rows * stride_ll
    if ACCUMULATE:
        m_i = tl.load(lse_ptrs, mask=row_ok, other=float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
        acc = tl.load(out_ptrs, mask=tile_ok, other=0.0)
        acc = tl.where(l_i[:, None] > 0.0, acc, 0.0)
    else:
        m_i, l_i, acc = _empty_state(BLOCK_M, BLOCK_D)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    positions = causal_offset + rows  # key position of each query
    end = num_keys
    if CAUSAL:
        end = tl.minimum(num_keys, causal_offset + (m_block + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        n = start + n_off
        in_range = n < num_keys
        if HAS_VALID:
            key_ok = _and_valid(in_range, valid_ptr + b * stride_mb, n, stride_mt)
        else:
            key_ok = in_range
        live = key_ok[None, :]
        if CAUSAL:
            live = (live & (n[None, :] <= positions[:, None])) | (n[None, :] == positions[:, None])
        # every key in range is read (an invalid one may still be a causal query's own)
        m_i, l_i, acc = _attend_rows(
            q, k_base, v_base, n, stride_kt, stride_vt, d, in_range, d_ok, live, m_i, l_i, acc, scale,
            k_base, v_base, 1, QUANT=0, RNE_BF16=False, DOT_PRECISION=DOT_PRECISION, UPCAST=UPCAST,
        )  # fmt: skip
    out, lse = _finish(m_i, l_i, acc)
    tl.store(out_ptrs, out, mask=tile_ok)
    tl.store(lse_ptrs, lse, mask=row_ok)
