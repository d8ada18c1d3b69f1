"""Launchers of the attention kernels (`attention_kernels`): hot-tier decode, attention over selected
blocks of a pinned host store, prefill attention and the in-place LSE merge. Each validates its inputs (see
`_common` for the conventions every launcher keeps: CUDA-graph capturable, CPU tensors only under the
interpreter), then launches.
"""

from __future__ import annotations

import numbers

import torch

from ._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    MAX_HEAD_DIM,
    QUANT_CODES,
    _as_codes,
    _block_d,
    _check,
    _check_on,
    _check_readable,
    _check_real,
    _check_tensor,
    _dot_options,
    _group_pad,
    _guard,
    _kv_scales,
    _output,
    _positive_int,
    _run_device,
    _sm_count,
    _tile_rows,
    _unit_last_stride,
    interpreted,
)

try:
    import triton

    from . import attention_kernels as _kernels
except ImportError:  # the torch references remain usable without triton
    triton = None
    _kernels = None

BLOCK_S = 64  # hot-tier slots per tile
BLOCK_N = 64  # host-store rows per tile (several small blocks, or part of a large one)
MAX_SPLITS = 64


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
            BLOCK_S=_tile_rows(BLOCK_S, keys.dtype, _block_d(head_dim)),
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
    tiles = _prefill_tiles(q.dtype, head_dim, q_len)
    with _guard(device):
        _kernels.prefill_attention_kernel[(triton.cdiv(q_len, tiles["BLOCK_M"]), batch * num_q_heads)](
            q, keys, values, valid, out, lse,
            q_len, num_keys, num_q_heads, num_q_heads // num_kv_heads,
            0 if causal_offset is None else int(causal_offset), float(scale),
            *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *valid_strides,
            *out.stride()[:3], *lse.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=_block_d(head_dim),
            HAS_VALID=key_valid is not None,
            CAUSAL=causal_offset is not None,
            ACCUMULATE=bool(accumulate),
            **_dot_options(q.dtype),
            **tiles,
        )  # fmt: skip
    return out, lse


def _prefill_tiles(dtype: torch.dtype, head_dim: int, q_len: int) -> dict:
    """`prefill_attention_kernel`'s tiles and launch: BLOCK_M queries by BLOCK_N keys a step, num_warps,
    num_stages (K / V tiles in flight)."""
    block_d = _block_d(head_dim)
    return {
        "BLOCK_M": _tile_rows(64 if q_len > 32 else 16, dtype, block_d),
        "BLOCK_N": _tile_rows(64, dtype, block_d),
        "num_warps": 4,
        "num_stages": 2,
    }


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
            BLOCK_N=_tile_rows(BLOCK_N, keys.dtype, _block_d(head_dim)),
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
