"""Launchers of the certified selection's kernels (`certify_kernels`), inside a captured decode step: the key
sketch's logit bounds of every host row, read from the int8 codes, and the histogram that ranks the units (each
query head's units in bins under its best bound, the far bin summed without a scatter's contention)."""

from __future__ import annotations

import torch

from ..reference import CERTIFY_BUCKET_NATS, CERTIFY_BUCKETS, CERTIFY_SLACK_ABS, CERTIFY_SLACK_REL
from ._common import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    _block_d,
    _check,
    _check_on,
    _check_real,
    _check_tensor,
    _group_pad,
    _guard,
    _run_device,
    _unit_last_stride,
)

try:
    import triton

    from . import certify_kernels as _kernels
except ImportError:  # the torch reference remains usable without triton
    triton = None
    _kernels = None

# units per program, in steps of HISTOGRAM_BLOCK_N: a row of 128K units takes 32 programs, so the last bin (nearly
# every unit) takes 32 atomic adds where a scatter takes one per unit
HISTOGRAM_TILE = 4096
HISTOGRAM_BLOCK_N = 256
SKETCH_BLOCK_N = 64  # rows per program of `sketch_bounds`


def sketch_bounds(q, codes, row_scale, error, row_valid, scale: float):
    """`policies.certify.sketch_logit_bounds` on the GPU: (upper, lower) [B, Hq, n] float32.

    Parameters
    ----------
    q : [B, Hq, D] float16 / bfloat16 / float32; D <= MAX_HEAD_DIM
    codes : [B, Hkv, n, D] int8 on q's device, stride 1 along D (a view of a wider store is fine)
    row_scale, error : [B, Hkv, n] float32 on q's device, stride 1 along n
    row_valid : [B, n] bool on q's device
    scale : the attention's logit scale, > 0
    """
    device = _run_device("q", q)
    _check_tensor("q", q, "[B, Hq, D]", (None, None, None), FLOAT_DTYPES)
    batch, num_q_heads, head_dim = q.shape
    _check(head_dim <= MAX_HEAD_DIM, f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")
    _check_tensor("codes", codes, "[B, Hkv, n, D]", (batch, None, None, head_dim), (torch.int8,))
    num_kv_heads, n = codes.shape[1], codes.shape[2]
    _check(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"q's {num_q_heads} heads must be a multiple of codes' {num_kv_heads} KV heads",
    )
    for name, t in (("row_scale", row_scale), ("error", error)):
        _check_tensor(name, t, "[B, Hkv, n]", (batch, num_kv_heads, n), (torch.float32,))
        _check(t.stride(-1) == 1, f"{name} must be contiguous along n")
    _check_tensor("row_valid", row_valid, "[B, n]", (batch, n), (torch.bool,))
    for name, t in (("codes", codes), ("row_scale", row_scale), ("error", error), ("row_valid", row_valid)):
        _check_on(name, t, device)
    _check_real("scale", scale, low=0.0)
    q = _unit_last_stride("q", q, may_copy=True)
    codes = _unit_last_stride("codes", codes, may_copy=False)
    upper = torch.empty(batch, num_q_heads, n, dtype=torch.float32, device=device)
    lower = torch.empty_like(upper)
    if batch == 0 or n == 0:
        return upper, lower
    valid = row_valid.view(torch.uint8)
    with _guard(device):
        _kernels.sketch_bounds_kernel[(batch, num_kv_heads, triton.cdiv(n, SKETCH_BLOCK_N))](
            q, codes, row_scale, error, valid, upper, lower, n, num_q_heads // num_kv_heads, float(scale),
            *q.stride()[:2], *codes.stride()[:3], *row_scale.stride()[:2], *error.stride()[:2], valid.stride(0),
            *upper.stride()[:2], CERTIFY_SLACK_ABS, CERTIFY_SLACK_REL,
            HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim), GROUP_PAD=_group_pad(num_q_heads // num_kv_heads),
            BLOCK_N=SKETCH_BLOCK_N, num_warps=4,
        )  # fmt: skip
    return upper, lower


def certify_histogram(mass, lower, free, top):
    """`reference.certify_histogram` on the GPU (same arguments and results).

    Parameters
    ----------
    mass : [R, n] float32, stride 1 along n
    lower : [R, n] float32 on mass's device, or None
    free : [R, n] bool on mass's device
    top : [R] float64 on mass's device
    """
    device = _run_device("mass", mass)
    _check_tensor("mass", mass, "[R, n]", (None, None), (torch.float32,))
    rows, n = mass.shape
    _check_tensor("free", free, "[R, n]", (rows, n), (torch.bool,))
    _check_tensor("top", top, "[R]", (rows,), (torch.float64,))
    for name, t in (("free", free), ("top", top)):
        _check_on(name, t, device)
    if lower is not None:
        _check_tensor("lower", lower, "[R, n]", (rows, n), (torch.float32,))
        _check_on("lower", lower, device)
    for name, t in (("mass", mass), ("lower", lower), ("free", free)):
        _check(t is None or t.stride(-1) == 1, f"{name} must be contiguous along n")
    tail = torch.zeros(rows, CERTIFY_BUCKETS, dtype=torch.float64, device=device)
    count = torch.zeros(rows, CERTIFY_BUCKETS, dtype=torch.int64, device=device)
    gained = torch.zeros_like(tail) if lower is not None else None
    if rows == 0 or n == 0:
        return tail, count, gained
    free_bytes = free.view(torch.uint8)
    lower_arg = lower if lower is not None else mass  # not read without HAS_LOWER
    grid = (rows, triton.cdiv(n, HISTOGRAM_TILE))
    with _guard(device):
        _kernels.certify_histogram_kernel[grid](
            mass, lower_arg, free_bytes, top.contiguous(), tail, count, gained if gained is not None else tail,
            n, mass.stride(0), lower_arg.stride(0), free_bytes.stride(0),
            BUCKETS=CERTIFY_BUCKETS,
            NATS=CERTIFY_BUCKET_NATS, HAS_LOWER=lower is not None, TILE=HISTOGRAM_TILE,
            BLOCK_N=HISTOGRAM_BLOCK_N,
        )  # fmt: skip
    return tail, count, gained
