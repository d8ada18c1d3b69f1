"""Shared by the compiled CPU kernels' bindings (`ops`, `selection`): the library handle, thread counts, raw
pointers and the layout checks that reading tensors in place needs.

Arguments are validated once, by the launchers of `tandem.kernels.ops` (shapes, dtypes, devices, ranges, each
refusal naming the argument and what is allowed). What stays in the bindings guards memory where they lay out raw
pointers and the launchers cannot see it: rows of a store read in place contiguous along head_dim (here), buffers
of the prepared calls contiguous and their index lists within their storage (`ops.PreparedAttention`), the ids
and ranks each call reads (checked by the kernels, reported by the bindings)."""

from __future__ import annotations

import math
import warnings

import torch

from tandem.kernels.cpu import _library

LOG2E = 1.0 / math.log(2.0)
_NO_SCALES = (None, None, 0, 0, 0, 0, 1)  # AttendArgs' scale fields of a float store
_warned = False


def _native():
    lib = _library.library()
    if lib is None:
        global _warned
        if not _warned:
            _warned = True
            warnings.warn(
                f"Tandem CPU kernels unavailable ({_library.unavailable_reason()}); "
                "running the slow torch reference instead",
                RuntimeWarning,
                stacklevel=3,
            )
    return lib


def _threads(num_threads: int | None) -> int:
    return _library.default_num_threads() if num_threads is None else num_threads


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of `dtype`, without a call into torch when it already is one (per-layer path)."""
    if t.dtype is dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _rows_contiguous(*named: tuple[str, torch.Tensor]) -> None:
    # the kernels read each row as head_dim consecutive elements; a copy of a KV store would cost more than the
    # attention itself, so refuse instead of copying
    for name, t in named:
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}"
            )


def _scale_fields(k_store: torch.Tensor, k_scale, v_scale) -> tuple:
    """AttendArgs' scale fields for a store: none for a float one; for 8-bit codes, the scales' pointers, their
    [B, Hkv] strides and G, the rows per scale (`ops` checked them with `scales.scale_rows`)."""
    if k_scale is None:
        return _NO_SCALES
    rows = max(1, k_store.shape[2] // max(k_scale.shape[2], 1))
    return (_ptr(k_scale), _ptr(v_scale), *k_scale.stride()[:2], *v_scale.stride()[:2], rows)
