"""Kernel of the host tier's writes of evicted rows: K / V / valid flags into pinned host memory (written by the
GPU through UVA) with the blocks' key digests, on the host and mirrored on the device, in one launch. Only
`@triton.jit` functions live here; `evict.py` validates and launches.
"""

import triton
import triton.language as tl


@triton.jit
def write_rows_kernel(
    src_k_ptr,  # [B, Hkv, n, D] on the device (the hot tier's rows)
    src_v_ptr,
    src_valid_ptr,  # [B, n] uint8
    dst_k_ptr,  # [B, Hkv, n, D] pinned host memory (the host tier's rows), written through UVA
    dst_v_ptr,
    dst_valid_ptr,  # [B, n] uint8, pinned
    min_ptr,  # [B, Hkv, n / BLOCK_SIZE, D] pinned (HAS_DIGEST): per-block min over valid rows, +inf if none
    max_ptr,
    min_dev_ptr,  # [B, Hkv, n / BLOCK_SIZE, D] on the device (HAS_MIRROR): the same, 0 where no row is valid
    max_dev_ptr,
    block_valid_ptr,  # [B, n / BLOCK_SIZE] uint8 on the device (HAS_MIRROR): whether a block has a valid row
    num_kv_heads,
    head_dim,
    stride_skb, stride_skh, stride_skt,
    stride_svb, stride_svh, stride_svt,
    stride_smb,
    stride_dkb, stride_dkh, stride_dkt,
    stride_dvb, stride_dvh, stride_dvt,
    stride_dmb,
    stride_gb, stride_gh, stride_gk,  # the host digests' strides (min and max alike)
    stride_eb, stride_eh, stride_ek,  # the mirror's strides (min and max alike)
    stride_bvb,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_DIGEST: tl.constexpr,
    HAS_MIRROR: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blk = tl.program_id(1)
    b = pid // num_kv_heads
    h = pid % num_kv_heads
    rows = blk * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, BLOCK_D)
    dmask = (d < head_dim)[None, :]
    valid = tl.load(src_valid_ptr + b * stride_smb + rows) != 0
    k = tl.load(
        src_k_ptr + b * stride_skb + h * stride_skh + rows[:, None] * stride_skt + d[None, :], mask=dmask
    )
    v = tl.load(
        src_v_ptr + b * stride_svb + h * stride_svh + rows[:, None] * stride_svt + d[None, :], mask=dmask
    )
    tl.store(
        dst_k_ptr + b * stride_dkb + h * stride_dkh + rows[:, None] * stride_dkt + d[None, :], k, mask=dmask
    )
    tl.store(
        dst_v_ptr + b * stride_dvb + h * stride_dvh + rows[:, None] * stride_dvt + d[None, :], v, mask=dmask
    )
    if h == 0:
        tl.store(dst_valid_ptr + b * stride_dmb + rows, valid.to(tl.uint8))
    if HAS_DIGEST:
        kf = k.to(tl.float32)
        kmin = tl.min(tl.where(valid[:, None], kf, float("inf")), axis=0)
        kmax = tl.max(tl.where(valid[:, None], kf, float("-inf")), axis=0)
        dig = b * stride_gb + h * stride_gh + blk * stride_gk + d
        tl.store(min_ptr + dig, kmin.to(min_ptr.dtype.element_ty), mask=d < head_dim)
        tl.store(max_ptr + dig, kmax.to(max_ptr.dtype.element_ty), mask=d < head_dim)
        if HAS_MIRROR:
            mir = b * stride_eb + h * stride_eh + blk * stride_ek + d
            finite_min = tl.where(kmin == float("inf"), 0.0, kmin)
            finite_max = tl.where(kmax == float("-inf"), 0.0, kmax)
            tl.store(min_dev_ptr + mir, finite_min.to(min_dev_ptr.dtype.element_ty), mask=d < head_dim)
            tl.store(max_dev_ptr + mir, finite_max.to(max_dev_ptr.dtype.element_ty), mask=d < head_dim)
            if h == 0:
                any_valid = tl.max(valid.to(tl.int32), axis=0) > 0
                tl.store(block_valid_ptr + b * stride_bvb + blk, any_valid.to(tl.uint8))
