"""Binding of the compiled certified row selection: `certified_rows_reference` of `tandem.policies.certify` in
one call (csrc/certify.cpp), plus `num_threads`. No launcher of `tandem.kernels.ops` stands before it, so it checks
its arguments itself: each refusal is a ValueError naming the argument. Row-indexed inputs are read in place
through their strides (the caller passes slices of capacity-wide buffers); only a last dim that is not
contiguous is copied, and the codes, which a copy would cost most, are refused instead."""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels import reference
from tandem.kernels.cpu import _library
from tandem.kernels.cpu._checks import _as, _native, _ptr, _rows_contiguous, _threads
from tandem.kernels.cpu._library import CertifyArgs

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _expect(name: str, t, shape: tuple, dtypes: tuple) -> None:
    """Refuse t unless it is a CPU tensor of `shape` and one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' / '.join(str(d) for d in dtypes)}, got {t.dtype}")


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous (read in place through its other strides), else a copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _max_units(max_units, batch: int, num_q_heads: int) -> torch.Tensor:
    """max_units as an int64 [B, Hq] view (strides 0 where broadcast): an int, or an integer tensor."""
    if isinstance(max_units, bool) or not isinstance(max_units, (int, torch.Tensor)):
        raise ValueError(f"max_units must be an int or an integer tensor, got {type(max_units).__name__}")
    if isinstance(max_units, int):
        return torch.full((1, 1), max_units, dtype=torch.int64).expand(batch, num_q_heads)
    if max_units.dtype.is_floating_point or max_units.dtype.is_complex or max_units.dtype == torch.bool:
        raise ValueError(f"max_units must be an int or an integer tensor, got {max_units.dtype}")
    if not max_units.is_cpu:
        raise ValueError(f"max_units must be on the CPU, got {max_units.device}")
    try:
        return max_units.to(torch.int64).expand(batch, num_q_heads)
    except RuntimeError as err:
        shape = [batch, num_q_heads]
        raise ValueError(f"max_units must broadcast to {shape}, got shape {list(max_units.shape)}") from err


def _check(q, codes, row_scale, error, row_valid, known_lse, num_kv_heads, value_norm, block_size, forced):
    """Shapes, dtypes and devices of the arguments; returns (B, Hq, Hkv, n, D)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [B, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    batch, num_q_heads, head_dim = q.shape
    _expect("q", q, (batch, num_q_heads, head_dim), _FLOATS)
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads must be a positive divisor of Hq = {num_q_heads}, got {num_kv_heads}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size}")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 4:
        raise ValueError(f"codes must be a [B, Hkv, n, D] tensor, got {getattr(codes, 'shape', type(codes))}")
    n = codes.shape[2]
    if n % block_size:
        raise ValueError(
            f"codes' rows must be whole blocks: n = {n} is not a multiple of block_size {block_size}"
        )
    rows = (batch, num_kv_heads, n)
    _expect("codes", codes, (*rows, head_dim), (torch.int8,))
    _rows_contiguous(("codes", codes))
    _expect("row_scale", row_scale, rows, (torch.float32,))
    _expect("error", error, rows, (torch.float32,))
    _expect("row_valid", row_valid, (batch, n), (torch.bool,))
    _expect("known_lse", known_lse, (batch, num_q_heads), _FLOATS)
    _expect("value_norm", value_norm, (batch, num_kv_heads, n // block_size), (torch.float32,))
    if forced is not None:
        _expect("forced", forced, rows, (torch.bool,))
    return batch, num_q_heads, num_kv_heads, n, head_dim


def certified_rows(
    q, codes, row_scale, error, row_valid, scale: float, known_lse, epsilon: float, max_units, num_kv_heads: int,
    value_norm, block_size: int, forced=None, num_threads: int | None = None,
):  # fmt: skip
    """The certified selection over single host rows (`tandem.policies.certify.certified_rows_reference`):
    (union [B, Hkv, n] bool, needed [B, Hq] int64, kept [B, Hq] int64, tail_lse [B, Hq] float32, skipped_norm
    [B, Hkv] float32).

    q: [B, Hq, D] float32 / bfloat16 / float16; codes: [B, Hkv, n, D] int8, rows contiguous; row_scale / error:
    [B, Hkv, n] float32 (`key_sketch`); row_valid: [B, n] bool; known_lse: [B, Hq]; max_units: an int or an
    integer tensor broadcasting to [B, Hq]; value_norm: [B, Hkv, n // block_size] float32; forced: [B, Hkv, n]
    bool or None. Row-indexed tensors may be slices (any strides but the last). The fp32 dot products sum in
    another order than torch's matmul, so a row whose bound lies within rounding of a bucket edge may fall in
    the neighbouring bucket; everything else follows the reference's arithmetic."""
    lib = _native()
    if lib is None:
        raise RuntimeError(
            "certified_rows: the compiled CPU kernels are unavailable (see has_certified_rows)"
        )
    batch, num_q_heads, num_kv_heads, n, head_dim = _check(
        q, codes, row_scale, error, row_valid, known_lse, num_kv_heads, value_norm, block_size, forced
    )
    qf = _as(q, torch.float32)
    known = _as(known_lse, torch.float32)
    most = _max_units(max_units, batch, num_q_heads)
    row_scale, error, row_valid, value_norm = (
        _last_contiguous(t) for t in (row_scale, error, row_valid, value_norm)
    )
    forced = None if forced is None else _last_contiguous(forced)
    args = CertifyArgs(
        _ptr(qf), _ptr(codes), *codes.stride()[:3],
        _ptr(row_scale), *row_scale.stride()[:2], _ptr(error), *error.stride()[:2],
        _ptr(row_valid), row_valid.stride(0), _ptr(known), _ptr(most), *most.stride(),
        _ptr(value_norm), *value_norm.stride()[:2],
        _ptr(forced), *(forced.stride()[:2] if forced is not None else (0, 0)),
        batch, num_q_heads, num_kv_heads, n, head_dim, block_size,
        scale, reference.CERTIFY_SLACK_ABS, reference.CERTIFY_SLACK_REL, epsilon, reference.CERTIFY_BUCKET_NATS,
        reference.CERTIFY_TAIL_MARGIN, reference.CERTIFY_BUCKETS,
    )  # fmt: skip
    union = torch.empty(batch, num_kv_heads, n, dtype=torch.bool)
    needed = torch.empty(batch, num_q_heads, dtype=torch.int64)
    kept = torch.empty(batch, num_q_heads, dtype=torch.int64)
    tail_lse = torch.empty(batch, num_q_heads, dtype=torch.float32)
    skipped_norm = torch.empty(batch, num_kv_heads, dtype=torch.float32)
    status = lib.tandem_certified_rows(
        _library.isa_code(), ctypes.byref(args), _ptr(union), _ptr(needed), _ptr(kept), _ptr(tail_lse),
        _ptr(skipped_norm), _threads(num_threads),
    )  # fmt: skip
    if status < 0:
        raise RuntimeError(
            f"CPU kernel rejected isa={_library.isa_code()} buckets={reference.CERTIFY_BUCKETS}"
        )
    return union, needed, kept, tail_lse, skipped_norm
