"""Launchers of Quest's selection kernels (`selection_kernels`): the per-block bound of q.k over the digests
and the top-k of those scores, sized for a captured decode step. Each validates its inputs, then launches.
"""

from __future__ import annotations

import torch

from ._common import (
    FLOAT_DTYPES,
    MAX_HEAD_DIM,
    _block_d,
    _check,
    _check_on,
    _check_tensor,
    _dot_options,
    _group_pad,
    _guard,
    _output,
    _positive_int,
    _run_device,
    _unit_last_stride,
)

try:
    import triton

    from . import selection_kernels as _kernels
except ImportError:  # the torch references remain usable without triton
    triton = None
    _kernels = None

SCORE_BLOCK_N = 64  # digest blocks per program of `block_scores`
# `top_blocks` holds rows of up to this many blocks (padded to a power of two) in registers; longer ones are read
# in tiles of TOP_BLOCKS_TILE (`top_blocks_tiled_kernel`), any length. The register kernel is the faster one up to
# this width; a wider register row spills (docs/engine.md § Quest, the selection's table)
REGISTER_TOP_BLOCKS = 8192
TOP_BLOCKS_TILE = 4096
# Rows over REGISTER_TOP_BLOCKS: "split" spreads each row over tiles of SPLIT_TOP_BLOCKS_TILE blocks, one program
# each, with the radix histograms added up in global memory (7 launches, any length); "tiles" is the one-program
# kernel above. Split is the faster past REGISTER_TOP_BLOCKS, by the most at 1M tokens (docs/engine.md § Quest).
LONG_ROWS = "split"
SPLIT_TOP_BLOCKS_TILE = 1024


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
    k : [K] int64 tensor on scores' device (read at run time, so a recorded graph follows it), 0 <= k <= width:
        one count for every row (K = 1), or one per leading index (K = scores.shape[0]: request b keeps k[b])
    width : int >= 1, the output's fixed width (the most blocks any step keeps)
    out : optional preallocated [..., width] int64

    Returns [..., width] int64: the kept ids ascending, then NB (an invalid pick) up to `width`. Blocks scoring
    -inf are never kept; ties at the k-th score go to the lower ids. See `reference.top_blocks`.
    """
    device = _run_device("scores", scores)
    _check_tensor("scores", scores, "[..., NB]", tuple(scores.shape), (torch.float32,))
    _check(scores.dim() >= 1, "scores must have shape [..., NB], got a 0-d tensor")
    num_blocks = scores.shape[-1]
    per_row = scores.dim() >= 2 and k.dim() == 1 and k.shape[0] == scores.shape[0] and k.shape[0] > 1
    _check_tensor("k", k, "[1] or [scores.shape[0]]", (k.shape[0] if per_row else 1,), (torch.int64,))
    _check_on("k", k, device)
    _check(k.is_contiguous(), f"k must be contiguous, got strides {k.stride()}")
    _check(_positive_int(width), f"width must be a positive int, got {width!r}")
    lead = tuple(scores.shape[:-1])
    out = _output("out", out, (*lead, width), "[..., width]", device, dtype=torch.int64)
    _check(out.is_contiguous(), f"out must be contiguous (written in place), got strides {out.stride()}")
    rows = (
        scores.reshape(-1, num_blocks) if scores.is_contiguous() else scores.contiguous().view(-1, num_blocks)
    )
    if rows.shape[0] == 0 or num_blocks == 0:
        return out.fill_(num_blocks)
    rows_per_k = rows.shape[0] // k.shape[0]
    block = max(16, triton.next_power_of_2(num_blocks))
    args = (rows, k, out.view(-1, width), num_blocks, width, rows.stride(0), width, rows_per_k)
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
            _top_blocks_split(rows, k, out.view(-1, width), width, rows_per_k)
    return out


def _top_blocks_split(rows, k, out, width: int, rows_per_k: int) -> None:
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
            rows, k, hist, num_blocks, width, rows.stride(0), rows_per_k, P=p, TILE=tile, num_warps=warps
        )
    _kernels.top_blocks_count_kernel[grid](
        rows,
        k,
        hist,
        counts,
        num_blocks,
        width,
        rows.stride(0),
        num_tiles,
        rows_per_k,
        TILE=tile,
        num_warps=warps,
    )
    _kernels.top_blocks_write_kernel[grid](
        rows, k, hist, counts, out, num_blocks, width, rows.stride(0), width, num_tiles, rows_per_k,
        TILE=tile, TILES_PAD=max(2, triton.next_power_of_2(num_tiles)), num_warps=warps,
    )  # fmt: skip
