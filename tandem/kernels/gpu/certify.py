"""Launcher of the certified selection's histogram kernel (`certify_kernels`): the units of each query head in
bins under its best bound, summed without a scatter's contention, inside a captured decode step."""

from __future__ import annotations

import torch

from ..reference import CERTIFY_BUCKET_NATS, CERTIFY_BUCKETS
from ._common import _check, _check_on, _check_tensor, _guard, _run_device

try:
    import triton

    from . import certify_kernels as _kernels
except ImportError:  # the torch reference remains usable without triton
    triton = None
    _kernels = None

# units per program, in steps of HISTOGRAM_BLOCK_N: a row of 128K units takes 32 programs, so each bin takes 32
# atomic adds where a scatter takes one per unit
HISTOGRAM_TILE = 4096
HISTOGRAM_BLOCK_N = 32


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
    grid = (rows, triton.cdiv(n, HISTOGRAM_TILE))
    with _guard(device):
        _kernels.certify_histogram_kernel[grid](
            mass, lower if lower is not None else mass, free_bytes, top.contiguous(), tail, count,
            gained if gained is not None else tail, n, mass.stride(0),
            (lower if lower is not None else mass).stride(0), free_bytes.stride(0),
            BUCKETS=CERTIFY_BUCKETS, BUCKETS_PAD=triton.next_power_of_2(CERTIFY_BUCKETS),
            NATS=CERTIFY_BUCKET_NATS, HAS_LOWER=lower is not None, TILE=HISTOGRAM_TILE,
            BLOCK_N=HISTOGRAM_BLOCK_N,
        )  # fmt: skip
    return tail, count, gained
