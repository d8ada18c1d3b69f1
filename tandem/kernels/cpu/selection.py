"""Launchers of the compiled CPU selection kernels: Quest's block scoring and top-k, HGCA's threshold selection,
and the read-bandwidth probe. As `ops`: the reference's semantics plus `num_threads`, the reference where the
library is unavailable, ValueError naming a bad argument."""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels import reference
from tandem.kernels.cpu import _library
from tandem.kernels.cpu._checks import (
    _FLOAT_DTYPES,
    _check_tensor,
    _native,
    _ptr,
    _rows_contiguous,
    _threads,
)
from tandem.kernels.cpu._library import DTYPE_CODES, ScoreArgs


def _score(q, key_min, key_max, factor, k, num_threads):
    _check_tensor("q", q, 4, _FLOAT_DTYPES)
    batch, num_q_heads, _, head_dim = q.shape
    _check_tensor("key_min", key_min, 4, _FLOAT_DTYPES, (batch, None, None, head_dim))  # no 8-bit digests
    _check_tensor("key_max", key_max, 4, (key_min.dtype,), tuple(key_min.shape))
    num_kv_heads, num_blocks = key_min.shape[1], key_min.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q: {num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"factor: must be a positive int (logical / physical block size), got {factor!r}")
    _rows_contiguous("key_min", key_min)
    _rows_contiguous("key_max", key_max)
    threads = _threads(num_threads)
    lib = _native()
    if lib is None:
        scores = reference.block_scores(q, *reference.coarsen_digest(key_min, key_max, factor))
        return scores if k is None else reference.topk_blocks(scores, k)

    num_logical = -(-num_blocks // factor)
    qf = q.to(torch.float32).contiguous()
    # with k, the scores stay in the library's scratch (a fresh tensor here was page-faulted in every call)
    scores = torch.empty(batch, num_kv_heads, num_logical, dtype=torch.float32) if k is None else None
    args = ScoreArgs(
        _ptr(qf), None, _ptr(key_min), _ptr(key_max),
        *key_min.stride()[:3], *key_max.stride()[:3],
        batch, num_kv_heads, qf.shape[1] // num_kv_heads * qf.shape[2], head_dim, num_blocks, factor,
    )  # fmt: skip
    if k is None:
        top_ids = top_len = None
        kk = -1
    else:
        kk = min(k, num_logical)
        top_ids = torch.empty(batch, num_kv_heads, kk, dtype=torch.int64)
        top_len = torch.empty(batch, num_kv_heads, dtype=torch.int64)
    status = lib.tandem_score_topk(
        _library.isa_code(), DTYPE_CODES[key_min.dtype], ctypes.byref(args), _ptr(scores), kk,
        _ptr(top_ids), _ptr(top_len), threads,
    )  # fmt: skip
    if status < 0:
        raise RuntimeError(f"CPU kernel rejected isa={_library.isa_code()} dtype={key_min.dtype}")
    if k is None:
        return scores
    if kk == 0:
        top_len.zero_()
    return top_ids, top_len


def block_scores(
    q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, num_threads: int | None = None
) -> torch.Tensor:
    """Quest bound `sum_d max(q_d*min_d, q_d*max_d)` per block, max over a KV head's query group.

    q: [B, Hq, Lq, D]; key_min / key_max: [B, Hkv, nblk, D] float32 / bfloat16 / float16.
    Returns [B, Hkv, nblk] float32. An empty digest (min > max, e.g. +inf / -inf) scores -inf.
    """
    return _score(q, key_min, key_max, 1, None, num_threads)


def score_topk(
    q: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    k: int,
    factor: int = 1,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused block scoring + top-k at a logical block of `factor` physical blocks.

    Equals `topk_blocks(block_scores(q, *coarsen_digest(key_min, key_max, factor)), k)` without building
    the coarse digests or the score tensor in Python. Returns (block ids [B, Hkv, min(k, nlogical)] int64,
    ascending, unselectable picks last; lengths [B, Hkv] int64). Ids are logical blocks: pass them to
    `sparse_attention_lse` with `block_size = factor * physical block size`.
    """
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k: must be a non-negative int, got {k!r}")
    return _score(q, key_min, key_max, factor, k, num_threads)


def topk_blocks(
    scores: torch.Tensor, k: int, num_threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` blocks per (request, KV head), ascending block order; see `reference.topk_blocks`.

    scores: [B, Hkv, nblk] float32 (-inf = not selectable). Returns (ids [B, Hkv, min(k, nblk)] int64,
    lengths [B, Hkv] int64); picks with a non-finite score sit past `lengths`.
    """
    _check_tensor("scores", scores, 3, (torch.float32,))
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k: must be a non-negative int, got {k!r}")
    threads = _threads(num_threads)
    lib = _native()
    if lib is None:
        return reference.topk_blocks(scores, k)
    batch, heads, num_blocks = scores.shape
    k = min(k, num_blocks)
    top_ids = torch.empty(batch, heads, k, dtype=torch.int64)
    top_len = torch.zeros(batch, heads, dtype=torch.int64)
    if k:
        scores = scores.contiguous()
        lib.tandem_topk(_ptr(scores), batch * heads, num_blocks, k, _ptr(top_ids), _ptr(top_len), threads)
    return top_ids, top_len


def threshold_select(
    maw: torch.Tensor,
    threshold: torch.Tensor | float,
    num_kv_heads: int,
    num_rows: int,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HGCA salience: rows where any query head of a KV group has `maw > threshold`.

    maw: [B, Hq, N] float32 (only the first `num_rows` rows are live).
    threshold: scalar, or per head [B, Hq] / [B, Hq, 1].
    Returns (row ids [B, Hkv, S] int64 ascending, padded with 0; lengths [B, Hkv] int64), S = max length.
    """
    _check_tensor("maw", maw, 3, (torch.float32,))
    batch, num_q_heads, capacity = maw.shape
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads: must divide the {num_q_heads} query heads of maw, got {num_kv_heads!r}"
        )
    if not isinstance(num_rows, int) or not 0 <= num_rows <= capacity:
        raise ValueError(f"num_rows: must be an int in [0, {capacity}], got {num_rows!r}")
    thr = torch.as_tensor(threshold, dtype=torch.float32)
    if thr.dim() == 2:
        thr = thr[..., None]
    try:
        thr = thr.broadcast_to(batch, num_q_heads, 1).reshape(batch, num_q_heads).contiguous()
    except RuntimeError as err:
        raise ValueError(
            f"threshold: expected a scalar or shape [B, Hq] / [B, Hq, 1] = [{batch}, {num_q_heads}], "
            f"got {tuple(thr.shape)}"
        ) from err
    threads = _threads(num_threads)
    lib = _native()
    if lib is None:
        return reference.threshold_select(maw, threshold, num_kv_heads, num_rows)
    if maw.stride(-1) != 1:
        maw = maw.contiguous()
    out = torch.empty(batch * num_kv_heads * num_rows, dtype=torch.int64)
    lengths = torch.empty(batch, num_kv_heads, dtype=torch.int64)
    width = lib.tandem_threshold_select(
        _ptr(maw), batch, num_q_heads, maw.stride(0), maw.stride(1), num_rows, num_kv_heads,
        _ptr(thr), _ptr(out), _ptr(lengths), threads,
    )  # fmt: skip
    return out[: batch * num_kv_heads * width].view(batch, num_kv_heads, width), lengths


def read_sum(data: torch.Tensor, num_threads: int | None = None) -> float:
    """Sum of a contiguous float32 tensor read with the kernels' ISA and threads: a bandwidth probe."""
    _check_tensor("data", data, data.dim(), (torch.float32,))
    if not data.is_contiguous():
        raise ValueError("data: must be contiguous")
    threads = _threads(num_threads)
    lib = _native()
    if lib is None:
        return float(data.sum())
    return lib.tandem_read_sum(_library.isa_code(), _ptr(data), data.numel(), threads)
