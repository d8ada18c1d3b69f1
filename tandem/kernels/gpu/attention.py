"""Launchers of the Triton GPU kernels: validate inputs (naming the bad argument and what it may be), then launch.

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

try:
    import triton
    from triton.runtime.jit import JITFunction

    from . import triton_kernels as _kernels
except ImportError:  # the torch references remain usable without triton
    triton = None
    _kernels = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# the compressed host tier's 8-bit stores -> the kernels' QUANT (float8 codes are read as bytes and decoded)
QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}
MAX_HEAD_DIM = 256  # padded up to a power of two >= 16 inside the kernels (what `tl.dot` needs)
BLOCK_S = 64  # hot-tier slots per tile
BLOCK_N = 64  # host-store rows per tile (several small blocks, or part of a large one)
MAX_SPLITS = 64
SCORE_BLOCK_N = 64  # digest blocks per program of `block_scores`
# `top_blocks` holds rows of up to this many blocks (padded to a power of two) in registers; longer ones are read
# in tiles of TOP_BLOCKS_TILE (`top_blocks_tiled_kernel`), any length. On the H200, 8 rows of 8256 blocks (128K)
# took 44.1 us in tiles, 103 us in a (spilling) 16384-wide register row and 58.5 us with torch.topk(sorted=True);
# the register kernel is the faster one up to 8192 (4160 blocks: 25.5 vs 30.2 tiled vs 42.5 torch; 16 x 8 rows of
# 2112: 14.3 vs 17.0 vs 27.7; benchmarks/results/quest_selection_h200/).
REGISTER_TOP_BLOCKS = 8192
TOP_BLOCKS_TILE = 4096
# Rows over REGISTER_TOP_BLOCKS: "split" spreads each row over tiles of SPLIT_TOP_BLOCKS_TILE blocks, one program
# each, with the radix histograms added up in global memory (7 launches, any length); "tiles" is the one-program
# kernel above. On the H100, 8 rows of 8256 blocks (128K): 27.5 us split (1024-block tiles) against 43.7 tiled;
# 8 rows of 65600 (1M): 36.5 against 246 (torch.topk: 72); the register kernel stays faster up to 8192 (64K:
# 25.6 against 27.4 split; benchmarks/results/quest_selection_h100/).
LONG_ROWS = "split"
SPLIT_TOP_BLOCKS_TILE = 1024


def interpreted() -> bool:
    """True when the kernels run under Triton's interpreter (they then accept CPU tensors)."""
    return _kernels is not None and not isinstance(_kernels.hot_decode_kernel, JITFunction)


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
    if _kernels is None:
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
    if _kernels is None:
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


def _check_qkv(q, keys, values, q_layout: str, kv_layout: str, q_dims: int = 3, quantized_ok=False) -> None:
    """q [B, Hq, ..., D] (`q_dims` dims) against keys / values [B, Hkv, T, D] of q's dtype (or, with
    `quantized_ok`, 8-bit codes: see `_kv_scales`)."""
    _check_tensor("q", q, q_layout, (None,) * q_dims, FLOAT_DTYPES)
    batch, num_q_heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (q.shape[-1]) must lie in [1, {MAX_HEAD_DIM}], got {head_dim}")
    kv_dtypes = (q.dtype, *QUANT_CODES) if quantized_ok else (q.dtype,)
    _check_tensor("keys", keys, kv_layout, (batch, None, None, head_dim), kv_dtypes)
    _check_tensor("values", values, kv_layout, tuple(keys.shape), (keys.dtype,))
    num_kv_heads = keys.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a positive multiple of keys heads ({num_kv_heads})"
        )


def _kv_scales(keys, k_scale, v_scale, device, names=("k_scale", "v_scale")):
    """(QUANT, G) of a KV store [B, Hkv, T, D]: 0 and 1 for a float store, which takes no scales; 1 (int8) or
    2 (float8_e4m3fn) and the rows per scale for an 8-bit one, which needs k / v scales [B, Hkv, T // G] float32
    (G >= 1 dividing T, stride 1 along T // G) on `device` or pinned."""
    k_name, v_name = names
    dtype = str(keys.dtype).removeprefix("torch.")
    quant = QUANT_CODES.get(keys.dtype, 0)
    if not quant:
        for name, t in ((k_name, k_scale), (v_name, v_scale)):
            _check(
                t is None,
                f"{name} must be None for a {dtype} store (scales go with int8 / float8_e4m3fn codes), "
                f"got a {type(t).__name__}",
            )
        return 0, 1
    batch, num_kv_heads, num_rows = keys.shape[:3]
    layout = "[B, Hkv, T // G]"
    for name, t in ((k_name, k_scale), (v_name, v_scale)):
        _check(t is not None, f"{name} is required for a store of {dtype} codes: {layout} float32")
    _check_tensor(k_name, k_scale, layout, (batch, num_kv_heads, None), (torch.float32,))
    _check_tensor(v_name, v_scale, f"{layout} ({k_name}'s shape)", tuple(k_scale.shape), (torch.float32,))
    num_scales = k_scale.shape[2]
    if not ((num_scales > 0 and num_rows % num_scales == 0) or num_rows == num_scales == 0):
        raise ValueError(
            f"{k_name}.shape[2] must divide the store's T = {num_rows} rows (G = T // {k_name}.shape[2] rows "
            f"per scale), got {num_scales}"
        )
    for name, t in ((k_name, k_scale), (v_name, v_scale)):
        _check_readable(name, t, device)
        _check(
            t.stride(-1) == 1 or t.shape[-1] <= 1,
            f"{name} must be contiguous in its last dimension, got strides {t.stride()}",
        )
    return quant, max(1, num_rows // max(num_scales, 1))


def _as_codes(store: torch.Tensor) -> torch.Tensor:
    """What the kernels read of a store: float8 codes as bytes (decoded by integer work, on any GPU)."""
    return store.view(torch.uint8) if store.dtype == torch.float8_e4m3fn else store


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


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


def hot_decode_attention(q, keys, values, valid, scale, maw=None, alpha=0.0, out=None, lse=None):
    """Decode attention of one query per request over the GPU hot tier; optionally HGCA's moving average.

    Parameters
    ----------
    q : [B, Hq, D] float16 / bfloat16 / float32 on CUDA; D <= MAX_HEAD_DIM
    keys, values : [B, Hkv, S, D] q's dtype and device, Hq % Hkv == 0; stride 1 along D (other strides free,
        so a slice of a larger preallocated buffer needs no copy)
    valid : [B, S] bool, True at slots holding real tokens (any pattern, not only a prefix)
    scale : float softmax scale
    maw : optional [B, Hq, S] float32, stride 1 along S; updated in place to (1 - alpha) * maw + alpha * p,
        p the softmax weight of each slot for each query head (0 at invalid slots)
    alpha : float in [0, 1]
    out, lse : optional preallocated outputs [B, Hq, D] / [B, Hq] float32 (reused buffers for CUDA graphs)

    Returns (out [B, Hq, D] float32, lse [B, Hq] float32); a request without a valid slot gets out 0, lse -inf.

    Example::

        q = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
        valid = torch.ones(2, 300, dtype=torch.bool, device="cuda")
        out, lse = hot_decode_attention(q, keys, keys, valid, 0.125)
    """
    device = _run_device("q", q)
    _check_qkv(q, keys, values, "[B, Hq, D]", "[B, Hkv, S, D]")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_slots = keys.shape[1], keys.shape[2]
    for name, t in (("keys", keys), ("values", values)):
        _check_on(name, t, device)
    _check_tensor("valid", valid, "[B, S]", (batch, num_slots), (torch.bool,))
    _check_on("valid", valid, device)
    _check_real("scale", scale)
    _check_real("alpha", alpha, 0.0, 1.0)
    if maw is not None:
        _check_tensor("maw", maw, "[B, Hq, S]", (batch, num_q_heads, num_slots), (torch.float32,))
        _check_on("maw", maw, device)
        maw = _unit_last_stride("maw", maw, may_copy=False)
    q = _unit_last_stride("q", q, may_copy=True)
    keys = _unit_last_stride("keys", keys, may_copy=True)
    values = _unit_last_stride("values", values, may_copy=True)
    out = _output("out", out, (batch, num_q_heads, head_dim), "[B, Hq, D]", device)
    lse = _output("lse", lse, (batch, num_q_heads), "[B, Hq]", device)
    if batch == 0:
        return out, lse

    group = num_q_heads // num_kv_heads
    maw_arg, maw_strides = (maw, maw.stride()[:2]) if maw is not None else (lse, (0, 0))
    with _guard(device):
        _kernels.hot_decode_kernel[(batch, num_kv_heads)](
            q,
            keys,
            values,
            valid.view(torch.uint8),
            out,
            lse,
            maw_arg,
            num_slots,
            group,
            float(scale),
            float(alpha),
            *q.stride()[:2],
            *keys.stride()[:3],
            *values.stride()[:3],
            *valid.stride(),
            *out.stride()[:2],
            *lse.stride(),
            *maw_strides,
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            GROUP_PAD=_group_pad(group),
            BLOCK_S=BLOCK_S,
            HAS_MAW=maw is not None,
            **_dot_options(q.dtype),
            num_warps=4,
        )
    return out, lse


def prefill_attention(
    q, keys, values, scale, key_valid=None, causal_offset=None, out=None, lse=None, accumulate=False
):
    """Attention of many queries (a prefill chunk) over keys on the GPU, returning (out, lse): FlashAttention
    style, fp32 accumulation, no logits materialised. The exact path of a chunked prefill uses it for the chunk's
    own keys (causal), the hot tier and the host rows streamed to the GPU, merging each into the last.

    Parameters
    ----------
    q : [B, Hq, Lq, D] float16 / bfloat16 / float32, stride 1 along D
    keys, values : [B, Hkv, T, D] q's dtype and device, Hq % Hkv == 0, stride 1 along D
    key_valid : optional [B, T] bool, False at keys to skip (padding, empty slots)
    causal_offset : None, or an int: query i sits at key position causal_offset + i, later keys are masked and
        the key at its own position is attended even when invalid (a padding query attends itself)
    out, lse : optional [B, Hq, Lq, D] / [B, Hq, Lq] float32 outputs; with `accumulate` they hold a partial
        result over other keys, which this call merges into (in place, exactly by LSE)

    Returns (out, lse); a query with no key to attend keeps out 0, lse -inf (or its earlier result).
    """
    device = _run_device("q", q)
    _check_qkv(q, keys, values, "[B, Hq, Lq, D]", "[B, Hkv, T, D]", q_dims=4)
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads, num_keys = keys.shape[1], keys.shape[2]
    for name, t in (("keys", keys), ("values", values)):
        _check_on(name, t, device)
    if key_valid is not None:
        _check_tensor("key_valid", key_valid, "[B, T]", (batch, num_keys), (torch.bool,))
        _check_on("key_valid", key_valid, device)
    _check(
        causal_offset is None or (isinstance(causal_offset, numbers.Integral) and causal_offset >= 0),
        f"causal_offset must be None or an int >= 0, got {causal_offset!r}",
    )
    _check_real("scale", scale)
    _check(not accumulate or (out is not None and lse is not None), "accumulate=True needs out and lse")
    q = _unit_last_stride("q", q, may_copy=True)
    keys = _unit_last_stride("keys", keys, may_copy=True)
    values = _unit_last_stride("values", values, may_copy=True)
    out = _output("out", out, (batch, num_q_heads, q_len, head_dim), "[B, Hq, Lq, D]", device)
    lse = _output("lse", lse, (batch, num_q_heads, q_len), "[B, Hq, Lq]", device)
    if batch == 0 or q_len == 0:
        return out, lse
    if num_keys == 0 and causal_offset is None:
        if not accumulate:
            out.zero_()
            lse.fill_(float("-inf"))
        return out, lse
    valid = key_valid.view(torch.uint8) if key_valid is not None else lse  # a placeholder when absent
    valid_strides = key_valid.stride() if key_valid is not None else (0, 0)
    block_m = 64 if q_len > 32 else 16
    with _guard(device):
        _kernels.prefill_attention_kernel[(triton.cdiv(q_len, block_m), batch * num_q_heads)](
            q, keys, values, valid, out, lse,
            q_len, num_keys, num_q_heads, num_q_heads // num_kv_heads,
            0 if causal_offset is None else int(causal_offset), float(scale),
            *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *valid_strides,
            *out.stride()[:3], *lse.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            BLOCK_M=block_m,
            BLOCK_N=64,
            HAS_VALID=key_valid is not None,
            CAUSAL=causal_offset is not None,
            ACCUMULATE=bool(accumulate),
            **_dot_options(q.dtype),
            num_warps=4,
            num_stages=2,
        )  # fmt: skip
    return out, lse


def _pick_splits(device: torch.device, programs: int, width: int, block_size: int) -> int:
    """Enough programs to keep the GPU's SMs issuing reads (PCIe needs many in flight), >= 2 tiles each."""
    if device.type != "cuda":
        return 1
    wanted = -(-2 * _sm_count(device) // max(programs, 1))
    by_work = (width * block_size) // (2 * BLOCK_N)
    return max(1, min(wanted, by_work, MAX_SPLITS))


def host_block_attention(
    q,
    keys,
    values,
    block_ids,
    lengths,
    block_size,
    valid,
    scale,
    out=None,
    lse=None,
    num_splits=None,
    *,
    k_scale=None,
    v_scale=None,
):
    """Attention of GPU queries over selected blocks of a KV store in pinned host memory, read zero-copy.

    The GPU reads the pinned store directly through unified virtual addressing: only the selected rows cross
    PCIe, and the store is never copied. Selected blocks are split over `num_splits` programs per
    (request, KV head) whose partial results are merged by LSE.

    Parameters
    ----------
    q : [B, Hq, D] float16 / bfloat16 / float32 on CUDA; D <= MAX_HEAD_DIM
    keys, values : [B, Hkv, T, D] q's dtype, in pinned host memory (or on q's device); stride 1 along D. Or
        int8 / float8_e4m3fn codes (the compressed host tier, 1 byte per element over PCIe) with `k_scale`,
        `v_scale`: row r decodes as codes[..., r, :] * scale[..., r // G] in fp32, rounded to q's dtype
    block_ids : [B, Hkv, S] int32 / int64 block ids, pinned or on q's device; row r of block b is
        b * block_size + r; entries past `lengths` are never read; rows outside [0, T) are skipped
    lengths : [B, Hkv] int32 / int64, number of live entries of `block_ids` (clamped to [0, S])
    block_size : int >= 1
    valid : [B, T] bool, False at padding rows (never attended), pinned or on q's device
    scale : float softmax scale
    out, lse : optional preallocated outputs [B, Hq, D] / [B, Hq] float32 on q's device
    num_splits : optional int >= 1 (default: chosen from the SM count and S * block_size)
    k_scale, v_scale : [B, Hkv, T // G] float32, pinned or on q's device, stride 1 along T // G; required
        exactly when keys / values are 8-bit codes (G = T // k_scale.shape[2] must divide T)

    Returns (out [B, Hq, D] float32, lse [B, Hq] float32); an empty selection gives out 0, lse -inf.
    """
    device = _run_device("q", q)
    _check_qkv(q, keys, values, "[B, Hq, D]", "[B, Hkv, T, D]", quantized_ok=True)
    quant, scale_group = _kv_scales(keys, k_scale, v_scale, device)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_rows = keys.shape[1], keys.shape[2]
    _check_tensor("block_ids", block_ids, "[B, Hkv, S]", (batch, num_kv_heads, None), INDEX_DTYPES)
    _check_tensor("lengths", lengths, "[B, Hkv]", (batch, num_kv_heads), INDEX_DTYPES)
    _check_tensor("valid", valid, "[B, T]", (batch, num_rows), (torch.bool,))
    for name, t in (("keys", keys), ("values", values), ("block_ids", block_ids), ("lengths", lengths)):
        _check_readable(name, t, device)
    _check_readable("valid", valid, device)
    if not _positive_int(block_size):
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    _check_real("scale", scale)
    if num_splits is not None and not _positive_int(num_splits):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    q = _unit_last_stride("q", q, may_copy=True)
    keys = _unit_last_stride("keys", keys, may_copy=keys.device.type == "cuda")
    values = _unit_last_stride("values", values, may_copy=values.device.type == "cuda")
    out = _output("out", out, (batch, num_q_heads, head_dim), "[B, Hq, D]", device)
    lse = _output("lse", lse, (batch, num_q_heads), "[B, Hq]", device)
    if batch == 0:
        return out, lse

    width = block_ids.shape[2]
    group = num_q_heads // num_kv_heads
    if not quant:  # placeholders, never read
        k_scale = v_scale = lse
    splits = num_splits or _pick_splits(device, batch * num_kv_heads, width, int(block_size))
    entries_per_split = max(1, -(-width // splits))
    splits = max(1, -(-width // entries_per_split))  # no split left without entries
    if splits == 1:
        part_out, part_lse = out[:, :, None], lse[:, :, None]
    else:
        part_out = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=device)
    with _guard(device):
        _kernels.block_attention_kernel[(batch, num_kv_heads, splits)](
            q,
            _as_codes(keys),
            _as_codes(values),
            valid.view(torch.uint8),
            block_ids,
            lengths,
            part_out,
            part_lse,
            k_scale,
            v_scale,
            num_rows,
            width,
            entries_per_split,
            group,
            float(scale),
            scale_group,
            *q.stride()[:2],
            *keys.stride()[:3],
            *values.stride()[:3],
            *valid.stride(),
            *block_ids.stride(),
            *lengths.stride(),
            *part_out.stride()[:3],
            *part_lse.stride(),
            *(k_scale.stride()[:2] if quant else (0, 0)),
            *(v_scale.stride()[:2] if quant else (0, 0)),
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            GROUP_PAD=_group_pad(group),
            BLOCK_N=BLOCK_N,
            BLOCK_SIZE=int(block_size),
            QUANT=quant,
            RNE_BF16=interpreted() and q.dtype == torch.bfloat16,
            **_dot_options(q.dtype),
            num_warps=4,
        )
        if splits > 1:
            _kernels.combine_splits_kernel[(batch, num_q_heads)](
                part_out,
                part_lse,
                out,
                lse,
                splits,
                *part_out.stride()[:3],
                *part_lse.stride(),
                *out.stride()[:2],
                *lse.stride(),
                HEAD_DIM=head_dim,
                BLOCK_D=_block_d(head_dim),
                SPLITS_PAD=triton.next_power_of_2(splits),
                num_warps=4,
            )
    return out, lse


def block_scores(q, key_min, key_max, block_valid, out=None):
    """Quest's upper bound of q.k for every block of a digest store, one decode query per request.

    Parameters
    ----------
    q : [B, Hq, D] float16 / bfloat16 / float32 on CUDA; D <= MAX_HEAD_DIM
    key_min, key_max : [B, Hkv, NB, D] per-block key minima / maxima, finite, on q's device (q's dtype or any
        float dtype: q is rounded to theirs, as the reference does); stride 1 along D
    block_valid : [B, NB] bool on q's device, False at blocks with no real row
    out : optional preallocated [B, Hkv, NB] float32

    Returns [B, Hkv, NB] float32: max over each KV head's query group of sum_d max(q_d min_d, q_d max_d), -inf
    at invalid blocks. See `reference.block_scores_matmul`.
    """
    device = _run_device("q", q)
    _check_tensor("q", q, "[B, Hq, D]", (None, None, None), FLOAT_DTYPES)
    batch, num_q_heads, head_dim = q.shape
    _check(head_dim <= MAX_HEAD_DIM, f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")
    _check_tensor("key_min", key_min, "[B, Hkv, NB, D]", (batch, None, None, head_dim), FLOAT_DTYPES)
    num_kv_heads, num_blocks = key_min.shape[1], key_min.shape[2]
    _check_tensor("key_max", key_max, "[B, Hkv, NB, D] (key_min's shape)", tuple(key_min.shape), FLOAT_DTYPES)
    _check(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        f"q's {num_q_heads} heads must be a multiple of key_min's {num_kv_heads} KV heads",
    )
    _check_tensor("block_valid", block_valid, "[B, NB]", (batch, num_blocks), (torch.bool,))
    for name, t in (("key_min", key_min), ("key_max", key_max), ("block_valid", block_valid)):
        _check_on(name, t, device)
    q = _unit_last_stride("q", q, may_copy=True)
    key_min = _unit_last_stride("key_min", key_min, may_copy=True)
    key_max = _unit_last_stride("key_max", key_max, may_copy=True)
    out = _output("out", out, (batch, num_kv_heads, num_blocks), "[B, Hkv, NB]", device)
    if batch == 0 or num_blocks == 0:
        return out
    group = num_q_heads // num_kv_heads
    with _guard(device):
        _kernels.block_scores_kernel[(batch, num_kv_heads, triton.cdiv(num_blocks, SCORE_BLOCK_N))](
            q,
            key_min,
            key_max,
            block_valid.view(torch.uint8),
            out,
            num_blocks,
            group,
            *q.stride()[:2],
            *key_min.stride()[:3],
            *key_max.stride()[:3],
            block_valid.stride(0),
            *out.stride()[:2],
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            GROUP_PAD=_group_pad(group),
            BLOCK_N=SCORE_BLOCK_N,
            **_dot_options(key_max.dtype),
            num_warps=4,
        )
    return out


def top_blocks(scores, k, width: int, out=None):
    """The `k` best-scoring blocks of each row as a set, for Quest's selection inside a captured decode step.

    Parameters
    ----------
    scores : [..., NB] float32 on CUDA, stride 1 along NB (rows over REGISTER_TOP_BLOCKS are read in tiles)
    k : [1] int64 tensor on scores' device (read at run time, so a recorded graph follows it), 0 <= k <= width
    width : int >= 1, the output's fixed width (the most blocks any step keeps)
    out : optional preallocated [..., width] int64

    Returns [..., width] int64: the kept ids ascending, then NB (an invalid pick) up to `width`. Blocks scoring
    -inf are never kept; ties at the k-th score go to the lower ids. See `reference.top_blocks`.
    """
    device = _run_device("scores", scores)
    _check_tensor("scores", scores, "[..., NB]", tuple(scores.shape), (torch.float32,))
    _check(scores.dim() >= 1, "scores must have shape [..., NB], got a 0-d tensor")
    num_blocks = scores.shape[-1]
    _check_tensor("k", k, "[1]", (1,), (torch.int64,))
    _check_on("k", k, device)
    _check(_positive_int(width), f"width must be a positive int, got {width!r}")
    lead = tuple(scores.shape[:-1])
    out = _output("out", out, (*lead, width), "[..., width]", device, dtype=torch.int64)
    _check(out.is_contiguous(), f"out must be contiguous (written in place), got strides {out.stride()}")
    rows = (
        scores.reshape(-1, num_blocks) if scores.is_contiguous() else scores.contiguous().view(-1, num_blocks)
    )
    if rows.shape[0] == 0 or num_blocks == 0:
        return out.fill_(num_blocks)
    block = max(16, triton.next_power_of_2(num_blocks))
    args = (rows, k, out.view(-1, width), num_blocks, width, rows.stride(0), width)
    with _guard(device):
        if block <= REGISTER_TOP_BLOCKS:
            _kernels.top_blocks_kernel[(rows.shape[0],)](
                *args,
                BLOCK=block,
                WIDTH_PAD=triton.next_power_of_2(width),
                num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
            )
        elif LONG_ROWS == "tiles":
            _kernels.top_blocks_tiled_kernel[(rows.shape[0],)](*args, TILE=TOP_BLOCKS_TILE, num_warps=8)
        else:
            _top_blocks_split(rows, k, out.view(-1, width), width)
    return out


def _top_blocks_split(rows, k, out, width: int) -> None:
    """`top_blocks` of long rows over (row, tile) programs: four radix passes whose histograms are summed with
    atomics, then per tile the counts above / at the threshold, then the ids written at their place."""
    num_rows, num_blocks = rows.shape
    tile = SPLIT_TOP_BLOCKS_TILE
    num_tiles = triton.cdiv(num_blocks, tile)
    hist = torch.zeros(num_rows, 4, 256, dtype=torch.int32, device=rows.device)
    counts = torch.empty(num_rows, num_tiles, 2, dtype=torch.int32, device=rows.device)
    grid = (num_rows, num_tiles)
    warps = 4 if tile <= 2048 else 8
    for p in range(4):
        _kernels.top_blocks_hist_kernel[grid](
            rows, k, hist, num_blocks, width, rows.stride(0), P=p, TILE=tile, num_warps=warps
        )
    _kernels.top_blocks_count_kernel[grid](
        rows, k, hist, counts, num_blocks, width, rows.stride(0), num_tiles, TILE=tile, num_warps=warps
    )
    _kernels.top_blocks_write_kernel[grid](
        rows, k, hist, counts, out, num_blocks, width, rows.stride(0), width, num_tiles,
        TILE=tile, TILES_PAD=max(2, triton.next_power_of_2(num_tiles)), num_warps=warps,
    )  # fmt: skip


def recall_plan(ids, k, share, state, out, block_size):
    """One step's plan for quest's recall cache, and its bookkeeping, in place: `reference.recall_plan`'s
    algorithm as one program per (request, KV head). All tensors contiguous on one device; ids / k / the state's
    int tensors int64, `ref` int8 (see `reference.recall_plan` for the layouts)."""
    device = _run_device("ids", ids)
    _check_tensor("ids", ids, "[B, Hkv, K]", (None, None, None), (torch.int64,))
    batch, heads, width_k = ids.shape
    slots = state["slot_block"].shape[-1]
    width = out["src"].shape[-1]
    num_blocks = state["block_slot"].shape[-1]
    limit = int(state["limit"])
    _check(0 <= limit < num_blocks, f"limit must lie in [0, {num_blocks}), got {limit}")
    _check(slots >= width_k + width, f"need at least K + W = {width_k + width} slots, got {slots}")
    _check_real("share", share, 0.0, 1.0)
    shapes = {
        "k": (k, (1,)),
        "block_slot": (state["block_slot"], (batch, heads, num_blocks)),
        "slot_block": (state["slot_block"], (batch, heads, slots)),
        "last": (state["last"], (batch, heads, slots)),
        "hand": (state["hand"], (batch, heads)),
        "step": (state["step"], (batch, heads)),
        "counters": (state["counters"], (2,)),
        "cpu": (out["cpu"], (batch, heads, width_k)),
        "src": (out["src"], (batch, heads, width)),
        "dst": (out["dst"], (batch, heads, width)),
        "counts": (out["counts"], (batch, heads)),
        "gpu": (out["gpu"], (batch, heads, width_k + width)),
    }
    for name, (t, shape) in shapes.items():
        _check_tensor(name, t, str(list(shape)), shape, (torch.int64,))
    _check_tensor("ref", state["ref"], "[B, Hkv, S]", (batch, heads, slots), (torch.int8,))
    for name, t in [("ids", ids), ("ref", state["ref"])] + [(n, t) for n, (t, _) in shapes.items()]:
        _check_on(name, t, device)
        _check(t.is_contiguous(), f"{name} must be contiguous")
    if batch == 0 or heads == 0:
        return
    block_s = 1 << (
        min(slots, 1024).bit_length() - 1
    )  # a power of two <= S: a chunk never holds a slot twice
    with _guard(device):
        _kernels.recall_plan_kernel[(batch, heads)](
            ids, k, state["block_slot"], state["slot_block"], state["last"], state["ref"], state["hand"],
            state["step"], out["cpu"], out["src"], out["dst"], out["counts"], out["gpu"], state["counters"],
            float(share), width_k, width, slots, num_blocks, limit, heads, int(block_size),
            BLOCK_K=min(1024, triton.next_power_of_2(max(width_k, 1))), BLOCK_S=block_s,
            BLOCK_W=min(1024, triton.next_power_of_2(max(width, 1))), num_warps=4,
        )  # fmt: skip


def recall_blocks(
    src_keys, src_values, src_valid, keys, values, valid, src_ids, dst_ids, counts, block_size, slots,
    *, src_k_scale=None, src_v_scale=None,
):  # fmt: skip
    """Copy selected blocks of a host KV store into the slots of a device-resident block cache.

    src_keys, src_values : [B, Hkv, T, D] in pinned host memory (read zero-copy) or on the cache's device;
        src_valid [B, T] bool next to them. Or int8 / float8_e4m3fn codes with `src_k_scale`, `src_v_scale`
        ([B, Hkv, T // G] float32, as `host_block_attention` reads them): decoded to the cache's dtype on the way
    keys, values : [B, Hkv * slots * block_size, D] the cache on the device (slot s of head h holds rows
        [(h * slots + s) * block_size, ... + block_size)); valid [B, Hkv * slots * block_size] bool
    src_ids, dst_ids : [B, Hkv, W] int64 host block ids and target slots; counts [B, Hkv] int64: the first
        counts[b, h] entries are copied, the rest ignored. Rows of a block past T are marked not valid.
    """
    device = _run_device("keys", keys)
    src_dtypes = FLOAT_DTYPES + tuple(QUANT_CODES)
    _check_tensor("src_keys", src_keys, "[B, Hkv, T, D]", (None, None, None, None), src_dtypes)
    batch, num_kv_heads, num_rows, head_dim = src_keys.shape
    _check(1 <= head_dim <= MAX_HEAD_DIM, f"head_dim must lie in [1, {MAX_HEAD_DIM}], got {head_dim}")
    _check_tensor("src_values", src_values, "[B, Hkv, T, D]", tuple(src_keys.shape), (src_keys.dtype,))
    _check_tensor("src_valid", src_valid, "[B, T]", (batch, num_rows), (torch.bool,))
    if not (_positive_int(block_size) and _positive_int(slots)):
        raise ValueError(f"block_size and slots must be positive ints, got {block_size!r} / {slots!r}")
    cache_rows = num_kv_heads * slots * block_size
    layout = "[B, Hkv * slots * block_size, D]"
    quant = QUANT_CODES.get(src_keys.dtype, 0)
    cache_dtypes = FLOAT_DTYPES if quant else (src_keys.dtype,)
    _check_tensor("keys", keys, layout, (batch, cache_rows, head_dim), cache_dtypes)
    _check_tensor("values", values, layout, (batch, cache_rows, head_dim), (keys.dtype,))
    _check_tensor("valid", valid, "[B, Hkv * slots * block_size]", (batch, cache_rows), (torch.bool,))
    width = src_ids.shape[-1] if src_ids.dim() == 3 else None
    _check_tensor("src_ids", src_ids, "[B, Hkv, W]", (batch, num_kv_heads, None), (torch.int64,))
    _check_tensor("dst_ids", dst_ids, "[B, Hkv, W]", (batch, num_kv_heads, width), (torch.int64,))
    _check_tensor("counts", counts, "[B, Hkv]", (batch, num_kv_heads), (torch.int64,))
    for name, t in (("src_keys", src_keys), ("src_values", src_values), ("src_valid", src_valid)):
        _check_readable(name, t, device)
    _, scale_group = _kv_scales(src_keys, src_k_scale, src_v_scale, device, ("src_k_scale", "src_v_scale"))
    for name, t in (("values", values), ("valid", valid), ("src_ids", src_ids), ("dst_ids", dst_ids),
                    ("counts", counts)):  # fmt: skip
        _check_on(name, t, device)
    for name, t in (("src_keys", src_keys), ("src_values", src_values), ("keys", keys), ("values", values)):
        _check(
            t.stride(-1) == 1, f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
        )
    for name, t in (("src_ids", src_ids), ("dst_ids", dst_ids), ("src_valid", src_valid), ("valid", valid)):
        _check(
            t.stride(-1) == 1, f"{name} must be contiguous in its last dimension, got strides {t.stride()}"
        )
    if batch == 0 or width == 0:
        return
    block_d = _block_d(head_dim)
    block_r = min(triton.next_power_of_2(int(block_size)), max(1, 8192 // block_d))
    if not quant:  # placeholders, never read
        src_k_scale = src_v_scale = counts
    scale_strides = (*src_k_scale.stride()[:2], *src_v_scale.stride()[:2]) if quant else (0, 0, 0, 0)
    with _guard(device):
        _kernels.recall_blocks_kernel[(batch, num_kv_heads, width)](
            _as_codes(src_keys), _as_codes(src_values), src_valid.view(torch.uint8), keys, values,
            valid.view(torch.uint8), src_ids, dst_ids, counts, src_k_scale, src_v_scale,
            num_rows, int(slots), scale_group,
            *src_keys.stride()[:3], *src_values.stride()[:3], src_valid.stride(0),
            keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), valid.stride(0),
            *src_ids.stride()[:2], *dst_ids.stride()[:2], *counts.stride(), *scale_strides,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_SIZE=int(block_size), QUANT=quant,
            RNE_BF16=interpreted() and keys.dtype == torch.bfloat16, num_warps=4,
        )  # fmt: skip


def merge_lse_(out_a, lse_a, out_b, lse_b):
    """Exact LSE merge of two partial attentions over disjoint key sets, written in place into (out_a, lse_a).

    out_a, out_b : [..., D] float32 (out_a contiguous: it is overwritten); lse_a, lse_b : [...] float32
    (lse_a contiguous). Either side may be empty (lse -inf); both empty gives out 0, lse -inf.
    Returns (out_a, lse_a).
    """
    device = _run_device("out_a", out_a)
    _check(out_a.dim() >= 1, "out_a must have shape [..., D], got a 0-d tensor")
    lead = tuple(out_a.shape[:-1])
    layout = "[" + ", ".join(["..."] * bool(lead) + ["D"]) + "]"
    _check_tensor("out_a", out_a, layout, tuple(out_a.shape), (torch.float32,))
    _check_tensor("out_b", out_b, f"{layout} (out_a's shape)", tuple(out_a.shape), (torch.float32,))
    _check_tensor("lse_a", lse_a, "[...] (out_a's shape without D)", lead, (torch.float32,))
    _check_tensor("lse_b", lse_b, "[...] (out_a's shape without D)", lead, (torch.float32,))
    for name, t in (("out_b", out_b), ("lse_a", lse_a), ("lse_b", lse_b)):
        _check_on(name, t, device)
    for name, t in (("out_a", out_a), ("lse_a", lse_a)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the merge is written into it in place)")
    out_b, lse_b = out_b.contiguous(), lse_b.contiguous()
    num_rows, head_dim = lse_a.numel(), out_a.shape[-1]
    if num_rows == 0:
        return out_a, lse_a
    block_d = _block_d(head_dim)
    block_r = max(1, min(64, 4096 // block_d))
    with _guard(device):
        _kernels.merge_lse_kernel[(triton.cdiv(num_rows, block_r),)](
            out_a, lse_a, out_b, lse_b, num_rows, head_dim, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4
        )
    return out_a, lse_a
