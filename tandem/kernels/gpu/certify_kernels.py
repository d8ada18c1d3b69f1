"""The certified selection's kernels: the histogram that ranks the units and the key sketch's bounds. Only `@triton.jit` functions live here; `certify.py` validates and
launches."""

import triton
import triton.language as tl


@triton.jit
def certify_histogram_kernel(
    mass_ptr,  # [R, n] fp32 log upper mass bound per unit
    lower_ptr,  # [R, n] fp32 log lower bound (read only with HAS_LOWER)
    free_ptr,  # [R, n] uint8: the units ranked
    top_ptr,  # [R] fp64
    tail_ptr,  # [R, BUCKETS] fp64, zeroed: sums of exp(mass - top) per bin
    count_ptr,  # [R, BUCKETS] int64, zeroed: units per bin
    gained_ptr,  # [R, BUCKETS] fp64, zeroed: sums of exp(lower - top) per bin (with HAS_LOWER)
    n,
    stride_m,
    stride_l,
    stride_f,
    BUCKETS: tl.constexpr,
    NATS: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One row's TILE units, BLOCK_N at a time. Nearly every unit lies far under the best and falls in the last
    bin: those are summed in registers and added once per program. The few in the nearer bins are added one by
    one (atomics on a handful of addresses, with little contention), so the work is O(n), not O(n x bins), and a
    scatter's serialisation on the last bin is gone."""
    row = tl.program_id(0)
    start = tl.program_id(1) * TILE
    top = tl.load(top_ptr + row)
    out = row * BUCKETS
    tail_far = tl.zeros([BLOCK_N], dtype=tl.float64)
    gained_far = tl.zeros([BLOCK_N], dtype=tl.float64)
    count_far = tl.zeros([BLOCK_N], dtype=tl.int32)
    for offset in range(0, TILE, BLOCK_N):
        cols = start + offset + tl.arange(0, BLOCK_N)
        inside = cols < n
        free = tl.load(free_ptr + row * stride_f + cols, mask=inside, other=0) != 0
        mass = tl.load(mass_ptr + row * stride_m + cols, mask=free, other=0.0).to(tl.float64)
        bucket = (top - mass) / NATS  # float64, as the reference
        bucket = tl.minimum(tl.maximum(bucket, 0.0), BUCKETS - 1).to(tl.int32)  # truncation: floor of >= 0
        far = free & (bucket == BUCKETS - 1)
        near = free & (bucket < BUCKETS - 1)
        up = tl.where(free, tl.exp(mass - top), 0.0)
        tail_far += tl.where(far, up, 0.0)
        count_far += far.to(tl.int32)
        tl.atomic_add(tail_ptr + out + bucket, up, mask=near)
        tl.atomic_add(count_ptr + out + bucket, near.to(tl.int64), mask=near)
        if HAS_LOWER:
            low = tl.load(lower_ptr + row * stride_l + cols, mask=free, other=0.0).to(tl.float64)
            low = tl.where(free, tl.exp(low - top), 0.0)
            gained_far += tl.where(far, low, 0.0)
            tl.atomic_add(gained_ptr + out + bucket, low, mask=near)
    last = out + BUCKETS - 1
    tl.atomic_add(tail_ptr + last, tl.sum(tail_far, axis=0))
    tl.atomic_add(count_ptr + last, tl.sum(count_far, axis=0).to(tl.int64))
    if HAS_LOWER:
        tl.atomic_add(gained_ptr + last, tl.sum(gained_far, axis=0))


@triton.jit
def sketch_bounds_kernel(
    q_ptr,  # [B, Hq, D]
    codes_ptr,  # [B, Hkv, n, D] int8
    row_scale_ptr,  # [B, Hkv, n] fp32
    error_ptr,  # [B, Hkv, n] fp32
    valid_ptr,  # [B, n] uint8
    upper_ptr,  # [B, Hq, n] fp32
    lower_ptr,  # [B, Hq, n] fp32
    n,
    group,
    scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ch,
    stride_cn,
    stride_sb,
    stride_sh,
    stride_eb,
    stride_eh,
    stride_vb,
    stride_ob,
    stride_oh,
    slack_abs,
    slack_rel,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The key sketch's logit bounds of BLOCK_N rows for one (request, KV head)'s query group: scale (q.c_i s_i
    +- ||q|| e_i), widened by the slack, -inf at invalid rows. The int8 codes become fp32 in registers, never in
    memory. Grid: (B, Hkv, cdiv(n, BLOCK_N))."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < HEAD_DIM
    head_ok = heads < group
    q = tl.load(
        q_ptr + b * stride_qb + (h * group + heads)[:, None] * stride_qh + d[None, :],
        mask=head_ok[:, None] & d_ok,
        other=0.0,
    ).to(tl.float32)
    inside = cols < n
    codes = tl.load(
        codes_ptr + b * stride_cb + h * stride_ch + cols[:, None] * stride_cn + d[None, :],
        mask=inside[:, None] & d_ok,
        other=0,
    ).to(tl.float32)
    dots = tl.dot(q, tl.trans(codes), input_precision="ieee")  # [GROUP_PAD, BLOCK_N]
    row_scale = tl.load(row_scale_ptr + b * stride_sb + h * stride_sh + cols, mask=inside, other=0.0)
    error = tl.load(error_ptr + b * stride_eb + h * stride_eh + cols, mask=inside, other=0.0)
    norm = tl.sqrt(tl.sum(q * q, axis=1))  # [GROUP_PAD]
    centre = dots * row_scale[None, :] * scale
    reach = norm[:, None] * error[None, :] * scale
    upper = centre + reach
    lower = centre - reach
    upper = upper + slack_abs + slack_rel * tl.abs(upper)
    lower = lower - slack_abs - slack_rel * tl.abs(lower)
    valid = tl.load(valid_ptr + b * stride_vb + cols, mask=inside, other=0) != 0
    upper = tl.where(valid[None, :], upper, float("-inf"))
    lower = tl.where(valid[None, :], lower, float("-inf"))
    out = b * stride_ob + (h * group + heads)[:, None] * stride_oh + cols[None, :]
    keep = head_ok[:, None] & inside[None, :]
    tl.store(upper_ptr + out, upper, mask=keep)
    tl.store(lower_ptr + out, lower, mask=keep)
