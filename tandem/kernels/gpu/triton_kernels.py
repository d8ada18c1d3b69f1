"""Triton kernels of the GPU path. Only `@triton.jit` functions live here; `attention.py` validates and launches.

Shared conventions: fp32 accumulation, natural-log lse, and a query row with nothing to attend ends with
out = 0 and lse = -inf (never NaN). One program serves a whole GQA query group: the group's rows are padded
up to GROUP_PAD (>= 16, what `tl.dot` needs) and masked. Batch and head offsets are computed in int64 so
stores larger than 2**31 elements address correctly.
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST (interpreter only) multiplies in fp32: the interpreter's dot would
    multiply bfloat16 bit patterns as integers. Products of 16-bit values are exact in fp32, so this matches."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _attend_tile(q, k, v, live, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step.

    q: [GROUP_PAD, D]; k, v: [N, D] (q's dtype); live: [1, N] or [GROUP_PAD, N] bool.
    m_i, l_i: [GROUP_PAD] fp32 running max / sum; acc: [GROUP_PAD, D] fp32 unnormalised output.
    """
    qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale
    qk = tl.where(live, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # a row that has seen no live key keeps m = -inf; shifting by 0 instead avoids (-inf) - (-inf) = NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(qk - m_safe[:, None])
    correction = tl.exp(m_i - m_safe)
    l_i = l_i * correction + tl.sum(p, axis=1)
    # half-precision V: P is rounded to V's dtype for the tensor-core dot (as flash attention does)
    acc = acc * correction[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _finish(m_i, l_i, acc):
    """Normalise: returns out [GROUP_PAD, D] fp32 and lse [GROUP_PAD] fp32 (-inf, out 0 where l_i = 0)."""
    empty = l_i == 0.0
    norm = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log(norm))
    return acc / norm[:, None], lse


# 2**120: a float8 e4m3fn code's bits moved into fp32's fields carry an exponent 120 (= 127 - 7) too small
FP8_E4M3_SHIFT: tl.constexpr = tl.constexpr(2.0**120)


@triton.jit
def _e4m3_to_f32(code):
    """float8 e4m3fn codes read as uint8 -> fp32, exactly (0x7F / 0xFF, NaN, are never stored). Pure integer
    work and a multiply, so it runs in the interpreter and on every GPU (no native fp8 type needed)."""
    code = code.to(tl.uint32)
    bits = ((code & 0x80) << 24) | ((code & 0x7F) << 20)
    normal = bits.to(tl.float32, bitcast=True) * FP8_E4M3_SHIFT
    # exponent field 0 would be an fp32 subnormal, which a GPU may flush to zero: decode those as m * 2**-9
    tiny = ((code & 0x07).to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    tiny = (tiny | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)  # the sign by its bit: -0 stays -0
    return tl.where((code & 0x78) == 0, tiny, normal)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bfloat16 (ties to even), still in fp32: Triton 3.9's interpreter converts by
    truncation, a GPU rounds. Finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(
    base,
    row,
    stride,
    d,
    live,
    d_ok,
    scale_base,
    scale_group,
    DTYPE: tl.constexpr,
    QUANT: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Rows `row` [N] of one head of a KV store -> [N, BLOCK_D] (0 where not live or past HEAD_DIM).

    QUANT 0: the store's own values. QUANT 1 (int8 codes) and 2 (float8 e4m3fn codes, read as uint8): codes times
    the row's float32 scale scale_base[row // scale_group], in fp32, rounded to DTYPE (RNE_BF16, interpreter
    only: rounded to bfloat16 by `_round_bf16` first, so the conversion is exact).
    """
    ptrs = base + row[:, None] * stride + d[None, :]
    if QUANT == 0:
        rows = tl.load(ptrs, mask=live[:, None] & d_ok[None, :], other=0.0)
    else:
        codes = tl.load(ptrs, mask=live[:, None] & d_ok[None, :], other=0)
        if QUANT == 1:
            decoded = codes.to(tl.float32)
        else:
            decoded = _e4m3_to_f32(codes)
        row_scale = tl.load(scale_base + row // scale_group, mask=live, other=0.0)
        rows = decoded * row_scale[:, None]
        if RNE_BF16:
            rows = _round_bf16(rows)
        rows = rows.to(DTYPE)
    return rows


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
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    d_ok = d < HEAD_DIM
    s_off = tl.arange(0, BLOCK_S)
    head = kv_head * group + g
    row_ok = g < group

    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    valid_base = valid_ptr + b * stride_mb

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(0, num_slots, BLOCK_S):
        s = start + s_off
        in_range = s < num_slots
        live = in_range & (tl.load(valid_base + s * stride_ms, mask=in_range, other=0) != 0)
        k = tl.load(
            k_base + s[:, None] * stride_ks + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0
        )
        v = tl.load(
            v_base + s[:, None] * stride_vs + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0
        )
        m_i, l_i, acc = _attend_tile(q, k, v, live[None, :], m_i, l_i, acc, scale, DOT_PRECISION, UPCAST)
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
            live = in_range & (tl.load(valid_base + s * stride_ms, mask=in_range, other=0) != 0)
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
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)  # head_dim padded to a power of two
    d_ok = d < HEAD_DIM
    n_off = tl.arange(0, BLOCK_N)
    head = kv_head * group + g
    row_ok = g < group

    length = tl.load(lengths_ptr + b * stride_nb + kv_head * stride_nh).to(tl.int64)
    length = tl.minimum(tl.maximum(length, 0), width)
    first = split * entries_per_split
    last = tl.minimum(first + entries_per_split, length)
    num_selected_rows = tl.maximum(last - first, 0) * BLOCK_SIZE

    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    ids_base = ids_ptr + b * stride_ib + kv_head * stride_ih
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    valid_base = valid_ptr + b * stride_mb
    k_scale_base = k_scale_ptr + b * stride_ksb + kv_head * stride_ksh
    v_scale_base = v_scale_ptr + b * stride_vsb + kv_head * stride_vsh

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(0, num_selected_rows, BLOCK_N):
        n = start + n_off
        in_range = n < num_selected_rows
        entry = first + n // BLOCK_SIZE
        block = tl.load(ids_base + entry * stride_is, mask=in_range, other=0).to(tl.int64)
        row = block * BLOCK_SIZE + n % BLOCK_SIZE
        live = in_range & (row >= 0) & (row < num_rows)
        live = live & (tl.load(valid_base + row * stride_mt, mask=live, other=0) != 0)
        k = _load_rows(
            k_base, row, stride_kt, d, live, d_ok, k_scale_base, scale_group, q.dtype, QUANT, RNE_BF16
        )
        v = _load_rows(
            v_base, row, stride_vt, d, live, d_ok, v_scale_base, scale_group, q.dtype, QUANT, RNE_BF16
        )
        m_i, l_i, acc = _attend_tile(q, k, v, live[None, :], m_i, l_i, acc, scale, DOT_PRECISION, UPCAST)
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
def block_scores_kernel(
    q_ptr,  # [B, Hq, D]
    min_ptr,  # [B, Hkv, NB, D] per-block key minima
    max_ptr,  # [B, Hkv, NB, D] per-block key maxima
    valid_ptr,  # [B, NB] uint8
    out_ptr,  # [B, Hkv, NB] fp32
    num_blocks,
    group,
    stride_qb,
    stride_qh,
    stride_nb,
    stride_nh,
    stride_nn,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_vb,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Quest's bound of BLOCK_N blocks for one (request, KV head): max over the group's query heads of
    sum_d max(q_d * min_d, q_d * max_d) = relu(q) . max + min(q, 0) . min (two tensor-core dots), -inf at
    invalid blocks. Grid: (B, Hkv, cdiv(NB, BLOCK_N))."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + (h * group + rows)[:, None] * stride_qh + d[None, :],
        mask=(rows[:, None] < group) & d_ok,
        other=0.0,
    )
    n_ok = n < num_blocks
    tile = n[:, None] * stride_nn + d[None, :]
    low = tl.load(min_ptr + b * stride_nb + h * stride_nh + tile, mask=n_ok[:, None] & d_ok, other=0.0)
    tile = n[:, None] * stride_xn + d[None, :]
    high = tl.load(max_ptr + b * stride_xb + h * stride_xh + tile, mask=n_ok[:, None] & d_ok, other=0.0)
    q = q.to(tl.float32)  # (Triton 3.9's interpreter takes max / min of bfloat16 bit patterns as integers)
    positive = tl.maximum(q, 0.0).to(high.dtype)
    negative = tl.minimum(q, 0.0).to(low.dtype)
    bound = _dot(positive, tl.trans(high), DOT_PRECISION, UPCAST)
    bound += _dot(negative, tl.trans(low), DOT_PRECISION, UPCAST)  # [GROUP_PAD, BLOCK_N]
    bound = tl.where(rows[:, None] < group, bound, float("-inf"))
    best = tl.max(bound, axis=0)
    ok = tl.load(valid_ptr + b * stride_vb + n, mask=n_ok, other=0) != 0
    tl.store(out_ptr + b * stride_ob + h * stride_oh + n, tl.where(ok, best, float("-inf")), mask=n_ok)


@triton.jit
def _order_keys(x):
    """(signed, unsigned) int32 keys in the order of the fp32 scores x; the unsigned one's bytes are radix digits."""
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key, key ^ -2147483648


@triton.jit
def _candidates(live, ukey, prefix, p: tl.constexpr):
    """Keys still tied with the k-th best on the bytes fixed before radix pass p."""
    if p == 0:
        candidate = live
    else:
        candidate = live & ((ukey >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
    return candidate


@triton.jit
def _radix_step(hist, remaining, prefix, shift):
    """One radix pass: from the 256-bin histogram of the candidates' byte at `shift`, the byte of the k-th best
    key (the highest bin with at least `remaining` candidates at or above it); returns (remaining, prefix) after
    dropping the candidates above it, which are kept for sure."""
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # candidates with digit >= bin
    chosen = tl.max(tl.where(at_least >= remaining, bins, 0), axis=0)
    remaining -= tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    return remaining, prefix | (chosen << shift)


@triton.jit
def top_blocks_kernel(
    scores_ptr,  # [R, NB] fp32
    k_ptr,  # [1] int64: how many blocks to keep this step
    out_ptr,  # [R, W] int64
    num_blocks,
    width,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
):
    """The k best-scoring blocks of one row as a set: their ids ascending in out[:n], then num_blocks (an invalid
    pick) up to `width`. Blocks scoring -inf are never kept; ties at the k-th score go to the lower ids.

    Radix select over the scores' order-preserving int32 keys, a byte per pass (a 256-bin histogram of the
    candidates still tied on the bytes above), with the whole row in registers. Grid: (R,)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < num_blocks
    x = tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf"))
    key, ukey = _order_keys(x)
    remaining = tl.minimum(tl.load(k_ptr), width).to(tl.int32)  # never more than the output holds
    prefix = tl.zeros((), dtype=tl.int32)  # the unsigned key bytes fixed so far
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.histogram((ukey >> shift) & 0xFF, 256, mask=_candidates(live, ukey, prefix, p))
        remaining, prefix = _radix_step(hist, remaining, prefix, shift)
    threshold = prefix ^ -2147483648  # the k-th best key, signed
    tie = live & (key == threshold)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
    keep = live & (x != float("-inf")) & ((key > threshold) | (tie & (tie_rank < remaining)))
    slots = tl.arange(0, WIDTH_PAD)
    tl.store(
        out_ptr + row * stride_o + slots, tl.zeros((WIDTH_PAD,), tl.int64) + num_blocks, mask=slots < width
    )
    tl.debug_barrier()  # the padding lands before the kept ids overwrite their slots
    position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_o + position, offs.to(tl.int64), mask=keep)


@triton.jit
def top_blocks_tiled_kernel(
    scores_ptr,  # [R, NB] fp32
    k_ptr,  # [1] int64
    out_ptr,  # [R, W] int64
    num_blocks,
    width,
    stride_s,
    stride_o,
    TILE: tl.constexpr,
):
    """`top_blocks_kernel` for rows too long for registers: the same radix select and output, with the row read
    in tiles of TILE scores (from L2 after the first pass), once per byte of the key and once more to write the
    kept ids. Each pass carries its histogram across the tiles; the last one carries how many ids and how many
    ties at the threshold earlier tiles kept, so ids stay ascending and ties go to the lower ids. Grid: (R,)."""
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_s
    offs = tl.arange(0, TILE)
    remaining = tl.minimum(tl.load(k_ptr), width).to(tl.int32)
    prefix = tl.zeros((), dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((256,), dtype=tl.int32)
        for start in range(0, num_blocks, TILE):
            live = start + offs < num_blocks
            key, ukey = _order_keys(tl.load(base + start + offs, mask=live, other=float("-inf")))
            hist += tl.histogram((ukey >> shift) & 0xFF, 256, mask=_candidates(live, ukey, prefix, p))
        remaining, prefix = _radix_step(hist, remaining, prefix, shift)
    threshold = prefix ^ -2147483648
    for start in range(0, width, TILE):
        tl.store(
            out_ptr + row * stride_o + start + offs,
            tl.zeros((TILE,), tl.int64) + num_blocks,
            mask=start + offs < width,
        )
    tl.debug_barrier()  # the padding lands before the kept ids overwrite their slots
    kept = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_blocks, TILE):
        live = start + offs < num_blocks
        x = tl.load(base + start + offs, mask=live, other=float("-inf"))
        key, ukey = _order_keys(x)
        tie = live & (key == threshold)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        keep = live & (x != float("-inf")) & ((key > threshold) | (tie & (tie_rank < remaining)))
        position = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * stride_o + position, (start + offs).to(tl.int64), mask=keep)
        kept += tl.sum(keep.to(tl.int32), axis=0)
        ties += tl.sum(tie.to(tl.int32), axis=0)


# ---- the model's own small layers, fused (tandem.integrations.fused swaps them in) --------------------------
@triton.jit
def rms_norm_kernel(
    x_ptr,  # [rows, N], last dim contiguous
    w_ptr,  # [N]
    out_ptr,  # [rows, N] contiguous, the dtype torch would give `w * x.to(x.dtype)`
    stride_x,
    N,
    eps,
    BLOCK: tl.constexpr,
):
    """One row: x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then times the weight (rounded to the
    output dtype), the order of operations of Llama's RMSNorm, so one kernel gives what its seven give."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    normed = _rms_norm_row(x_raw, w_ptr, cols, live, N, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, normed, mask=live)


@triton.jit
def _rms_norm_row(x_raw, w_ptr, cols, live, N, eps, OUT: tl.constexpr):
    """Llama's RMSNorm of one row held in registers: normalized in fp32, rounded to the row's dtype, then times
    the weight, rounded to OUT."""
    x = x_raw.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / N
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    return (w * normed).to(OUT)


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, OUT: tl.constexpr):
    """(x * cos) + (rotate_half(x) * sin) with each product and the sum rounded to OUT, as torch's three
    elementwise ops round; rotate_half(x) = cat(-x2, x1)."""
    a1 = (x1 * c1).to(OUT).to(tl.float32)
    b1 = (-x2 * s1).to(OUT).to(tl.float32)
    a2 = (x2 * c2).to(OUT).to(tl.float32)
    b2 = (x1 * s2).to(OUT).to(tl.float32)
    return (a1 + b1).to(OUT), (a2 + b2).to(OUT)


@triton.jit
def rope_kernel(
    q_ptr,  # [B, Hq, L, D], last dim contiguous
    k_ptr,  # [B, Hkv, L, D]
    cos_ptr,  # [B, L, D]
    sin_ptr,
    q_out_ptr,  # [B, Hq, L, D] contiguous
    k_out_ptr,  # [B, Hkv, L, D] contiguous
    L,
    num_q_heads,
    num_kv_heads,
    stride_qb,
    stride_qh,
    stride_ql,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_cb,
    stride_cl,
    stride_sb,
    stride_sl,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (B * L,): every query and key head of one token, rotated by that token's cos / sin."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // L
    pos = pid % L
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    c_base = cos_ptr + b * stride_cb + pos * stride_cl
    s_base = sin_ptr + b * stride_sb + pos * stride_sl
    c1 = tl.load(c_base + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_base + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_base + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_base + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    q_src = q_ptr + b * stride_qb + pos * stride_ql
    k_src = k_ptr + b * stride_kb + pos * stride_kl
    _rope_heads(
        q_src, stride_qh, q_out_ptr, b, pos, L, num_q_heads, c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_HALF
    )
    _rope_heads(
        k_src, stride_kh, k_out_ptr, b, pos, L, num_kv_heads, c1, c2, s1, s2, HALF, BLOCK_HKV, BLOCK_HALF
    )


@triton.jit
def _rope_heads(
    src, stride_h, out_ptr, b, pos, L, num_heads, c1, c2, s1, s2,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rotate every head of one token (src: its head 0), into the contiguous [B, H, L, 2 * HALF] output."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h < num_heads)[:, None] & (d < HALF)[None, :]
    x1 = tl.load(src + h[:, None] * stride_h + d[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + h[:, None] * stride_h + HALF + d[None, :], mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, out_ptr.dtype.element_ty)
    dst = out_ptr + ((b * num_heads + h[:, None]) * L + pos) * (2 * HALF) + d[None, :]
    tl.store(dst, o1, mask=ok)
    tl.store(dst + HALF, o2, mask=ok)


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
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
            key_ok = in_range & (
                tl.load(valid_ptr + b * stride_mb + n * stride_mt, mask=in_range, other=0) != 0
            )
        else:
            key_ok = in_range
        live = key_ok[None, :]
        if CAUSAL:
            live = (live & (n[None, :] <= positions[:, None])) | (n[None, :] == positions[:, None])
        kv_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_base + n[:, None] * stride_kt + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + n[:, None] * stride_vt + d[None, :], mask=kv_ok, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, live, m_i, l_i, acc, scale, DOT_PRECISION, UPCAST)
    out, lse = _finish(m_i, l_i, acc)
    tl.store(out_ptrs, out, mask=tile_ok)
    tl.store(lse_ptrs, lse, mask=row_ok)


# ---- top-k of long rows over many programs (`top_blocks` with LONG_ROWS = "split") --------------------------
@triton.jit
def _chain(hist_ptr, row, remaining, P: tl.constexpr):
    """(remaining, prefix) after radix passes 0 .. P-1, recomputed from their histograms in hist[row, p, 256]
    (every program of a pass reads the same finished histograms, so none has to publish the result)."""
    prefix = tl.zeros((), dtype=tl.int32)
    bins = tl.arange(0, 256)
    for p in tl.static_range(P):
        hist = tl.load(hist_ptr + (row * 4 + p) * 256 + bins)
        remaining, prefix = _radix_step(hist, remaining, prefix, 24 - 8 * p)
    return remaining, prefix


@triton.jit
def top_blocks_hist_kernel(
    scores_ptr,  # [R, NB] fp32
    k_ptr,  # [1] int64
    hist_ptr,  # [R, 4, 256] int32, zero before pass 0
    num_blocks,
    width,
    stride_s,
    P: tl.constexpr,
    TILE: tl.constexpr,
):
    """Grid (R, tiles): radix pass P over one tile of a row: the histogram of its candidates' byte P (the keys
    still tied with the k-th best on bytes 0 .. P-1), added into the row's histogram of pass P."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    live = offs < num_blocks
    remaining = tl.minimum(tl.load(k_ptr), width).to(tl.int32)
    remaining, prefix = _chain(hist_ptr, row, remaining, P)
    _, ukey = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf")))
    hist = tl.histogram((ukey >> (24 - 8 * P)) & 0xFF, 256, mask=_candidates(live, ukey, prefix, P))
    tl.atomic_add(hist_ptr + (row * 4 + P) * 256 + tl.arange(0, 256), hist)


@triton.jit
def _split_threshold(k_ptr, hist_ptr, row, width):
    """The k-th best key (signed) of a row and how many of the keys equal to it are kept."""
    remaining = tl.minimum(tl.load(k_ptr), width).to(tl.int32)
    remaining, prefix = _chain(hist_ptr, row, remaining, 4)
    return prefix ^ -2147483648, remaining


@triton.jit
def top_blocks_count_kernel(
    scores_ptr,
    k_ptr,
    hist_ptr,
    counts_ptr,  # [R, tiles, 2] int32: keys above the threshold, keys equal to it
    num_blocks,
    width,
    stride_s,
    num_tiles,
    TILE: tl.constexpr,
):
    """Grid (R, tiles): per tile, how many keys beat the k-th best and how many tie with it."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    live = offs < num_blocks
    threshold, _ = _split_threshold(k_ptr, hist_ptr, row, width)
    key, _ = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf")))
    above = tl.sum((live & (key > threshold)).to(tl.int32), axis=0)
    ties = tl.sum((live & (key == threshold)).to(tl.int32), axis=0)
    tl.store(counts_ptr + (row * num_tiles + tile) * 2, above)
    tl.store(counts_ptr + (row * num_tiles + tile) * 2 + 1, ties)


@triton.jit
def top_blocks_write_kernel(
    scores_ptr,
    k_ptr,
    hist_ptr,
    counts_ptr,
    out_ptr,  # [R, W] int64
    num_blocks,
    width,
    stride_s,
    stride_o,
    num_tiles,
    TILE: tl.constexpr,
    TILES_PAD: tl.constexpr,
):
    """Grid (R, tiles): write one tile's kept ids at their place in the row's ascending list (after the ids kept
    by earlier tiles); ties at the k-th best go to the lower ids across tiles. Tile 0 pads the rest of the row
    with num_blocks. The same set and order as `top_blocks_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    live = offs < num_blocks
    threshold, remaining = _split_threshold(k_ptr, hist_ptr, row, width)
    ninf_key, _ = _order_keys(tl.full((), float("-inf"), tl.float32))
    tiles = tl.arange(0, TILES_PAD)
    counted = tiles < num_tiles
    above = tl.load(counts_ptr + (row * num_tiles + tiles) * 2, mask=counted, other=0)
    ties = tl.load(counts_ptr + (row * num_tiles + tiles) * 2 + 1, mask=counted, other=0)
    earlier = tiles < tile
    ties_before = tl.sum(tl.where(earlier, ties, 0), axis=0)
    # ties of -inf are never kept; otherwise the first `remaining` ties (in id order) are
    takes_ties = threshold != ninf_key
    kept_before = tl.sum(tl.where(earlier, above, 0), axis=0)
    kept_before += tl.where(takes_ties, tl.minimum(ties_before, remaining), 0)
    x = tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf"))
    key, _ = _order_keys(x)
    tie = live & (key == threshold)
    tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
    keep = live & (x != float("-inf")) & ((key > threshold) | (tie & (tie_rank < remaining)))
    position = kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_o + position, offs.to(tl.int64), mask=keep)
    if tile == 0:
        total = tl.sum(above, axis=0) + tl.where(takes_ties, tl.minimum(tl.sum(ties, axis=0), remaining), 0)
        for start in range(0, width, TILE):
            slots = start + tl.arange(0, TILE)
            pad = (slots >= total) & (slots < width)
            tl.store(out_ptr + row * stride_o + slots, tl.zeros((TILE,), tl.int64) + num_blocks, mask=pad)


@triton.jit
def recall_blocks_kernel(
    src_k_ptr,  # [B, Hkv, T, D] (pinned host memory read through UVA, or device memory)
    src_v_ptr,
    src_valid_ptr,  # [B, T] uint8
    dst_k_ptr,  # [B, Hkv * slots * BLOCK_SIZE, D] on the device
    dst_v_ptr,
    dst_valid_ptr,  # [B, Hkv * slots * BLOCK_SIZE] uint8
    src_ids_ptr,  # [B, Hkv, W] int64 host block ids
    dst_ids_ptr,  # [B, Hkv, W] int64 slots
    counts_ptr,  # [B, Hkv] int64: live entries
    src_k_scale_ptr,  # [B, Hkv, T // G] fp32, read only when QUANT
    src_v_scale_ptr,  # [B, Hkv, T // G] fp32
    num_rows,
    slots,
    scale_group,  # G: rows per scale
    stride_skb,
    stride_skh,
    stride_skt,
    stride_svb,
    stride_svh,
    stride_svt,
    stride_smb,
    stride_dkb,
    stride_dkt,
    stride_dvb,
    stride_dvt,
    stride_dmb,
    stride_ib,
    stride_ih,
    stride_jb,
    stride_jh,
    stride_cb,
    stride_ch,
    stride_ksb,
    stride_ksh,
    stride_vsb,
    stride_vsh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Grid (B, Hkv, W): entry w < counts[b, h] copies host block src_ids[b, h, w] (rows past num_rows: not
    valid) into slot dst_ids[b, h, w] of head h, K, V and validity, BLOCK_R rows at a time. QUANT (see
    `_load_rows`): 0 a source of the cache's dtype; 1 / 2 int8 / float8 codes, decoded to the cache's dtype."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    w = tl.program_id(2)
    count = tl.load(counts_ptr + b * stride_cb + head * stride_ch)
    if w < count:
        block = tl.load(src_ids_ptr + b * stride_ib + head * stride_ih + w).to(tl.int64)
        slot = tl.load(dst_ids_ptr + b * stride_jb + head * stride_jh + w).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_live = d < HEAD_DIM
        for r0 in range(0, BLOCK_SIZE, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_live = r < BLOCK_SIZE
            src_row = block * BLOCK_SIZE + r
            readable = r_live & (src_row < num_rows)
            dst_row = (head * slots + slot) * BLOCK_SIZE + r
            put = r_live[:, None] & d_live[None, :]
            k = _load_rows(
                src_k_ptr + b * stride_skb + head * stride_skh, src_row, stride_skt, d, readable, d_live,
                src_k_scale_ptr + b * stride_ksb + head * stride_ksh, scale_group,
                dst_k_ptr.dtype.element_ty, QUANT, RNE_BF16,
            )  # fmt: skip
            tl.store(dst_k_ptr + b * stride_dkb + dst_row[:, None] * stride_dkt + d[None, :], k, mask=put)
            v = _load_rows(
                src_v_ptr + b * stride_svb + head * stride_svh, src_row, stride_svt, d, readable, d_live,
                src_v_scale_ptr + b * stride_vsb + head * stride_vsh, scale_group,
                dst_v_ptr.dtype.element_ty, QUANT, RNE_BF16,
            )  # fmt: skip
            tl.store(dst_v_ptr + b * stride_dvb + dst_row[:, None] * stride_dvt + d[None, :], v, mask=put)
            ok = tl.load(src_valid_ptr + b * stride_smb + src_row, mask=readable, other=0)
            tl.store(dst_valid_ptr + b * stride_dmb + dst_row, ok, mask=r_live)


@triton.jit
def _recall_entries(ids_row, block_row, c0, K, k, limit, BLOCK_K: tl.constexpr):
    """Entries [c0, c0 + BLOCK_K) of a step's selection: (positions, inside K, block ids, selected, slot or -1)."""
    e = c0 + tl.arange(0, BLOCK_K)
    in_k = e < K
    ids = tl.load(ids_row + e, mask=in_k, other=limit)
    live = in_k & (e < k) & (ids >= 0) & (ids < limit)
    slot = tl.load(block_row + ids, mask=live, other=-1)
    return e, in_k, ids, live, slot


@triton.jit
def recall_plan_kernel(
    ids_ptr,  # [B, Hkv, K] int64: the step's selection (entries >= k or >= limit are not selected)
    k_ptr,  # [1] int64: blocks selected this step
    block_slot_ptr,  # [B, Hkv, NB] int64: slot of each host block, -1 if not cached
    slot_block_ptr,  # [B, Hkv, S] int64: block of each slot, -1 if empty
    last_ptr,  # [B, Hkv, S] int64: step of each slot's last hit or fill
    ref_ptr,  # [B, Hkv, S] int8: the clock's second-chance bit
    hand_ptr,  # [B, Hkv] int64: the clock's hand
    step_ptr,  # [B, Hkv] int64: steps planned so far
    cpu_ptr,  # [B, Hkv, K] int64 out: the CPU's blocks, `limit` elsewhere
    src_ptr,  # [B, Hkv, W] int64 out: blocks the device copies in
    dst_ptr,  # [B, Hkv, W] int64 out: their slots
    counts_ptr,  # [B, Hkv] int64 out: live entries of src / dst
    gpu_ptr,  # [B, Hkv, K + W] int64 out: flat-store block ids the device attends, `heads * S` where dead
    counters_ptr,  # [2] int64: rows attended from the cache, rows copied in (accumulated)
    share,
    K,
    W,
    S,
    NB,
    limit,
    heads,
    block_size,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Grid (B, Hkv): one (request, KV head)'s recall plan for a step, and its bookkeeping, in one program
    (`reference.recall_plan` is the same algorithm written as loops). Contiguous tensors."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    row = b * heads + head
    ids_row = ids_ptr + row * K
    cpu_row = cpu_ptr + row * K
    gpu_row = gpu_ptr + row * (K + W)
    block_row = block_slot_ptr + row * NB
    slot_row = slot_block_ptr + row * S
    last_row = last_ptr + row * S
    ref_row = ref_ptr + row * S
    src_row = src_ptr + row * W
    dst_row = dst_ptr + row * W
    step = tl.load(step_ptr + row)
    k = tl.load(k_ptr)
    dead = heads * S
    base = head * S
    # 1. hits: attended from their slots, marked used this step
    n_hit = tl.zeros((), dtype=tl.int64)
    n_miss = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, K, BLOCK_K):
        e, in_k, ids, live, slot = _recall_entries(ids_row, block_row, c0, K, k, limit, BLOCK_K)
        hit = live & (slot >= 0)
        tl.store(last_row + slot, tl.zeros_like(slot) + step, mask=hit)
        tl.store(ref_row + slot, tl.full(slot.shape, 1, tl.int8), mask=hit)
        tl.store(gpu_row + e, tl.where(hit, base + slot, dead), mask=in_k)
        n_hit += tl.sum(hit.to(tl.int64))
        n_miss += tl.sum((live & ~hit).to(tl.int64))
    count = tl.minimum(tl.floor(n_miss.to(tl.float32) * share + 0.5).to(tl.int64), W)
    # 2. misses in selection order: the first `count` are copied in, the rest go to the CPU
    seen = tl.zeros((), dtype=tl.int64)
    for c0 in range(0, K, BLOCK_K):
        e, in_k, ids, live, slot = _recall_entries(ids_row, block_row, c0, K, k, limit, BLOCK_K)
        miss = live & (slot < 0)
        rank = seen + tl.cumsum(miss.to(tl.int64), 0) - 1
        recall = miss & (rank < count)
        tl.store(src_row + rank, ids, mask=recall)
        tl.store(cpu_row + e, tl.where(miss & ~recall, ids, limit), mask=in_k)
        seen += tl.sum(miss.to(tl.int64))
    tl.debug_barrier()
    # 3. victims: the clock's hand walks the slots, taking those not used this step whose second chance is spent,
    # and spending the chance of those it passes
    hand = tl.load(hand_ptr + row)
    taken = tl.zeros((), dtype=tl.int64)
    offsets = tl.arange(0, BLOCK_S)
    while taken < count:
        slots = (hand + offsets) % S
        ref = tl.load(ref_row + slots)
        last = tl.load(last_row + slots)
        free = last != step
        cand = free & (ref == 0)
        crank = taken + tl.cumsum(cand.to(tl.int64), 0) - 1
        take = cand & (crank < count)
        tl.store(dst_row + crank, slots, mask=take)
        tl.store(last_row + slots, tl.zeros_like(last) + step, mask=take)  # never taken twice
        n_take = tl.sum(take.to(tl.int64))
        stop = tl.max(tl.where(take, offsets, -1)) + 1
        advance = tl.where(taken + n_take >= count, stop, BLOCK_S)
        tl.store(ref_row + slots, tl.zeros_like(ref), mask=(offsets < advance) & free & ~take)
        taken += n_take
        hand = (hand + advance) % S
        tl.debug_barrier()
    tl.store(hand_ptr + row, hand)
    # 4. the copied-in blocks take their slots
    for j0 in range(0, W, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)
        active = j < count
        slot = tl.load(dst_row + j, mask=active, other=0)
        block = tl.load(src_row + j, mask=active, other=0)
        old = tl.load(slot_row + slot, mask=active, other=-1)
        tl.store(block_row + old, tl.full(old.shape, -1, tl.int64), mask=active & (old >= 0))
        tl.store(block_row + block, slot, mask=active)
        tl.store(slot_row + slot, block, mask=active)
        tl.store(ref_row + slot, tl.full(slot.shape, 1, tl.int8), mask=active)
        tl.store(gpu_row + K + j, tl.where(active, base + slot, dead), mask=j < W)
    tl.store(counts_ptr + row, count)
    tl.store(step_ptr + row, step + 1)
    tl.atomic_add(counters_ptr, n_hit * block_size)
    tl.atomic_add(counters_ptr + 1, count * block_size)


@triton.jit
def add_rms_norm_kernel(
    x_ptr,  # [rows, N], last dim contiguous: the sublayer's output
    r_ptr,  # [rows, N], last dim contiguous: the residual stream
    w_ptr,  # [N]
    sum_ptr,  # [rows, N] contiguous, x's dtype: the new residual x + r
    out_ptr,  # [rows, N] contiguous: RMSNorm of the new residual
    stride_x,
    stride_r,
    N,
    eps,
    BLOCK: tl.constexpr,
):
    """One row: h = x + r rounded to x's dtype (as torch's add rounds), then Llama's RMSNorm of h, so the
    residual add and the next norm are one kernel."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
    h_raw = (x_raw.to(tl.float32) + r).to(x_raw.dtype)
    tl.store(sum_ptr + row * N + cols, h_raw, mask=live)
    normed = _rms_norm_row(h_raw, w_ptr, cols, live, N, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, normed, mask=live)


@triton.jit
def silu_mul_kernel(
    gu_ptr,  # [rows, 2 * N], last dim contiguous: gate then up
    out_ptr,  # [rows, N] contiguous
    stride_gu,
    N,
    BLOCK: tl.constexpr,
):
    """Grid (rows, cdiv(N, BLOCK)): silu(gate) rounded to the input dtype, times up, rounded again: what
    `act_fn(gate_proj(x)) * up_proj(x)` computes in two kernels."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    g_raw = tl.load(gu_ptr + row * stride_gu + cols, mask=live, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + N + cols, mask=live, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(g_raw.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (act * u).to(out_ptr.dtype.element_ty), mask=live)
