"""Quest's selection kernels: the per-block upper bound of q.k over the digests, and the radix top-k of those
scores (one program per row in registers or in tiles, or a row split over many programs). Only `@triton.jit`
functions live here; `selection.py` validates and launches.
"""

import triton
import triton.language as tl

from ._common_kernels import _dot


@triton.jit
def block_scores_kernel(
    q_ptr,  # [B, Hq, D]
    min_ptr,  # [B, Hkv, NB, D] per-block key minima
    max_ptr,  # [B, Hkv, NB, D] per-block key maxima
    valid_ptr,  # [B, NB] uint8
    out_ptr,  # [B, Hkv, NB] fp32
    num_blocks,
    group,
    stride_qb,
    stride_qh,
    stride_nb,
    stride_nh,
    stride_nn,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_vb,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Quest's bound of BLOCK_N blocks for one (request, KV head): max over the group's query heads of
    sum_d max(q_d * min_d, q_d * max_d) = relu(q) . max + min(q, 0) . min (two tensor-core dots), -inf at
    invalid blocks. Grid: (B, Hkv, cdiv(NB, BLOCK_N))."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    d_ok = d[None, :] < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + (h * group + rows)[:, None] * stride_qh + d[None, :],
        mask=(rows[:, None] < group) & d_ok,
        other=0.0,
    )
    n_ok = n < num_blocks
    tile = n[:, None] * stride_nn + d[None, :]
    low = tl.load(min_ptr + b * stride_nb + h * stride_nh + tile, mask=n_ok[:, None] & d_ok, other=0.0)
    tile = n[:, None] * stride_xn + d[None, :]
    high = tl.load(max_ptr + b * stride_xb + h * stride_xh + tile, mask=n_ok[:, None] & d_ok, other=0.0)
    q = q.to(tl.float32)  # (Triton 3.9's interpreter takes max / min of bfloat16 bit patterns as integers)
    positive = tl.maximum(q, 0.0).to(high.dtype)
    negative = tl.minimum(q, 0.0).to(low.dtype)
    bound = _dot(positive, tl.trans(high), DOT_PRECISION, UPCAST)
    bound += _dot(negative, tl.trans(low), DOT_PRECISION, UPCAST)  # [GROUP_PAD, BLOCK_N]
    bound = tl.where(rows[:, None] < group, bound, float("-inf"))
    best = tl.max(bound, axis=0)
    ok = tl.load(valid_ptr + b * stride_vb + n, mask=n_ok, other=0) != 0
    tl.store(out_ptr + b * stride_ob + h * stride_oh + n, tl.where(ok, best, float("-inf")), mask=n_ok)


@triton.jit
def _order_keys(x):
    """(signed, unsigned) int32 keys in the order of the fp32 scores x; the unsigned one's bytes are radix digits.
    -0.0 gets +0.0's key: the two compare equal, and their tie goes to the lower id."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key, key ^ -2147483648


@triton.jit
def _candidates(live, ukey, prefix, p: tl.constexpr):
    """Keys still tied with the k-th best on the bytes fixed before radix pass p."""
    if p == 0:
        candidate = live
    else:
        candidate = live & ((ukey >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
    return candidate


@triton.jit
def _radix_step(hist, remaining, prefix, shift):
    """One radix pass: from the 256-bin histogram of the candidates' byte at `shift`, the byte of the k-th best
    key (the highest bin with at least `remaining` candidates at or above it); returns (remaining, prefix) after
    dropping the candidates above it, which are kept for sure."""
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # candidates with digit >= bin
    chosen = tl.max(tl.where(at_least >= remaining, bins, 0), axis=0)
    remaining -= tl.sum(tl.where(bins > chosen, hist, 0), axis=0)
    return remaining, prefix | (chosen << shift)


@triton.jit
def top_blocks_kernel(
    scores_ptr,  # [R, NB] fp32
    k_ptr,  # [R / rows_per_k] int64: how many blocks to keep this step, one count per rows_per_k rows
    out_ptr,  # [R, W] int64
    num_blocks,
    width,
    stride_s,
    stride_o,
    rows_per_k,
    BLOCK: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
):
    """The k best-scoring blocks of one row as a set: their ids ascending in out[:n], then num_blocks (an invalid
    pick) up to `width`. Blocks scoring -inf are never kept; ties at the k-th score go to the lower ids.

    Radix select over the scores' order-preserving int32 keys, a byte per pass (a 256-bin histogram of the
    candidates still tied on the bytes above), with the whole row in registers. Grid: (R,)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    live = offs < num_blocks
    x = tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf"))
    key, ukey = _order_keys(x)
    # never more than the output holds
    remaining = tl.minimum(tl.load(k_ptr + row // rows_per_k), width).to(tl.int32)
    prefix = tl.zeros((), dtype=tl.int32)  # the unsigned key bytes fixed so far
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.histogram((ukey >> shift) & 0xFF, 256, mask=_candidates(live, ukey, prefix, p))
        remaining, prefix = _radix_step(hist, remaining, prefix, shift)
    threshold = prefix ^ -2147483648  # the k-th best key, signed
    tie = live & (key == threshold)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) - 1
    keep = live & (x != float("-inf")) & ((key > threshold) | (tie & (tie_rank < remaining)))
    slots = tl.arange(0, WIDTH_PAD)
    tl.store(
        out_ptr + row * stride_o + slots, tl.zeros((WIDTH_PAD,), tl.int64) + num_blocks, mask=slots < width
    )
    tl.debug_barrier()  # the padding lands before the kept ids overwrite their slots
    position = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_o + position, offs.to(tl.int64), mask=keep)


@triton.jit
def top_blocks_tiled_kernel(
    scores_ptr,  # [R, NB] fp32
    k_ptr,  # [R / rows_per_k] int64
    out_ptr,  # [R, W] int64
    num_blocks,
    width,
    stride_s,
    stride_o,
    rows_per_k,
    TILE: tl.constexpr,
):
    """`top_blocks_kernel` for rows too long for registers: the same radix select and output, with the row read
    in tiles of TILE scores (from L2 after the first pass), once per byte of the key and once more to write the
    kept ids. Each pass carries its histogram across the tiles; the last one carries how many ids and how many
    ties at the threshold earlier tiles kept, so ids stay ascending and ties go to the lower ids. Grid: (R,)."""
    row = tl.program_id(0).to(tl.int64)
    base = scores_ptr + row * stride_s
    offs = tl.arange(0, TILE)
    remaining = tl.minimum(tl.load(k_ptr + row // rows_per_k), width).to(tl.int32)
    prefix = tl.zeros((), dtype=tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((256,), dtype=tl.int32)
        for start in range(0, num_blocks, TILE):
            live = start + offs < num_blocks
            key, ukey = _order_keys(tl.load(base + start + offs, mask=live, other=float("-inf")))
            hist += tl.histogram((ukey >> shift) & 0xFF, 256, mask=_candidates(live, ukey, prefix, p))
        remaining, prefix = _radix_step(hist, remaining, prefix, shift)
    threshold = prefix ^ -2147483648
    for start in range(0, width, TILE):
        tl.store(
            out_ptr + row * stride_o + start + offs,
            tl.zeros((TILE,), tl.int64) + num_blocks,
            mask=start + offs < width,
        )
    tl.debug_barrier()  # the padding lands before the kept ids overwrite their slots
    kept = tl.zeros((), dtype=tl.int32)
    ties = tl.zeros((), dtype=tl.int32)
    for start in range(0, num_blocks, TILE):
        live = start + offs < num_blocks
        x = tl.load(base + start + offs, mask=live, other=float("-inf"))
        key, ukey = _order_keys(x)
        tie = live & (key == threshold)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        keep = live & (x != float("-inf")) & ((key > threshold) | (tie & (tie_rank < remaining)))
        position = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * stride_o + position, (start + offs).to(tl.int64), mask=keep)
        kept += tl.sum(keep.to(tl.int32), axis=0)
        ties += tl.sum(tie.to(tl.int32), axis=0)


# ---- top-k of long rows over many programs (`top_blocks` with LONG_ROWS = "split") --------------------------
@triton.jit
def _chain(hist_ptr, row, remaining, P: tl.constexpr):
    """(remaining, prefix) after radix passes 0 .. P-1, recomputed from their histograms in hist[row, p, 256]
    (every program of a pass reads the same finished histograms, so none has to publish the result)."""
    prefix = tl.zeros((), dtype=tl.int32)
    bins = tl.arange(0, 256)
    for p in tl.static_range(P):
        hist = tl.load(hist_ptr + (row * 4 + p) * 256 + bins)
        remaining, prefix = _radix_step(hist, remaining, prefix, 24 - 8 * p)
    return remaining, prefix


@triton.jit
def top_blocks_hist_kernel(
    scores_ptr,  # [R, NB] fp32
    k_ptr,  # [R / rows_per_k] int64
    hist_ptr,  # [R, 4, 256] int32, zero before pass 0
    num_blocks,
    width,
    stride_s,
    rows_per_k,
    P: tl.constexpr,
    TILE: tl.constexpr,
):
    """Grid (R, tiles): radix pass P over one tile of a row: the histogram of its candidates' byte P (the keys
    still tied with the k-th best on bytes 0 .. P-1), added into the row's histogram of pass P."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    live = offs < num_blocks
    remaining = tl.minimum(tl.load(k_ptr + row // rows_per_k), width).to(tl.int32)
    remaining, prefix = _chain(hist_ptr, row, remaining, P)
    _, ukey = _order_keys(tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf")))
    hist = tl.histogram((ukey >> (24 - 8 * P)) & 0xFF, 256, mask=_candidates(live, ukey, prefix, P))
    tl.atomic_add(hist_ptr + (row * 4 + P) * 256 + tl.arange(0, 256), hist)


@triton.jit
def _split_threshold(k_ptr, rows_per_k, hist_ptr, row, width):
    """The k-th best key (signed) of a row and how many of the keys equal to it are kept."""
    remaining = tl.minimum(tl.load(k_ptr + row // rows_per_k), width).to(tl.int32)
    remaining, prefix = _chain(hist_ptr, row, remaining, 4)
    return prefix ^ -2147483648, remaining


@triton.jit
def top_blocks_count_kernel(
    scores_ptr,
    k_ptr,
    hist_ptr,
    counts_ptr,  # [R, tiles, 2] int32: keys above the threshold, keys equal to it
    num_blocks,
    width,
    stride_s,
    num_tiles,
    rows_per_k,
    TILE: tl.constexpr,
):
    """Grid (R, tiles): per tile, how many keys beat the k-th best and how many tie with it."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    live = offs < num_blocks
    threshold, _ = _split_threshold(k_ptr, rows_per_k, hist_ptr, row, width)
    x = tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf"))
    key, _ = _order_keys(x)
    # -inf is never kept, even above a threshold that k past the row's finite scores leaves at the lowest key
    above = tl.sum((live & (key > threshold) & (x != float("-inf"))).to(tl.int32), axis=0)
    ties = tl.sum((live & (key == threshold)).to(tl.int32), axis=0)
    tl.store(counts_ptr + (row * num_tiles + tile) * 2, above)
    tl.store(counts_ptr + (row * num_tiles + tile) * 2 + 1, ties)


@triton.jit
def top_blocks_write_kernel(
    scores_ptr,
    k_ptr,
    hist_ptr,
    counts_ptr,
    out_ptr,  # [R, W] int64
    num_blocks,
    width,
    stride_s,
    stride_o,
    num_tiles,
    rows_per_k,
    TILE: tl.constexpr,
    TILES_PAD: tl.constexpr,
):
    """Grid (R, tiles): write one tile's kept ids at their place in the row's ascending list (after the ids kept
    by earlier tiles); ties at the k-th best go to the lower ids across tiles. Tile 0 pads the rest of the row
    with num_blocks. The same set and order as `top_blocks_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    live = offs < num_blocks
    threshold, remaining = _split_threshold(k_ptr, rows_per_k, hist_ptr, row, width)
    ninf_key, _ = _order_keys(tl.full((), float("-inf"), tl.float32))
    tiles = tl.arange(0, TILES_PAD)
    counted = tiles < num_tiles
    above = tl.load(counts_ptr + (row * num_tiles + tiles) * 2, mask=counted, other=0)
    ties = tl.load(counts_ptr + (row * num_tiles + tiles) * 2 + 1, mask=counted, other=0)
    earlier = tiles < tile
    ties_before = tl.sum(tl.where(earlier, ties, 0), axis=0)
    # ties of -inf are never kept; otherwise the first `remaining` ties (in id order) are
    takes_ties = threshold != ninf_key
    kept_before = tl.sum(tl.where(earlier, above, 0), axis=0)
    kept_before += tl.where(takes_ties, tl.minimum(ties_before, remaining), 0)
    x = tl.load(scores_ptr + row * stride_s + offs, mask=live, other=float("-inf"))
    key, _ = _order_keys(x)
    tie = live & (key == threshold)
    tie_rank = ties_before + tl.cumsum(tie.to(tl.int32), axis=0) - 1
    keep = live & (x != float("-inf")) & ((key > threshold) | (tie & (tie_rank < remaining)))
    position = kept_before + tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * stride_o + position, offs.to(tl.int64), mask=keep)
    if tile == 0:
        total = tl.sum(above, axis=0) + tl.where(takes_ties, tl.minimum(tl.sum(ties, axis=0), remaining), 0)
        for start in range(0, width, TILE):
            slots = start + tl.arange(0, TILE)
            pad = (slots >= total) & (slots < width)
            tl.store(out_ptr + row * stride_o + slots, tl.zeros((TILE,), tl.int64) + num_blocks, mask=pad)
