"""Shared by the compiled CPU kernels' launchers (`ops`, `selection`): the library handle, thread counts and the
argument checks, each naming the bad argument and what is allowed."""

from __future__ import annotations

import math
import warnings

import torch

from tandem.kernels.cpu import _library
from tandem.kernels.cpu._library import DTYPE_CODES
from tandem.kernels.scales import scale_rows

LOG2E = 1.0 / math.log(2.0)
_STORE_DTYPES = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
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
    if num_threads is None:
        return _library.default_num_threads()
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads: must be a positive int or None, got {num_threads!r}")
    return num_threads


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_tensor(name, t, dim, dtypes=None, shape=None):
    # on the per-layer hot path: cheap checks first, messages built only on failure
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be on the CPU, got device {t.device}")
    if t.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {t.dtype} not supported; allowed: {allowed}")
    if shape is not None:
        for got, want in zip(t.shape, shape, strict=True):  # a plain loop: any() over a generator costs more
            if want is not None and got != want:
                raise ValueError(f"{name}: expected shape {tuple(shape)} (None = any), got {tuple(t.shape)}")


_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_SCALES = (None, None, 0, 0, 0, 0, 1)  # AttendArgs' scale fields of a float store


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous tensor of `dtype`, without a call into torch when it already is one (per-layer path)."""
    if t.dtype is dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _rows_contiguous(name: str, t: torch.Tensor) -> None:
    # a copy of a KV store would cost more than the attention itself: refuse instead of copying
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")


def _check_store(q, k_store, v_store) -> tuple[int, int]:
    """K/V stores [B, Hkv, cap, D] for q [B, Hq, ..., D]: same batch and head_dim, Hq a multiple of Hkv, rows
    contiguous. Returns (Hkv, cap)."""
    _check_tensor("k_store", k_store, 4, tuple(DTYPE_CODES), (q.shape[0], None, None, q.shape[-1]))
    num_kv_heads, cap = k_store.shape[1], k_store.shape[2]
    _check_tensor("v_store", v_store, 4, (k_store.dtype,), tuple(k_store.shape))
    if num_kv_heads == 0 or q.shape[1] % num_kv_heads:
        raise ValueError(f"q: {q.shape[1]} query heads is not a multiple of {num_kv_heads} KV heads")
    _rows_contiguous("k_store", k_store)
    _rows_contiguous("v_store", v_store)
    return num_kv_heads, cap


def _check_scales(k_store, k_scale, v_scale) -> tuple:
    """AttendArgs' scale fields for a store: none for a float one; for 8-bit codes, the scales checked by
    `scales.scale_rows` (on the CPU, like the store)."""
    rows = scale_rows(k_store, k_scale, v_scale)
    if not rows:
        return _NO_SCALES
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.device.type != "cpu":
            raise ValueError(f"{name}: must be a CPU tensor like k_store, got one on {t.device}")
    return (_ptr(k_scale), _ptr(v_scale), *k_scale.stride()[:2], *v_scale.stride()[:2], rows)
