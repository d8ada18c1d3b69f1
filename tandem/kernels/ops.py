"""Kernel launchers: validate inputs (naming the bad argument), then pick the implementation.

Orchestration code calls these, never a raw kernel. CPU work goes to the compiled kernels of
`tandem.kernels.cpu` when they are available, otherwise to the plain-torch `reference`.
"""

from __future__ import annotations

import math
import numbers

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
    return reference.attention_lse(q, k, v, scale, key_mask, return_weights)


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
    _check_scale(scale)
    _check_qkv(q, k_store, v_store, "k_store", "v_store", quantized_ok=True)
    _check_kv_scales(k_store, k_scale, v_scale)
    batch, num_kv_heads = k_store.shape[:2]
    _check(
        indices.dim() == 3 and tuple(indices.shape[:2]) == (batch, num_kv_heads),
        f"indices must be [B, Hkv, S] = [{batch}, {num_kv_heads}, S], got {tuple(indices.shape)}",
    )
    _check(indices.dtype == torch.long, f"indices must be int64, got {indices.dtype}")
    _check(
        tuple(lengths.shape) == (batch, num_kv_heads), f"lengths must be [B, Hkv], got {tuple(lengths.shape)}"
    )
    _check(lengths.dtype == torch.long, f"lengths must be int64, got {lengths.dtype}")
    if key_mask is not None:
        _check(
            tuple(key_mask.shape) == (batch, k_store.shape[2]) and key_mask.dtype == torch.bool,
            f"key_mask must be bool [B, cap] = {(batch, k_store.shape[2])}, got {tuple(key_mask.shape)}",
        )
    if block_size is not None:
        _check(block_size >= 1, f"block_size must be >= 1, got {block_size}")
    if lengths.numel():
        low, high = (int(x) for x in torch.aminmax(lengths))
        _check(
            low >= 0 and high <= indices.shape[2],
            f"lengths must lie in [0, {indices.shape[2]}] (the width of indices), got [{low}, {high}]",
        )
    native = native_cpu_available() and not q.is_cuda and not k_store.is_cuda
    rows = k_store.shape[2] // (block_size or 1)
    if indices.numel() and not native:  # the compiled kernel checks the ids it reads and names them itself
        low, high = (int(x) for x in torch.aminmax(indices))
        _check(
            low >= 0 and high < rows,
            f"indices must lie in [0, {rows}) ({'blocks' if block_size else 'rows'} of k_store), got [{low}, {high}]",
        )
    if native:
        return _native.sparse_attention_lse(
            q,
            k_store,
            v_store,
            indices,
            lengths,
            scale,
            key_mask=key_mask,
            block_size=block_size,
            num_threads=num_threads,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return reference.sparse_attention_lse(
        q, k_store, v_store, indices, lengths, scale, key_mask, block_size, k_scale, v_scale
    )


def ranked_block_attention(
    q, k_store, v_store, ranked, skip: int, count: int, scale: float, block_size: int, key_mask=None,
    num_threads=None, k_scale=None, v_scale=None,
):  # fmt: skip
    """Attention over ranks [skip, count) of best-first block ids: (out, lse, lengths).
    See `reference.ranked_block_attention`; k_scale / v_scale as `sparse_attention_lse`."""
    _check_scale(scale)
    _check_qkv(q, k_store, v_store, "k_store", "v_store", quantized_ok=True)
    _check_kv_scales(k_store, k_scale, v_scale)
    _check(
        ranked.dim() == 3 and tuple(ranked.shape[:2]) == tuple(k_store.shape[:2]),
        f"ranked must be [B, Hkv, W] = [{k_store.shape[0]}, {k_store.shape[1]}, W], got {tuple(ranked.shape)}",
    )
    _check(ranked.dtype == torch.long, f"ranked must be int64, got {ranked.dtype}")
    _check(
        0 <= skip <= count <= ranked.shape[2],
        f"skip / count must satisfy 0 <= skip <= count <= {ranked.shape[2]} (ranked's width), got {skip} / {count}",
    )
    _check(isinstance(block_size, int) and block_size >= 1, f"block_size must be >= 1, got {block_size}")
    if native_cpu_available() and not q.is_cuda and not k_store.is_cuda:
        return _native.ranked_block_attention(
            q, k_store, v_store, ranked, skip, count, scale, block_size, key_mask, num_threads, k_scale, v_scale,
        )  # fmt: skip
    return reference.ranked_block_attention(
        q, k_store, v_store, ranked, skip, count, scale, block_size, key_mask, k_scale, v_scale
    )


def ranked_attention_call(q, k_store, v_store, ranked, scale: float, block_size: int, out, lse, key_mask=None,
                          num_threads=None, k_scale=None, v_scale=None):  # fmt: skip
    """`ranked_block_attention` prepared for fixed buffers (`cpu.RankedAttention`: out / lse written in place,
    a call costs microseconds), or None where the compiled kernels are unavailable."""
    _check_scale(scale)
    if not native_cpu_available():
        return None
    return _native.RankedAttention(
        q, k_store, v_store, ranked, scale, block_size, out, lse, key_mask, num_threads, k_scale, v_scale
    )


def prepared_attention_call(q, k_store, v_store, indices, lengths, scale: float, out, lse, key_mask=None,
                            block_size=None, num_threads=None, k_scale=None, v_scale=None):  # fmt: skip
    """`sparse_attention_lse` prepared for fixed buffers (`cpu.PreparedAttention`: out / lse written in place, a
    call costs microseconds), or None where the compiled kernels are unavailable or the index lists are not laid
    out as it needs (then the general launcher runs)."""
    _check_scale(scale)
    if not native_cpu_available():
        return None
    try:
        return _native.PreparedAttention(
            q, k_store, v_store, indices, lengths, scale, out, lse, key_mask, block_size, num_threads,
            k_scale, v_scale,
        )  # fmt: skip
    except ValueError:
        return None


def block_scores(q, key_min, key_max, num_threads=None):
    """Quest block upper bounds [B, Hkv, nblk]. See `reference.block_scores`."""
    _check(key_min.dim() == 4, f"key_min must be [B, Hkv, nblk, D], got {tuple(key_min.shape)}")
    _check(
        key_max.shape == key_min.shape,
        f"key_max must have key_min's shape {tuple(key_min.shape)}, got {tuple(key_max.shape)}",
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
        q.shape[1] % key_min.shape[1] == 0,
        f"q heads ({q.shape[1]}) must be a multiple of key_min heads ({key_min.shape[1]})",
    )
    if native_cpu_available() and not q.is_cuda and not key_min.is_cuda:
        return _native.block_scores(q, key_min, key_max, num_threads=num_threads)
    return reference.block_scores(q, key_min, key_max)


def topk_blocks(scores, k: int, num_threads=None):
    """Top-k block ids per (request, KV head), ascending. See `reference.topk_blocks`."""
    _check(k >= 0, f"k must be >= 0, got {k}")
    _check(scores.dim() == 3, f"scores must be [B, Hkv, nblk], got shape {tuple(scores.shape)}")
    _check(scores.dtype in FLOAT_DTYPES, f"scores must be a float tensor, got {scores.dtype}")
    if native_cpu_available() and not scores.is_cuda:
        return _native.topk_blocks(scores, k, num_threads=num_threads)
    return reference.topk_blocks(scores, k)


def threshold_select(maw, threshold, num_kv_heads: int, num_rows: int, num_threads=None):
    """HGCA salient rows per KV head. See `reference.threshold_select`."""
    _check(maw.dim() == 3, f"maw must be [B, Hq, N], got {tuple(maw.shape)}")
    _check(maw.dtype in FLOAT_DTYPES, f"maw must be a float tensor, got {maw.dtype}")
    _check(num_kv_heads >= 1, f"num_kv_heads must be >= 1, got {num_kv_heads}")
    _check(
        maw.shape[1] % num_kv_heads == 0,
        f"maw heads ({maw.shape[1]}) must be a multiple of num_kv_heads={num_kv_heads}",
    )
    _check(
        0 <= num_rows <= maw.shape[2],
        f"num_rows must lie in [0, {maw.shape[2]}] (rows of maw), got {num_rows}",
    )
    if isinstance(threshold, torch.Tensor) and threshold.dim() > 0:
        _check(
            tuple(threshold.shape[:2]) == tuple(maw.shape[:2]) and threshold.dim() in (2, 3),
            f"threshold must be a scalar or [B, Hq] = {tuple(maw.shape[:2])}, got {tuple(threshold.shape)}",
        )
    if native_cpu_available() and not maw.is_cuda:
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


def merge_lse_(out_a, lse_a, out_b, lse_b):
    """In-place exact LSE merge of (out_b, lse_b) into (out_a, lse_a); float32. Returns (out_a, lse_a)."""
    _check(out_a.shape == out_b.shape, f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} differ")
    _check(
        lse_a.shape == lse_b.shape == out_a.shape[:-1], "lse_a / lse_b must be out's shape without head_dim"
    )
    if _triton_on(out_a.device):
        from . import gpu

        return gpu.merge_lse_(out_a, lse_a, out_b, lse_b)
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
    """The k best-scoring blocks of each row as a set: scores [..., NB] float32, k [1] int64 on their device ->
    [..., width] int64 (ids ascending, then NB). See `reference.top_blocks`."""
    _check(scores.dtype == torch.float32, f"scores must be float32, got {scores.dtype}")
    if _triton_on(scores.device):
        from . import gpu

        return gpu.top_blocks(scores, k, width)
    _check(
        isinstance(width, int) and 0 <= int(k) <= width,
        f"k must lie in [0, width={width}], got {int(k)}",
    )
    return reference.top_blocks(scores, int(k), width)


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
