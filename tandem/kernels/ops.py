"""Kernel launchers: validate inputs (naming the bad argument), then pick the implementation.

Orchestration code calls these, never a raw kernel. CPU work goes to the compiled kernels of
`tandem.kernels.cpu` when they are available, otherwise to the plain-torch `reference`. Every argument is
checked here, once, whichever implementation runs: the compiled bindings check only the layout they read in
place through raw pointers (rows of a store contiguous along head_dim, buffers of the prepared calls contiguous)
and report the ids their kernels refuse.
"""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from . import cpu as _native
from . import reference
from .scales import CODE_DTYPES, scale_rows

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def native_cpu_available() -> bool:
    """True when the compiled CPU kernels built and loaded (without a compiler the reference runs)."""
    return _native.is_available()


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_tensor(name: str, t, shape: tuple, layout: str, dtype: torch.dtype = torch.long) -> None:
    """`t` a tensor of `dtype` and of `shape` (a str entry: any size there), which the message calls `layout`."""
    _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(
        t.dim() == len(shape)
        and all(isinstance(want, str) or got == want for got, want in zip(t.shape, shape)),
        f"{name} must be {layout} = [{', '.join(map(str, shape))}], got {tuple(t.shape)}",
    )
    _check(t.dtype == dtype, f"{name} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")


def _check_devices(anchor: str, device: torch.device, **tensors) -> None:
    """Each tensor given (None: not given) on `device`, the device of the argument named `anchor`."""
    for name, t in tensors.items():
        if t is not None:
            _check(t.device == device, f"{name} is on {t.device} but {anchor} is on {device}")


def _check_threads(num_threads) -> None:
    _check(
        num_threads is None or (isinstance(num_threads, int) and num_threads >= 1),
        f"num_threads must be a positive int or None (the default), got {num_threads!r}",
    )


def _check_block_size(block_size, optional: bool = False) -> None:
    _check(
        (optional and block_size is None) or (isinstance(block_size, int) and block_size >= 1),
        f"block_size must be a positive int{' or None' if optional else ''}, got {block_size!r}",
    )


def _on_host(*tensors: torch.Tensor) -> bool:
    """Whether the compiled CPU kernels can run on these tensors (they read CPU memory through raw pointers)."""
    return native_cpu_available() and all(t.device.type == "cpu" for t in tensors)


def _check_scale(scale) -> None:
    """The softmax scale must be a finite Python number (NaN or inf would make every output NaN)."""
    _check(
        isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale),
        f"scale must be a finite number (usually head_dim ** -0.5), got {scale!r}",
    )


def _check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_name: str, v_name: str, quantized_ok: bool = False
) -> None:
    """q, k, v 4-D and consistent; with `quantized_ok`, k / v may also be 8-bit codes (int8, float8_e4m3fn)."""
    floats = (FLOAT_DTYPES, "float32, float16 or bfloat16")
    codes = (FLOAT_DTYPES + CODE_DTYPES, "float32, float16, bfloat16, int8 or float8_e4m3fn")
    kv = codes if quantized_ok else floats
    for name, t, (dtypes, allowed) in (("q", q, floats), (k_name, k, kv), (v_name, v, kv)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
        _check(t.dim() == 4, f"{name} must be 4-D [B, heads, tokens, head_dim], got shape {tuple(t.shape)}")
        _check(t.dtype in dtypes, f"{name}.dtype must be {allowed}, got {t.dtype}")
    _check(
        k.shape == v.shape,
        f"{k_name} and {v_name} must have the same shape: {tuple(k.shape)} vs {tuple(v.shape)}",
    )
    _check(
        k.dtype == v.dtype,
        f"{k_name} and {v_name} must have the same dtype, got {k_name}.dtype {k.dtype} and {v_name}.dtype {v.dtype}",
    )
    _check(q.shape[0] == k.shape[0], f"batch of q ({q.shape[0]}) and {k_name} ({k.shape[0]}) differ")
    _check(q.shape[3] == k.shape[3], f"head_dim of q ({q.shape[3]}) and {k_name} ({k.shape[3]}) differ")
    _check(
        k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
        f"q heads ({q.shape[1]}) must be a multiple of {k_name} heads ({k.shape[1]})",
    )
    _check(k.device == v.device, f"{k_name} is on {k.device} but {v_name} is on {v.device}")


def _check_kv_scales(k_store: torch.Tensor, k_scale, v_scale, names=("k_scale", "v_scale")) -> None:
    """The scales of an 8-bit store (`scales.scale_rows`), on the store's device."""
    if scale_rows(k_store, k_scale, v_scale, names):
        for name, t in zip(names, (k_scale, v_scale)):
            _check(
                t.device == k_store.device, f"{name} is on {t.device} but the store is on {k_store.device}"
            )


def _check_store_call(q, k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, ids) -> None:
    """The checks of a launcher over a host KV store: scale, q [B, Hq, Lq, D], the store (and an 8-bit one's
    scales), `ids`: (name, tensor, W) of int64 index tensors [B, Hkv, W] (any W) or, where W is None, [B, Hkv],
    key_mask [B, cap] bool or None, num_threads; every tensor on the store's device."""
    _check_scale(scale)
    _check_qkv(q, k_store, v_store, "k_store", "v_store", quantized_ok=True)
    _check_kv_scales(k_store, k_scale, v_scale)
    batch, num_kv_heads, cap = k_store.shape[:3]
    for name, t, width in ids:
        if width is None:
            _check_tensor(name, t, (batch, num_kv_heads), "[B, Hkv]")
        else:
            _check_tensor(name, t, (batch, num_kv_heads, width), f"[B, Hkv, {width}]")
    if key_mask is not None:
        _check_tensor("key_mask", key_mask, (batch, cap), "[B, cap]", torch.bool)
    _check_threads(num_threads)
    _check_devices("k_store", k_store.device, q=q, key_mask=key_mask, **{name: t for name, t, _ in ids})


def _check_outputs(q: torch.Tensor, out, lse) -> None:
    """out / lse of a prepared call: float32 of q's shape (lse without head_dim), on q's device."""
    _check_tensor("out", out, tuple(q.shape), "q's shape", torch.float32)
    _check_tensor("lse", lse, tuple(q.shape[:-1]), "q's shape without head_dim", torch.float32)
    _check_devices("q", q.device, out=out, lse=lse)


def attention_lse(q, k, v, scale: float, key_mask=None, return_weights: bool = False):
    """Dense attention with LSE on the tensors' device. See `reference.attention_lse`."""
    _check_scale(scale)
    _check_qkv(q, k, v, "k", "v")
    _check(q.device == k.device, f"q is on {q.device} but k is on {k.device}")
    if key_mask is not None:
        _check(key_mask.dtype == torch.bool, f"key_mask must be bool, got {key_mask.dtype}")
        _check(
            key_mask.shape in ((k.shape[0], k.shape[2]), (k.shape[0], q.shape[2], k.shape[2])),
            f"key_mask must be [B, T] or [B, Lq, T] = {(k.shape[0], k.shape[2])}, got {tuple(key_mask.shape)}",
        )
    if not return_weights and _cpu_flash_runs(q, k):
        return _cpu_flash_lse(q, k, v, scale, key_mask)
    return reference.attention_lse(q, k, v, scale, key_mask, return_weights)


def causal_attention_lse(q, k, v, scale: float):
    """(out, lse) float32 of query i over keys 0 .. i, every key a real token (q and k of one length: a prompt
    chunk's attention over its own tokens). On the CPU by torch's flash attention with its causal flag, which reads
    no mask (about half the time of the masked call); else the reference with a lower-triangular mask."""
    _check_scale(scale)
    _check_qkv(q, k, v, "k", "v")
    _check(q.device == k.device, f"q is on {q.device} but k is on {k.device}")
    _check(
        q.shape[2] == k.shape[2], f"q and k must hold one length of tokens, got {q.shape[2]} and {k.shape[2]}"
    )
    if _cpu_flash_runs(q, k):
        return _cpu_flash_lse(q, k, v, scale, None, causal=True)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return reference.attention_lse(q, k, v, scale, mask.expand(q.shape[0], -1, -1))


# many queries on the CPU (a prefill chunk over cached keys) go through torch's flash attention for the CPU, which
# gives the LSE too: on the 2-core CPU a 2K chunk over 2K keys took 0.04 s against the reference's 0.44 s; fewer
# queries (decode) keep the reference, tuned for them
CPU_FLASH_MIN_QUERIES = 16
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cpu_flash_runs(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (
        _CPU_FLASH is not None
        and q.device.type == "cpu"
        and k.device.type == "cpu"
        and q.shape[2] >= CPU_FLASH_MIN_QUERIES
        and k.shape[2] > 0
    )


def _cpu_flash_lse(q, k, v, scale: float, key_mask, causal: bool = False):
    """`reference.attention_lse` by torch's flash attention for the CPU: in float32 (as the reference), the key
    mask as an additive one, grouped-query heads in place; `causal`: query i over keys 0 .. i (no mask). That
    kernel gives a query with no key to attend out 0 and lse 0: here lse -inf, as the reference and every merge
    expect."""
    q, k, v = (t if t.dtype == torch.float32 else t.float() for t in (q, k, v))
    mask = empty = None
    if key_mask is not None:
        attend = key_mask[:, None, None, :] if key_mask.dim() == 2 else key_mask[:, None]
        mask = torch.zeros(attend.shape, dtype=torch.float32).masked_fill_(~attend, float("-inf"))
        empty = ~key_mask.any(dim=-1)  # [B] or [B, Lq]
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if empty is not None and bool(empty.any()):
        rows = (empty[:, None, None] if empty.dim() == 1 else empty[:, None, :]).expand(lse.shape)
        lse = lse.masked_fill(rows, float("-inf"))
        out = out.masked_fill(rows[..., None], 0.0)
    return out, lse


def fused_attention_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_attention_lse` may run on tensors of `device` and `dtype`: CUDA, 16-bit, a torch with cuDNN's
    fused attention and cuDNN on (it may still decline a layout; it then returns None)."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
        and torch.backends.cudnn.enabled
        and (dtype, device) not in _FUSED_REFUSED
    )


def fused_attention_lse(q, k, v, scale: float):
    """(out [B, Hq, Lq, D] in q's dtype, lse [B, Hq, Lq] float32) of every query over every key, no mask, by cuDNN's
    fused attention (`aten._scaled_dot_product_cudnn_attention`, grouped-query heads read in place); None where it
    cannot run (`fused_attention_runs`) or this build's cuDNN refuses the layout (remembered for the dtype and
    device: the caller's own kernel runs instead). Reference: `attention_lse` without a mask.

    On an H200 it ran at 560-680 TFLOP/s over 4K-16K keys, 2.2x Tandem's Triton `gpu.prefill_attention`, but
    cuDNN plans every new shape or stride layout before it first runs it (40-60 ms each): callers keep their
    shapes to a few (`attention.hybrid.FUSED_PIECES`)."""
    _check_scale(scale)
    _check_qkv(q, k, v, "k", "v")
    _check(
        q.device == k.device == v.device,
        f"q, k and v must share a device, got {q.device}, {k.device}, {v.device}",
    )
    if not fused_attention_runs(q.device, q.dtype) or q.shape[2] == 0 or k.shape[2] == 0:
        return None
    try:
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, False, False, scale=scale
        )
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):  # this build refuses it (head dim, heads, GPU; another signature)
        _FUSED_REFUSED.add((q.dtype, q.device))
        return None
    _FUSED_RAN.add((q.dtype, q.device))
    return result[0], result[1].reshape(q.shape[:3])


def fused_attention_ran(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_attention_lse` has run in this process on `device` and `dtype`: its first call there loads
    and builds cuDNN's engine (0.8 s on an H200), which a caller may not want to pay for a small gain."""
    return (dtype, device) in _FUSED_RAN


_FUSED_REFUSED: set = set()  # (dtype, device) that `fused_attention_lse` was refused on
_FUSED_RAN: set = set()  # (dtype, device) where it has run


def merge_lse(out_a, lse_a, out_b, lse_b):
    """Exact LSE merge of two partial attentions. See `reference.merge_lse`."""
    _check(out_a.shape == out_b.shape, f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} differ")
    _check(
        lse_a.shape == lse_b.shape == out_a.shape[:-1], "lse_a / lse_b must be out's shape without head_dim"
    )
    return reference.merge_lse(out_a, lse_a, out_b, lse_b)


def sparse_attention_lse(
    q, k_store, v_store, indices, lengths, scale: float, key_mask=None, block_size=None, num_threads=None,
    k_scale=None, v_scale=None,
):  # fmt: skip
    """Attention over selected rows (or blocks) of a host KV store. See `reference.sparse_attention_lse`;
    an 8-bit store (int8 / float8_e4m3fn codes) needs k_scale / v_scale [B, Hkv, S] float32."""
    ids = (("indices", indices, "S"), ("lengths", lengths, None))
    _check_store_call(q, k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, ids)
    _check_block_size(block_size, optional=True)
    if lengths.numel():
        low, high = (int(x) for x in torch.aminmax(lengths))
        _check(
            low >= 0 and high <= indices.shape[2],
            f"lengths must lie in [0, {indices.shape[2]}] (the width of indices), got [{low}, {high}]",
        )
    native = _on_host(k_store)
    rows = k_store.shape[2] // (block_size or 1)
    if indices.numel() and not native:  # the compiled kernel checks the ids it reads and names them itself
        low, high = (int(x) for x in torch.aminmax(indices))
        _check(
            low >= 0 and high < rows,
            f"indices must lie in [0, {rows}) ({'blocks' if block_size else 'rows'} of k_store), got [{low}, {high}]",
        )
    if native:
        return _native.sparse_attention_lse(
            q, k_store, v_store, indices, lengths, scale, key_mask, block_size, num_threads, k_scale, v_scale
        )
    return reference.sparse_attention_lse(
        q, k_store, v_store, indices, lengths, scale, key_mask, block_size, k_scale, v_scale
    )


def _check_ranks(ranked: torch.Tensor, skip, count) -> None:
    _check(
        isinstance(skip, int) and isinstance(count, int) and 0 <= skip <= count <= ranked.shape[2],
        f"skip / count must satisfy 0 <= skip <= count <= {ranked.shape[2]} (ranked's width), got {skip!r} / {count!r}",
    )


def ranked_block_attention(
    q, k_store, v_store, ranked, skip: int, count: int, scale: float, block_size: int, key_mask=None,
    num_threads=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """Attention over ranks [skip, count) of best-first block ids: (out, lse, lengths).
    See `reference.ranked_block_attention`; k_scale / v_scale as `sparse_attention_lse`."""
    ids = (("ranked", ranked, "W"),)
    _check_store_call(q, k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, ids)
    _check_ranks(ranked, skip, count)
    _check_block_size(block_size)
    if _on_host(k_store):
        return _native.ranked_block_attention(
            q, k_store, v_store, ranked, skip, count, scale, block_size, key_mask, num_threads, k_scale, v_scale,
        )  # fmt: skip
    return reference.ranked_block_attention(
        q, k_store, v_store, ranked, skip, count, scale, block_size, key_mask, k_scale, v_scale
    )


def ranked_attention_call(q, k_store, v_store, ranked, scale: float, block_size: int, out, lse, key_mask=None,
                          num_threads=None, k_scale=None, v_scale=None):  # fmt: skip
    """`ranked_block_attention` prepared for fixed buffers (`cpu.RankedAttention`: out / lse written in place,
    a call costs microseconds), or None where the compiled kernels are unavailable. q: [B, Hq, D] or
    [B, Hq, Lq, D]; out / lse float32 of q's shape (lse without head_dim); all on the CPU."""
    _check(isinstance(q, torch.Tensor), f"q must be a torch.Tensor, got {type(q).__name__}")
    ids = (("ranked", ranked, "W"),)
    q4 = q[:, :, None] if q.dim() == 3 else q
    _check_store_call(q4, k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, ids)
    _check_block_size(block_size)
    _check_outputs(q, out, lse)
    if not native_cpu_available():
        return None
    _check_in_host_memory(k_store)
    return _native.RankedAttention(
        q, k_store, v_store, ranked, scale, block_size, out, lse, key_mask, num_threads, k_scale, v_scale
    )


def prepared_attention_call(q, k_store, v_store, indices, lengths, scale: float, out, lse, key_mask=None,
                            block_size=None, num_threads=None, k_scale=None, v_scale=None):  # fmt: skip
    """`sparse_attention_lse` prepared for fixed buffers (`cpu.PreparedAttention`: out / lse written in place, a
    call costs microseconds), or None where the compiled kernels are unavailable or the index lists are not laid
    out as it needs (then the general launcher runs). q: [B, Hq, D]; out / lse float32 of q's shape (lse
    without head_dim); all on the CPU. The ids and lengths are read at each call, so the kernel checks them."""
    _check(isinstance(q, torch.Tensor), f"q must be a torch.Tensor, got {type(q).__name__}")
    _check(q.dim() == 3, f"q must be [B, Hq, D] (one decode query per request), got {tuple(q.shape)}")
    ids = (("indices", indices, "S"), ("lengths", lengths, None))
    _check_store_call(q[:, :, None], k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, ids)
    _check_block_size(block_size, optional=True)
    _check_outputs(q, out, lse)
    if not native_cpu_available():
        return None
    _check_in_host_memory(k_store)
    try:  # refuses only a layout it cannot read in place: strides of the store or the lists, buffers not contiguous
        return _native.PreparedAttention(
            q, k_store, v_store, indices, lengths, scale, out, lse, key_mask, block_size, num_threads,
            k_scale, v_scale,
        )  # fmt: skip
    except ValueError:
        return None


def _check_stores_call(q, stores, scale: float, num_threads, ids) -> None:
    """The checks of a call over requests that each keep their own store: q [B, Hq, D], B stores (k_store,
    v_store, key_mask, k_scale, v_scale) of one dtype, Hkv and D, each checked as a one-request store call with its
    row of the index tensors `ids` ((name, tensor, W) as `_check_store_call` takes them), and one rows-per-scale for
    the 8-bit stores."""
    _check(isinstance(q, torch.Tensor), f"q must be a torch.Tensor, got {type(q).__name__}")
    _check(q.dim() == 3, f"q must be [B, Hq, D] (one decode query per request), got {tuple(q.shape)}")
    _check(
        isinstance(stores, (list, tuple)) and len(stores) == q.shape[0],
        f"stores must hold one store per request of q ({q.shape[0]}), got {type(stores).__name__}"
        + (f" of {len(stores)}" if isinstance(stores, (list, tuple)) else ""),
    )
    first = stores[0][0]
    for b, store in enumerate(stores):
        _check_request_store(q, b, store, first, scale, num_threads, ids, f"stores[{b}]", "stores[0]")
    _check(
        len({scale_rows(store[0], store[3], store[4]) for store in stores if store[3] is not None}) <= 1,
        "stores' 8-bit scales must cover the same rows per scale",
    )


def _check_request_store(
    q, b: int, store, first, scale: float, num_threads, ids, name: str, like: str
) -> None:
    """Request b's store of a call over several (`_check_stores_call`, `ranked_rows_set_store`): (k_store,
    v_store, key_mask, k_scale, v_scale) with k_store one request's [1, Hkv, cap, D] of `first`'s dtype, Hkv and
    D, checked as a one-request store call with row b of q and of the index tensors `ids`. Errors call it `name`
    and `first` `like`."""
    _check(
        isinstance(store, (list, tuple)) and len(store) == 5,
        f"{name} must be (k_store, v_store, key_mask, k_scale, v_scale)",
    )
    k_store, v_store, key_mask, k_scale, v_scale = store
    _check(
        isinstance(k_store, torch.Tensor) and k_store.dim() == 4 and k_store.shape[0] == 1,
        f"{name}'s k_store must be one request's store [1, Hkv, cap, D]",
    )
    _check(
        k_store.dtype == first.dtype
        and k_store.shape[1] == first.shape[1]
        and k_store.shape[3] == first.shape[3],
        f"{name} must match {like}'s dtype, Hkv and D ({first.dtype}, {first.shape[1]}, {first.shape[3]}), got "
        f"{k_store.dtype}, {k_store.shape[1]}, {k_store.shape[3]}",
    )
    row = tuple((name_, t[b : b + 1], width) for name_, t, width in ids)
    _check_store_call(
        q[b : b + 1, :, None], k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, row
    )


def stores_attention_call(
    q, stores, indices, lengths, scale: float, out, lse, block_size=None, num_threads=None
):
    """Attention of B requests that each keep their own host store, prepared for fixed buffers as one call
    (`cpu.StoresAttention`), or None where the compiled kernels are unavailable. q: [B, Hq, D]; stores: B tuples
    (k_store, v_store, key_mask, k_scale, v_scale), request b's store [1, Hkv, cap_b, D] with its mask [1, cap_b]
    or None and an 8-bit store's scales; indices [B, Hkv, W] int64 / lengths [B, Hkv] int64: request b's lists name
    its own store's blocks (or rows); out / lse float32 of q's shape (lse without head_dim). See
    `reference.stores_attention_lse`."""
    _check_stores_call(q, stores, scale, num_threads, (("indices", indices, "S"), ("lengths", lengths, None)))
    _check_block_size(block_size, optional=True)
    _check_outputs(q, out, lse)
    if not native_cpu_available():
        return None
    _check_in_host_memory(stores[0][0])
    return _native.StoresAttention(q, stores, indices, lengths, scale, out, lse, block_size, num_threads)


def ranked_rows_call(q, stores, ranked, scale: float, block_size: int, out, lse, num_threads=None):
    """Quest's ranked attention for B requests that each keep their own host store and ranking, prepared for fixed
    buffers as one call (`cpu.RankedRowsAttention`: fill its `skips` / `counts`, then call), or None where the
    compiled kernels are unavailable. q: [B, Hq, D]; stores as `stores_attention_call`; ranked [B, Hkv, W] int64,
    request b's ids naming blocks of its own store (invalid ids, < 0 or past the store, skipped). See
    `reference.ranked_rows_attention_lse`."""
    _check_stores_call(q, stores, scale, num_threads, (("ranked", ranked, "W"),))
    _check_block_size(block_size, optional=False)
    _check_outputs(q, out, lse)
    if not native_cpu_available():
        return None
    _check_in_host_memory(stores[0][0])
    return _native.RankedRowsAttention(q, stores, ranked, scale, block_size, out, lse, num_threads)


def ranked_rows_set_store(call, b: int, store) -> None:
    """Point request b of a prepared `ranked_rows_call` at another host store (k_store, v_store, key_mask, k_scale,
    v_scale), checked as the call's own stores are: of their dtype, Hkv and D, with their rows per scale. The
    requests of a recorded step then change without a new call over all of them."""
    q, stores, _, _ = call.tensors
    _check(
        isinstance(b, int) and 0 <= b < call.batch,
        f"b must be a request of the call, in [0, {call.batch}), got {b}",
    )
    _check_request_store(
        q, b, store, stores[0][0], 1.0, call.threads, (("ranked", call.ranked, "W"),), "store", "the call"
    )
    k_store, _, _, k_scale, v_scale = store
    rows = scale_rows(k_store, k_scale, v_scale)
    _check(
        k_scale is None or rows == call.scale_rows,
        f"the store's 8-bit scales must cover {call.scale_rows} rows each, as the call's do, got {rows}",
    )
    _check_in_host_memory(k_store)
    call.set_store(b, store)


def _check_in_host_memory(k_store: torch.Tensor) -> None:
    # the prepared calls run only the compiled CPU kernels; every other tensor is on the store's device (checked)
    _check(
        k_store.device.type == "cpu",
        f"k_store must be on the CPU for a prepared call (the compiled kernels read it), got {k_store.device}",
    )


def _check_digests(q, key_min, key_max, num_threads) -> None:
    """Quest's digests key_min / key_max [B, Hkv, nblk, D] (float, one dtype) for q [B, Hq, Lq, D]."""
    for name, t in (("key_min", key_min), ("key_max", key_max), ("q", q)):
        _check(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(key_min.dim() == 4, f"key_min must be [B, Hkv, nblk, D], got {tuple(key_min.shape)}")
    _check(
        key_max.shape == key_min.shape,
        f"key_max must have key_min's shape {tuple(key_min.shape)}, got {tuple(key_max.shape)}",
    )
    _check(
        key_min.dtype in FLOAT_DTYPES,
        f"key_min.dtype must be float32, float16 or bfloat16 (digests are never 8-bit codes), got {key_min.dtype}",
    )
    _check(
        key_max.dtype == key_min.dtype,
        f"key_min and key_max must have the same dtype, got {key_min.dtype} and {key_max.dtype}",
    )
    _check(q.dim() == 4, f"q must be 4-D [B, Hq, Lq, D], got shape {tuple(q.shape)}")
    _check(q.dtype in FLOAT_DTYPES, f"q.dtype must be float32, float16 or bfloat16, got {q.dtype}")
    _check(
        q.shape[0] == key_min.shape[0], f"batch of q ({q.shape[0]}) and key_min ({key_min.shape[0]}) differ"
    )
    _check(
        q.shape[3] == key_min.shape[3],
        f"head_dim of q ({q.shape[3]}) and key_min ({key_min.shape[3]}) differ",
    )
    _check(
        key_min.shape[1] > 0 and q.shape[1] % key_min.shape[1] == 0,
        f"q heads ({q.shape[1]}) must be a multiple of key_min heads ({key_min.shape[1]})",
    )
    _check_threads(num_threads)
    _check_devices("key_min", key_min.device, key_max=key_max, q=q)


def _check_k(k) -> None:
    _check(isinstance(k, int) and k >= 0, f"k must be an int >= 0, got {k!r}")


def block_scores(q, key_min, key_max, num_threads=None):
    """Quest block upper bounds [B, Hkv, nblk]. See `reference.block_scores`."""
    _check_digests(q, key_min, key_max, num_threads)
    if _on_host(key_min):
        return _native.block_scores(q, key_min, key_max, num_threads=num_threads)
    return reference.block_scores(q, key_min, key_max)


def score_topk(q, key_min, key_max, k: int, factor: int = 1, num_threads=None):
    """Fused Quest scoring + top-k at logical blocks of `factor` physical ones: (ids [B, Hkv, min(k, nlogical)]
    int64 ascending, unselectable picks last; lengths [B, Hkv] int64). See `cpu.score_topk`."""
    _check_digests(q, key_min, key_max, num_threads)
    _check_k(k)
    _check(
        isinstance(factor, int) and factor >= 1,
        f"factor must be a positive int (logical / physical block size), got {factor!r}",
    )
    if _on_host(key_min):
        return _native.score_topk(q, key_min, key_max, k, factor, num_threads=num_threads)
    return reference.topk_blocks(
        reference.block_scores(q, *reference.coarsen_digest(key_min, key_max, factor)), k
    )


def topk_blocks(scores, k: int, num_threads=None):
    """Top-k block ids per (request, KV head), ascending. See `reference.topk_blocks`."""
    _check_k(k)
    _check(isinstance(scores, torch.Tensor), f"scores must be a torch.Tensor, got {type(scores).__name__}")
    _check(scores.dim() == 3, f"scores must be [B, Hkv, nblk], got shape {tuple(scores.shape)}")
    _check(scores.dtype in FLOAT_DTYPES, f"scores must be float32, float16 or bfloat16, got {scores.dtype}")
    _check_threads(num_threads)
    if _on_host(scores):
        return _native.topk_blocks(scores, k, num_threads=num_threads)
    return reference.topk_blocks(scores, k)


def threshold_select(maw, threshold, num_kv_heads: int, num_rows: int, num_threads=None):
    """HGCA salient rows per KV head. See `reference.threshold_select`."""
    _check(isinstance(maw, torch.Tensor), f"maw must be a torch.Tensor, got {type(maw).__name__}")
    _check(maw.dim() == 3, f"maw must be [B, Hq, N], got {tuple(maw.shape)}")
    _check(maw.dtype in FLOAT_DTYPES, f"maw must be float32, float16 or bfloat16, got {maw.dtype}")
    _check(
        isinstance(num_kv_heads, int) and num_kv_heads >= 1,
        f"num_kv_heads must be a positive int, got {num_kv_heads!r}",
    )
    _check(
        maw.shape[1] % num_kv_heads == 0,
        f"maw heads ({maw.shape[1]}) must be a multiple of num_kv_heads={num_kv_heads}",
    )
    _check(
        isinstance(num_rows, int) and 0 <= num_rows <= maw.shape[2],
        f"num_rows must be an int in [0, {maw.shape[2]}] (rows of maw), got {num_rows!r}",
    )
    batch, num_q_heads = maw.shape[:2]
    if isinstance(threshold, torch.Tensor):
        _check(
            tuple(threshold.shape) in ((), (batch, num_q_heads), (batch, num_q_heads, 1)),
            f"threshold must be a number or a tensor of shape [], [B, Hq] or [B, Hq, 1] with [B, Hq] = "
            f"[{batch}, {num_q_heads}], got {tuple(threshold.shape)}",
        )
        _check_devices("maw", maw.device, threshold=threshold)
    else:
        _check(
            isinstance(threshold, numbers.Real) and not isinstance(threshold, bool),
            f"threshold must be a number or a tensor of shape [], [B, Hq] or [B, Hq, 1], got {threshold!r}",
        )
    _check_threads(num_threads)
    if _on_host(maw):
        return _native.threshold_select(maw, threshold, num_kv_heads, num_rows, num_threads=num_threads)
    return reference.threshold_select(maw, threshold, num_kv_heads, num_rows)


# ---- GPU side: Triton kernels on CUDA, the torch reference elsewhere ----------------------------------------
def _triton_on(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from . import gpu

    return gpu.triton_available(device)


def hot_attention(q, keys, values, valid, scale: float, maw=None, alpha: float = 0.0):
    """Decode attention over the hot tier: q [B, Hq, D], keys/values [B, Hkv, S, D], valid [B, S] bool.

    Returns (out [B, Hq, D] float32, lse [B, Hq] float32). With `maw` ([B, Hq, S] float32) the moving
    average of attention weights is updated in place: maw = (1 - alpha) * maw + alpha * weights.
    """
    _check_scale(scale)
    _check(q.dim() == 3, f"q must be [B, Hq, D] (one decode query per request), got {tuple(q.shape)}")
    _check_qkv(q[:, :, None], keys, values, "keys", "values")
    _check(
        valid.dtype == torch.bool and tuple(valid.shape) == (keys.shape[0], keys.shape[2]),
        f"valid must be bool [B, S] = {(keys.shape[0], keys.shape[2])}, got {valid.dtype} {tuple(valid.shape)}",
    )
    if _triton_on(q.device):
        from . import gpu

        return gpu.hot_decode_attention(q, keys, values, valid, scale, maw=maw, alpha=alpha)
    return reference.hot_decode_attention(q, keys, values, valid, scale, maw=maw, alpha=alpha)


# the certified selection's Triton kernels that failed to build or launch on this machine -> the error; the torch
# versions then stand in for the life of the process (a default policy must not fail on a compiler's gap)
_CERTIFY_FALLBACK: dict[str, str] = {}


def _certify_kernel(name: str, launch):
    """launch() through the Triton kernel `name`, or None where it failed once here: input errors (ValueError)
    propagate; any other error is reported once and the caller's torch version stands in from then on. Builds
    happen on a kernel's first call, in the engine's eager warm-up steps, never inside a graph's capture."""
    if name in _CERTIFY_FALLBACK:
        return None
    try:
        return launch()
    except ValueError:
        raise
    except Exception as err:  # a Triton build or launch failure on this GPU / driver
        _CERTIFY_FALLBACK[name] = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"the Triton kernel {name} failed ({_CERTIFY_FALLBACK[name][:300]}); the certified selection uses "
            "its torch version from now on",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def certify_sketch_bounds(q, codes, row_scale, error, row_valid, scale: float):
    """The key sketch's logit bounds (`policies.certify.sketch_logit_bounds`) through the Triton kernel on CUDA,
    which reads the int8 codes where the torch version makes an fp32 copy of them all; None elsewhere (the caller
    then runs the torch version)."""
    if not _triton_on(q.device) or codes.dtype != torch.int8 or codes.stride(-1) != 1:
        return None
    from . import gpu

    return _certify_kernel(
        "sketch_bounds", lambda: gpu.sketch_bounds(q, codes, row_scale, error, row_valid, scale)
    )


def certify_histogram(mass, lower, free, top):
    """The certified selection's histogram (`reference.certify_histogram`): the Triton kernel on CUDA, where a
    scatter into 192 bins serialises on the last one; the reference elsewhere."""
    floats = mass.dtype == torch.float32 and (lower is None or lower.dtype == torch.float32)
    if floats and _triton_on(mass.device):
        from . import gpu

        done = _certify_kernel("certify_histogram", lambda: gpu.certify_histogram(mass, lower, free, top))
        if done is not None:
            return done
    return reference.certify_histogram(mass, lower, free, top)


def merge_lse_(out_a, lse_a, out_b, lse_b):
    """In-place exact LSE merge of (out_b, lse_b) into (out_a, lse_a); float32. Returns (out_a, lse_a)."""
    _check(out_a.shape == out_b.shape, f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} differ")
    _check(
        lse_a.shape == lse_b.shape == out_a.shape[:-1], "lse_a / lse_b must be out's shape without head_dim"
    )
    if _triton_on(out_a.device):
        from . import gpu

        return gpu.merge_lse_(out_a, lse_a, out_b, lse_b)
    if not out_a.is_cuda and native_cpu_available():
        return _native.merge_lse_(out_a, lse_a, out_b, lse_b)
    out, lse = reference.merge_lse(out_a, lse_a, out_b, lse_b)
    out_a.copy_(out)
    lse_a.copy_(lse)
    return out_a, lse_a


def top_blocks_available(scores) -> bool:
    """Whether Quest should select with `top_blocks`: on CPU tensors, or with Triton on the scores' CUDA device
    (then a captured graph may hold it: `k` is read on the device; faster than torch.topk at every row length
    measured, see `gpu.selection.REGISTER_TOP_BLOCKS`)."""
    return not scores.is_cuda or _triton_on(scores.device)


def top_blocks(scores, k, width: int):
    """The k best-scoring blocks of each row as a set: scores [..., NB] float32, k on their device, [1] int64 (every
    row) or [scores.shape[0]] (request b keeps k[b]) -> [..., width] int64 (ids ascending, then NB). See
    `reference.top_blocks`."""
    _check(scores.dtype == torch.float32, f"scores must be float32, got {scores.dtype}")
    if _triton_on(scores.device):
        from . import gpu

        return gpu.top_blocks(scores, k, width)
    counts = [int(c) for c in k.reshape(-1).tolist()] if torch.is_tensor(k) else [int(k)]
    _check(
        len(counts) in (1, scores.shape[0]) and scores.dim() >= 1,
        f"k must hold one count or one per request ({scores.shape[0]}), got {len(counts)}",
    )
    _check(
        isinstance(width, int) and all(0 <= c <= width for c in counts),
        f"k must lie in [0, width={width}], got {counts}",
    )
    if len(counts) == 1:
        return reference.top_blocks(scores, counts[0], width)
    return torch.cat([reference.top_blocks(scores[b : b + 1], c, width) for b, c in enumerate(counts)])


def host_block_attention(
    q, keys, values, block_ids, lengths, block_size: int, valid, scale: float, k_scale=None, v_scale=None
):
    """Attention of one query per request on q's device over selected blocks of a host KV store: q [B, Hq, D];
    keys / values [B, Hkv, T, D] (pinned host memory, read in place by a CUDA q; any CPU tensor otherwise);
    block_ids [B, Hkv, S] and lengths [B, Hkv] on q's device; valid [B, T] bool next to the keys. An 8-bit
    store (int8 / float8_e4m3fn codes) comes with k_scale / v_scale [B, Hkv, T // G] float32 next to it.
    Returns (out [B, Hq, D] float32, lse [B, Hq] float32) on q's device."""
    _check_scale(scale)
    _check(q.dim() == 3, f"q must be [B, Hq, D] (one decode query per request), got {tuple(q.shape)}")
    if _triton_on(q.device):
        from . import gpu

        return gpu.host_block_attention(
            q, keys, values, block_ids, lengths, block_size, valid, scale, k_scale=k_scale, v_scale=v_scale
        )
    _check_qkv(q[:, :, None], keys, values, "keys", "values", quantized_ok=True)
    _check_kv_scales(keys, k_scale, v_scale)
    return reference.host_block_attention(
        q, keys, values, block_ids, lengths, block_size, valid, scale, k_scale, v_scale
    )


def recall_plan(ids, k, share: float, state: dict, out: dict, block_size: int) -> None:
    """One step's plan for quest's recall cache (`tandem.cache.recall`), in place: Triton's `gpu.recall_plan` on
    CUDA (one program per request and KV head, no host reads), `reference.recall_plan` (loops) otherwise."""
    if _triton_on(ids.device):
        from . import gpu

        return gpu.recall_plan(ids, k, share, state, out, block_size)
    return reference.recall_plan(ids, k, share, state, out, block_size)


def recall_blocks(src_keys, src_values, src_valid, keys, values, valid, src_ids, dst_ids, counts, block_size,
                  slots, src_k_scale=None, src_v_scale=None):  # fmt: skip
    """Copy host blocks into a device block cache (`tandem.cache.recall`): Triton's `gpu.recall_blocks` on CUDA
    (reading pinned host memory in place), `reference.recall_blocks` otherwise. An 8-bit source comes with
    src_k_scale / src_v_scale [B, Hkv, T // G] float32 and is decoded to the cache's dtype."""
    args = (src_keys, src_values, src_valid, keys, values, valid, src_ids, dst_ids, counts, block_size, slots)
    if _triton_on(keys.device):
        from . import gpu

        return gpu.recall_blocks(*args, src_k_scale=src_k_scale, src_v_scale=src_v_scale)
    _check_kv_scales(src_keys, src_k_scale, src_v_scale, ("src_k_scale", "src_v_scale"))
    return reference.recall_blocks(*args, src_k_scale, src_v_scale)


def recall_blocks_rows(stores, keys, values, valid, src_ids, dst_ids, counts, block_size, slots, table=None):
    """`recall_blocks` where cache row b copies from its own host store: stores[b] = (keys [1, Hkv, T_b, D],
    values, valid [1, T_b]), or None (the row copies nothing). With Triton on the cache's device one launch for all
    rows, reading the stores through `table` ([B, 5] int64 on that device, `gpu.store_table` of the stores,
    relative to the first store given; the caller keeps it where a recorded graph reads it); otherwise the
    reference, row by row (table unused)."""
    if _triton_on(keys.device):
        from . import gpu

        _check(table is not None, "recall_blocks_rows on a Triton device needs the stores' table")
        return gpu.recall_blocks_table(
            stores, table, keys, values, valid, src_ids, dst_ids, counts, block_size, slots
        )
    for b, store in enumerate(stores):
        if store is None:
            continue
        r = slice(b, b + 1)
        reference.recall_blocks(
            *store, keys[r], values[r], valid[r], src_ids[r], dst_ids[r], counts[r], block_size, slots
        )


def block_scores_matmul(q, key_min, key_max, block_valid):
    """Quest bounds of one decode query per request on the digests' device: q [B, Hq, D], key_min / key_max
    [B, Hkv, nblk, D] finite, block_valid [B, nblk] bool -> [B, Hkv, nblk] float32. See
    `reference.block_scores_matmul` (Triton's `gpu.block_scores` on CUDA)."""
    _check(q.dim() == 3, f"q must be [B, Hq, D], got {tuple(q.shape)}")
    _check(
        key_min.dim() == 4 and key_max.shape == key_min.shape,
        f"key_min / key_max must be [B, Hkv, nblk, D] of one shape, got {tuple(key_min.shape)} / {tuple(key_max.shape)}",
    )
    _check(
        q.shape[0] == key_min.shape[0]
        and q.shape[2] == key_min.shape[3]
        and q.shape[1] % key_min.shape[1] == 0,
        f"q {tuple(q.shape)} does not match key_min {tuple(key_min.shape)} (batch, head_dim, GQA group)",
    )
    _check(
        block_valid.dtype == torch.bool and tuple(block_valid.shape) == (key_min.shape[0], key_min.shape[2]),
        f"block_valid must be bool [B, nblk] = {(key_min.shape[0], key_min.shape[2])}, got {tuple(block_valid.shape)}",
    )
    if _triton_on(q.device):
        from . import gpu

        return gpu.block_scores(q, key_min, key_max, block_valid)
    return reference.block_scores_matmul(q, key_min, key_max, block_valid)


def queue_attention_call(q, k_store, v_store, ids, scale: float, block_size: int, out, lse, key_mask, control,
                         capacity: int, pieces_max: int, piece_blocks: int, num_threads=None, k_scale=None,
                         v_scale=None):  # fmt: skip
    """The CPU's side of a step's task queue prepared for fixed buffers (`cpu.QueueAttention`), or None where the
    compiled kernels are unavailable. q: [B, Hq, D]; ids [B, Hkv, K] int64; out / lse float32 of q's shape (lse
    without head_dim); control the plan's int32 buffer; all on the CPU."""
    _check(isinstance(q, torch.Tensor), f"q must be a torch.Tensor, got {type(q).__name__}")
    _check(q.dim() == 3, f"q must be [B, Hq, D] (one decode query per request), got {tuple(q.shape)}")
    _check_store_call(
        q[:, :, None], k_store, v_store, scale, key_mask, num_threads, k_scale, v_scale, (("ids", ids, "K"),)
    )
    _check_block_size(block_size)
    _check_outputs(q, out, lse)
    if not native_cpu_available():
        return None
    _check_in_host_memory(k_store)
    return _native.QueueAttention(
        q, k_store, v_store, ids, scale, block_size, out, lse, key_mask, control, capacity, pieces_max,
        piece_blocks, num_threads, k_scale, v_scale,
    )  # fmt: skip


def queue_gpu_attention(q, keys, values, valid, ids, plan, control, cursor, part_out, part_lse, first, count,
                        out, lse, limit, pieces_max, piece_blocks, block_size, scale, programs=None):  # fmt: skip
    """The GPU's side of a step's task queue (`gpu.queue_attention`); CUDA with Triton only."""
    from . import gpu

    _check(_triton_on(q.device), f"the task queue's GPU side needs Triton on CUDA, got q on {q.device}")
    return gpu.queue_attention(
        q, keys, values, valid, ids, plan, control, cursor, part_out, part_lse, first, count, out, lse,
        limit, pieces_max, piece_blocks, block_size, scale, programs,
    )  # fmt: skip
