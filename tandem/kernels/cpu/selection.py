"""Bindings of the compiled CPU selection kernels: Quest's block scoring and top-k, HGCA's threshold selection,
and the read-bandwidth probe. As `ops`: the reference's semantics plus `num_threads`, the reference where the
library is unavailable, arguments validated by the launchers of `tandem.kernels.ops` (this module converts what
the kernels read to the dtype and layout they read it in, and checks the digests' rows, read in place)."""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels import reference
from tandem.kernels.cpu import _library
from tandem.kernels.cpu._checks import _as, _native, _ptr, _rows_contiguous, _threads
from tandem.kernels.cpu._library import DTYPE_CODES, ScoreArgs


def _score(q, key_min, key_max, factor, k, num_threads):
    lib = _native()
    if lib is None:
        scores = reference.block_scores(q, *reference.coarsen_digest(key_min, key_max, factor))
        return scores if k is None else reference.topk_blocks(scores, k)
    batch, _, _, head_dim = q.shape
    num_kv_heads, num_blocks = key_min.shape[1], key_min.shape[2]
    _rows_contiguous(("key_min", key_min), ("key_max", key_max))
    threads = _threads(num_threads)
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
    return _score(q, key_min, key_max, factor, k, num_threads)


def topk_blocks(
    scores: torch.Tensor, k: int, num_threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` blocks per (request, KV head), ascending block order; see `reference.topk_blocks`.

    scores: [B, Hkv, nblk] float32 / bfloat16 / float16 (-inf = not selectable). Returns (ids [B, Hkv, min(k, nblk)] int64,
    lengths [B, Hkv] int64); picks with a non-finite score sit past `lengths`.
    """
    lib = _native()
    if lib is None:
        return reference.topk_blocks(scores, k)
    threads = _threads(num_threads)
    batch, heads, num_blocks = scores.shape
    k = min(k, num_blocks)
    top_ids = torch.empty(batch, heads, k, dtype=torch.int64)
    top_len = torch.zeros(batch, heads, dtype=torch.int64)
    if k:
        scores = _as(scores, torch.float32)  # the kernel reads float32 rows back to back
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
    lib = _native()
    if lib is None:
        return reference.threshold_select(maw, threshold, num_kv_heads, num_rows)
    threads = _threads(num_threads)
    batch, num_q_heads, _ = maw.shape
    # the kernel reads one float32 threshold per (request, query head) and float32 rows of maw (stride 1)
    thr = torch.as_tensor(threshold, dtype=torch.float32)
    thr = thr.reshape(thr.shape[:2]) if thr.dim() == 3 else thr
    thr = thr.broadcast_to(batch, num_q_heads).contiguous()
    if maw.dtype != torch.float32 or maw.stride(-1) != 1:
        maw = maw.float().contiguous()
    out = torch.empty(batch * num_kv_heads * num_rows, dtype=torch.int64)
    lengths = torch.empty(batch, num_kv_heads, dtype=torch.int64)
    width = lib.tandem_threshold_select(
        _ptr(maw), batch, num_q_heads, maw.stride(0), maw.stride(1), num_rows, num_kv_heads,
        _ptr(thr), _ptr(out), _ptr(lengths), threads,
    )  # fmt: skip
    return out[: batch * num_kv_heads * width].view(batch, num_kv_heads, width), lengths


def read_sum(data: torch.Tensor, num_threads: int | None = None) -> float:
    """Sum of a contiguous float32 tensor read with the kernels' ISA and threads: a bandwidth probe. No launcher
    stands before it (the bandwidth probe calls it on its own buffer), so it checks what the read needs."""
    if not isinstance(data, torch.Tensor):
        raise ValueError(f"data must be a contiguous float32 CPU tensor, got {type(data).__name__}")
    if not (data.is_cpu and data.dtype == torch.float32 and data.is_contiguous()):
        got = f"{data.dtype} on {data.device}, strides {data.stride()}"
        raise ValueError(f"data must be a contiguous float32 CPU tensor, got {got}")
    threads = _threads(num_threads)
    lib = _native()
    if lib is None:
        return float(data.sum())
    return lib.tandem_read_sum(_library.isa_code(), _ptr(data), data.numel(), threads)
