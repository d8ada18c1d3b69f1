"""The certified selection's histogram kernel. Only `@triton.jit` functions live here; `certify.py` validates and
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
    BUCKETS_PAD: tl.constexpr,
    NATS: tl.constexpr,
    HAS_LOWER: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One row's TILE units, BLOCK_N at a time: each unit's bin (in float64, as the reference) as a one-hot row,
    summed in registers, then added to the row's bins once per program. Atomics per bin: one per tile, where a
    scatter into the bins makes one per unit, nearly all into the last bin (the units far under the best)."""
    row = tl.program_id(0)
    start = tl.program_id(1) * TILE
    top = tl.load(top_ptr + row)
    bins = tl.arange(0, BUCKETS_PAD)
    tail = tl.zeros([BUCKETS_PAD], dtype=tl.float64)
    gained = tl.zeros([BUCKETS_PAD], dtype=tl.float64)
    count = tl.zeros([BUCKETS_PAD], dtype=tl.int64)
    for offset in range(0, TILE, BLOCK_N):
        cols = start + offset + tl.arange(0, BLOCK_N)
        inside = cols < n
        free = tl.load(free_ptr + row * stride_f + cols, mask=inside, other=0) != 0
        mass = tl.load(mass_ptr + row * stride_m + cols, mask=free, other=0.0).to(tl.float64)
        bucket = ((top - mass) / NATS).to(tl.float64)
        bucket = tl.minimum(tl.maximum(bucket, 0.0), BUCKETS - 1).to(tl.int32)  # truncation: floor of >= 0
        bucket = tl.where(free, bucket, BUCKETS_PAD)  # matches no bin
        hit = bucket[:, None] == bins[None, :]  # [BLOCK_N, BUCKETS_PAD]
        up = tl.where(free, tl.exp(mass - top), 0.0)
        tail += tl.sum(tl.where(hit, up[:, None], 0.0), axis=0)
        count += tl.sum(hit.to(tl.int64), axis=0)
        if HAS_LOWER:
            low = tl.load(lower_ptr + row * stride_l + cols, mask=free, other=0.0).to(tl.float64)
            low = tl.where(free, tl.exp(low - top), 0.0)
            gained += tl.sum(tl.where(hit, low[:, None], 0.0), axis=0)
    keep = bins < BUCKETS
    tl.atomic_add(tail_ptr + row * BUCKETS + bins, tail, mask=keep)
    tl.atomic_add(count_ptr + row * BUCKETS + bins, count, mask=keep)
    if HAS_LOWER:
        tl.atomic_add(gained_ptr + row * BUCKETS + bins, gained, mask=keep)
