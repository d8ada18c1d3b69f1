"""What every launcher of the Triton GPU kernels shares: the optional triton import, the interpreter's set-up,
and the input checks, which name the bad argument and what it may be.

Every launcher is CUDA-graph capturable: validation reads only shapes, dtypes, devices and strides (never tensor
values, so no host sync), and preallocated `out=` / `lse=` buffers let a captured graph reuse its outputs.
Scalars (`scale`, `alpha`) are baked into a captured graph; tensors are read at replay.

CPU tensors are accepted only when the kernels were decorated by Triton's interpreter (TRITON_INTERPRET=1 set
before this package is imported), which is how the test suite runs them on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import numbers

import torch

from ..scales import scale_rows

try:
    import triton
    from triton.runtime.jit import JITFunction

    from . import _common_kernels
except ImportError:  # the torch references remain usable without triton
    triton = None
    _common_kernels = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# the compressed host tier's 8-bit stores -> the kernels' QUANT (float8 codes are read as bytes and decoded)
QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
MAX_HEAD_DIM = 256  # padded up to a power of two >= 16 inside the kernels (what `tl.dot` needs)


def interpreted() -> bool:
    """True when the kernels run under Triton's interpreter (they then accept CPU tensors)."""
    return _common_kernels is not None and not isinstance(_common_kernels._dot, JITFunction)


def _fix_interpreter_for_numpy_2_4() -> None:
    """Triton <= 3.6's interpreter turns 1-element arrays into loop bounds with int(), which numpy >= 2.4 refuses
    ("only 0-dimensional arrays can be converted"), so `range` over a runtime bound fails; convert through the
    element instead (triton-lang/triton#9171, fixed upstream). Only the interpreter is touched."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.ones(1))
        return  # this numpy still converts
    except TypeError:
        pass
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "tandem_numpy_fix", False):
        return

    def patched(tensor, *args, **kwargs):
        original(tensor, *args, **kwargs)
        index = lambda self: int(self.handle.data.reshape(-1)[0])
        scope = args[0] if args else kwargs.get("scope")
        if hasattr(scope, "set_attr"):
            scope.set_attr(tensor, "__index__", index)  # restored with the interpreter's own patches
        else:
            tensor.__index__ = index

    patched.tandem_numpy_fix = True
    interpreter._patch_lang_tensor = patched


if interpreted():
    _fix_interpreter_for_numpy_2_4()


def triton_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: CUDA with triton installed, or the interpreter."""
    if _common_kernels is None:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreted()


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


# The checks below build their messages only on failure: they run on every decode step of every layer.


def _check_tensor(name: str, t, layout: str, shape: tuple, dtypes: tuple) -> None:
    """`shape` holds ints, or None where any size is allowed; `layout` names the axes for the message."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        expected = ", ".join("?" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} must have shape {layout} = [{expected}], got {list(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}.dtype must be {allowed}, got {str(t.dtype).removeprefix('torch.')}")


def _check_real(name: str, value, low: float | None = None, high: float | None = None) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(
            f"{name} must be a Python float (a tensor would need a host sync), got {type(value).__name__}"
        )
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")


def _run_device(name: str, t) -> torch.device:
    """The device the kernels run on: `t`'s CUDA device, or the CPU under the interpreter."""
    if _common_kernels is None:
        raise RuntimeError(
            "tandem.kernels.gpu needs triton (pip install triton); use tandem.kernels.reference"
        )
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreted()):
        return t.device
    raise ValueError(
        f"{name} is on {t.device}: the Triton kernels need CUDA tensors (CPU tensors run only under Triton's "
        "interpreter, with TRITON_INTERPRET=1 set before tandem.kernels.gpu is imported)"
    )


def _check_on(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (q's device), got {t.device}")


def _check_readable(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Host-tier tensors: on q's device, or in pinned host memory the GPU reads zero-copy through UVA."""
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            raise ValueError(
                f"{name} is in pageable host memory: the GPU reads a host store only when it is pinned "
                f"(tensor.pin_memory() or pin_memory=True), or put it on {device}"
            )
    else:
        _check_on(name, t, device)


def _positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def _unit_last_stride(name: str, t: torch.Tensor, may_copy: bool) -> torch.Tensor:
    """Rows must be contiguous along head_dim; other strides are passed to the kernel as they are."""
    if t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    _check(
        may_copy,
        f"{name} must be contiguous in its last dimension (stride 1), got strides {t.stride()}; "
        "it is not copied (a copy of a host store would be pageable, and outputs are written in place)",
    )
    return t.contiguous()


def _output(
    name: str, t, shape: tuple, layout: str, device: torch.device, dtype=torch.float32
) -> torch.Tensor:
    if t is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _check_tensor(name, t, layout, shape, (dtype,))
    _check_on(name, t, device)
    return _unit_last_stride(name, t, may_copy=False)


def _kv_scales(keys, k_scale, v_scale, device, names=("k_scale", "v_scale")):
    """(QUANT, G) of a KV store [B, Hkv, T, D]: 0 and 1 for a float store, which takes no scales; 1 (int8) or
    2 (float8_e4m3fn) and the rows per scale for an 8-bit one (`scales.scale_rows` checks the scales), whose
    scales must also be on `device` or pinned."""
    rows = scale_rows(keys, k_scale, v_scale, names)
    if not rows:
        return 0, 1
    for name, t in zip(names, (k_scale, v_scale)):
        _check_readable(name, t, device)
    return QUANT_CODES[keys.dtype], rows


def _as_codes(store: torch.Tensor) -> torch.Tensor:
    """What the kernels read of a store: float8 codes as bytes (decoded by integer work, on any GPU)."""
    return store.view(torch.uint8) if store.dtype == torch.float8_e4m3fn else store


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


# one K or V tile per pipeline stage holds at most this, so that float32 at head_dim 256 fits in shared memory
TILE_BYTES = 32 * 1024


def _tile_rows(rows: int, dtype: torch.dtype, block_d: int) -> int:
    """Rows of a K / V (or q) tile: `rows`, halved while a tile of `dtype` at width `block_d` would exceed
    `TILE_BYTES` (float32 at head_dim 256 would otherwise ask more shared memory than an H100 or H200 has); 16-bit
    and 8-bit tiles up to head_dim 256 keep `rows`."""
    while rows > 16 and rows * block_d * dtype.itemsize > TILE_BYTES:
        rows //= 2
    return rows


def _group_pad(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


def _dot_options(dtype: torch.dtype) -> dict:
    # fp32 inputs would otherwise be rounded to tf32 on tensor cores; 16-bit inputs ignore the setting.
    # The interpreter's dot mishandles bfloat16, so there the tiles are multiplied in fp32 (see `_dot`)
    upcast = interpreted() and dtype == torch.bfloat16
    return {"DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32", "UPCAST": upcast}


def _guard(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
