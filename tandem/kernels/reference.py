"""Plain-torch references of every Tandem kernel.

These are the definitions the fast kernels are tested against: simple, readable, fp32 math.
They are also the fallback implementations when no faster kernel is available.

Conventions (all functions):
    q:        [B, Hq, Lq, D]   queries (any float dtype)
    k, v:     [B, Hkv, T, D]   keys / values, Hq = Hkv * group
    out:      [B, Hq, Lq, D]   float32
    lse:      [B, Hq, Lq]      float32, natural-log log-sum-exp of the scaled logits; -inf where nothing was attended
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
# The certified selection's arithmetic (`tandem.policies.certify`, and its compiled kernel `cpu.certified_rows`):
# the slack, in logit units, widening every bound (lower ones down) for fp32 rounding in the kernels; the
# histogram that ranks the units, CERTIFY_BUCKETS bins of CERTIFY_BUCKET_NATS under a head's best bound, the last
# taking everything further down (24 nats: e^-24 a unit, negligible under a million of them); and the relative
# margin of its float64 sums
CERTIFY_SLACK_ABS = 2e-3
CERTIFY_SLACK_REL = 1e-4
CERTIFY_BUCKETS = 192
CERTIFY_BUCKET_NATS = 0.125
CERTIFY_TAIL_MARGIN = 1e-9


def certify_histogram(
    mass: torch.Tensor, lower: torch.Tensor | None, free: torch.Tensor, top: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The certified selection's histogram (`policies.certify.certified_blocks`): per row r of R (a request's
    query head), the units in each of CERTIFY_BUCKETS bins of CERTIFY_BUCKET_NATS under top[r], the last taking
    everything further down.

    mass: [R, n] float32 log upper mass bound per unit; lower: [R, n] float32 log lower bound, or None; free:
    [R, n] bool, the units ranked (the others count nowhere); top: [R] float64, finite. Returns (tail, count,
    gained) [R, CERTIFY_BUCKETS]: the sums of exp(mass - top) (float64), the units (int64) and the sums of
    exp(lower - top) (float64; None without `lower`) per bin."""
    rows, _ = mass.shape
    top = top.double()[:, None]
    bucket = ((top - mass.double()) / CERTIFY_BUCKET_NATS).clamp(0, CERTIFY_BUCKETS - 1).long()
    bucket = bucket.masked_fill(~free, CERTIFY_BUCKETS)  # a bin past the last for units not ranked
    bins = torch.zeros(rows, CERTIFY_BUCKETS + 1, dtype=torch.float64, device=mass.device)
    tail = bins.scatter_add(-1, bucket, (mass.double() - top).exp().masked_fill(~free, 0.0))
    count = torch.zeros_like(bins, dtype=torch.long).scatter_add_(-1, bucket, free.long())
    gained = None
    if lower is not None:
        gained = bins.scatter_add(-1, bucket, (lower.double() - top).exp().masked_fill(~free, 0.0))
        gained = gained[:, :CERTIFY_BUCKETS]
    return tail[:, :CERTIFY_BUCKETS], count[:, :CERTIFY_BUCKETS], gained


def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    # [B, Hq, Lq, D] -> [B, Hkv, G*Lq, D]: one matmul per KV head serves its whole query group
    batch, num_q_heads, q_len, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    return q.reshape(batch, num_kv_heads, group * q_len, head_dim)


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    return_weights: bool = False,
):
    """Dense attention returning `(out, lse)` (and optionally the softmax weights).

    key_mask: bool, True = attend. Shape [B, T] (same keys for every query) or [B, Lq, T].
    Rows with no attended key get out = 0 and lse = -inf.
    With `return_weights`, also returns weights [B, Hq, Lq, T] float32 (softmax over the attended keys).
    """
    batch, num_q_heads, q_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = _grouped(q.float(), num_kv_heads)
    logits = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, Hkv, G*Lq, T]
    logits = logits.view(batch, num_kv_heads, group, q_len, -1)
    if key_mask is not None:
        if key_mask.dim() == 2:
            mask = key_mask[:, None, None, None, :]
        else:
            mask = key_mask[:, None, None, :, :]
        logits = logits.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G, Lq]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(logits - safe_lse[..., None])  # exp(-inf) = 0 for masked keys
    out = torch.matmul(weights.view(batch, num_kv_heads, group * q_len, -1), v.float())
    out = out.view(batch, num_q_heads, q_len, head_dim)
    lse = lse.reshape(batch, num_q_heads, q_len)
    if return_weights:
        return out, lse, weights.reshape(batch, num_q_heads, q_len, -1)
    return out, lse


def merge_lse(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two partial attentions over disjoint key sets.

    out_*: [..., D] float32, lse_*: [...] float32. Either side may be empty (lse = -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w_a = torch.exp(lse_a - safe)  # 0 where lse_a = -inf
    w_b = torch.exp(lse_b - safe)
    out = out_a * w_a[..., None] + out_b * w_b[..., None]
    return out, lse


# Compressed host tier: 8-bit codes with one float32 scale per (request, KV head, block of rows).
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANT_MAX = {"int8": 127.0, "fp8": 448.0}  # the largest code magnitude of each format


def quantize_blocks(x: torch.Tensor, valid: torch.Tensor, block_size: int, kind: str):
    """Symmetric per-block quantization of x [B, H, n, D] (n a multiple of block_size), valid [B, n] bool.

    Returns (codes [B, H, n, D] int8 or float8_e4m3fn, scale [B, H, n // block_size] float32): row r of head h
    decodes as codes * scale[..., r // block_size]. The scale is the block's largest |x| over its valid rows
    divided by the format's largest code (127 / 448); padding rows and all-zero blocks store 0.
    """
    batch, heads, n, dim = x.shape
    xf = (
        x.float()
        .masked_fill(~valid[:, None, :, None], 0.0)
        .view(batch, heads, n // block_size, block_size, dim)
    )
    limit = QUANT_MAX[kind]
    scale = xf.abs().amax(dim=(3, 4)) / limit
    ratio = xf / torch.where(scale > 0, scale, 1.0)[..., None, None]
    ratio = ratio.clamp(-limit, limit)
    codes = ratio.round().to(torch.int8) if kind == "int8" else ratio.to(torch.float8_e4m3fn)
    return codes.view(batch, heads, n, dim), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [B, H, T, D] (int8 / float8_e4m3fn), scale [B, H, T // G] float32 -> float32 [B, H, T, D]: row r
    times scale[..., r // G] (G = T // scale.shape[2], which must divide T)."""
    rows = codes.shape[2]
    group = rows // max(scale.shape[2], 1)
    per_row = scale.float().repeat_interleave(group, dim=2)[..., :rows]
    return codes.float() * per_row[..., None]


def expand_block_indices(block_indices: torch.Tensor, block_lengths: torch.Tensor, block_size: int):
    """Block ids [B, Hkv, S] (+ lengths [B, Hkv]) -> token row ids [B, Hkv, S*block_size] (+ lengths)."""
    offsets = torch.arange(block_size, device=block_indices.device, dtype=block_indices.dtype)
    rows = (block_indices[..., None] * block_size + offsets).flatten(-2)
    return rows, block_lengths * block_size


def _gather_rows(store: torch.Tensor, gather_idx: torch.Tensor) -> torch.Tensor:
    # torch has no CPU gather for float8: gather its bytes
    if store.dtype == torch.float8_e4m3fn:
        return torch.gather(store.view(torch.uint8), 2, gather_idx).view(store.dtype)
    return torch.gather(store, 2, gather_idx)


def sparse_attention_lse(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    indices: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    block_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each KV head's query group over selected rows of a KV store.

    q:        [B, Hq, Lq, D]
    k_store:  [B, Hkv, cap, D]   (only rows named by `indices` are read)
    indices:  [B, Hkv, S] int    row ids (or block ids when `block_size` is given); padded past `lengths`
    lengths:  [B, Hkv] int       number of valid entries of `indices` per (request, KV head)
    key_mask: [B, cap] bool      False marks padding rows that are never attended
    k_scale:  [B, Hkv, G] float32, v_scale the same: scales of 8-bit stores (int8 / float8_e4m3fn codes); a
              gathered row r decodes as codes.float() * scale[b, h, r // (cap // G)]
    Returns out [B, Hq, Lq, D] float32, lse [B, Hq, Lq] float32 (-inf, zeros where nothing is selected).
    """
    if block_size is not None:
        indices, lengths = expand_block_indices(indices, lengths, block_size)
    batch, num_kv_heads, width = indices.shape
    head_dim = k_store.shape[-1]
    live = torch.arange(width, device=indices.device)[None, None, :] < lengths[..., None]  # [B, Hkv, S]
    rows = torch.where(live, indices, torch.zeros_like(indices)).long()
    gather_idx = rows[..., None].expand(batch, num_kv_heads, width, head_dim)
    k_sel = _gather_rows(k_store, gather_idx)
    v_sel = _gather_rows(v_store, gather_idx)
    if k_scale is not None:
        group = k_store.shape[2] // k_scale.shape[2]
        k_sel = k_sel.float() * torch.gather(k_scale.float(), 2, rows // group)[..., None]
        v_sel = v_sel.float() * torch.gather(v_scale.float(), 2, rows // group)[..., None]
    if key_mask is not None:
        valid = torch.gather(key_mask[:, None, :].expand(batch, num_kv_heads, -1), 2, rows)
        live = live & valid
    # the mask differs per KV head here, so apply it inside the grouped logits
    group = q.shape[1] // num_kv_heads
    q_len = q.shape[2]
    qg = _grouped(q.float(), num_kv_heads)
    logits = torch.matmul(qg, k_sel.float().transpose(-1, -2)) * scale  # [B, Hkv, G*Lq, S]
    logits = logits.masked_fill(~live[:, :, None, :], NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    weights = torch.exp(logits - safe[..., None])
    out = torch.matmul(weights, v_sel.float()).view(batch, num_kv_heads * group, q_len, head_dim)
    return out, lse.reshape(batch, num_kv_heads * group, q_len)


def stores_attention_lse(q, stores, indices, lengths, scale: float, block_size=None):
    """Attention of B requests that each keep their own store: request b's query q[b] [Hq, D] over the blocks (or
    rows) `indices[b]` names of its store (k_store, v_store, key_mask, k_scale, v_scale), as `sparse_attention_lse`
    of that store alone. Returns out [B, Hq, D] float32 and lse [B, Hq] float32."""
    outs, lses = [], []
    for b, (k_store, v_store, key_mask, k_scale, v_scale) in enumerate(stores):
        out, lse = sparse_attention_lse(
            q[b : b + 1, :, None], k_store, v_store, indices[b : b + 1], lengths[b : b + 1], scale, key_mask,
            block_size, k_scale, v_scale,
        )  # fmt: skip
        outs.append(out[:, :, 0])
        lses.append(lse[:, :, 0])
    return torch.cat(outs), torch.cat(lses)


def ranked_rows_attention_lse(q, stores, ranked, skips, counts, scale: float, block_size: int):
    """Request b's query q[b] over the blocks of ranks [skips[b], counts[b]) of its ranking ranked[b] [Hkv, W] that
    name blocks of its own store (ids < 0 or past the store skipped), as `stores_attention_lse` over those blocks
    sorted. Returns out [B, Hq, D] float32 and lse [B, Hq] float32."""
    batch, num_kv_heads, _ = ranked.shape
    width = max([int(c) - int(s) for s, c in zip(skips, counts, strict=True)] + [0])
    indices = torch.zeros(batch, num_kv_heads, max(width, 1), dtype=torch.long)
    lengths = torch.zeros(batch, num_kv_heads, dtype=torch.long)
    for b, store in enumerate(stores):
        limit = store[0].shape[2] // block_size
        for h in range(num_kv_heads):
            ids = ranked[b, h, int(skips[b]) : int(counts[b])]
            ids = ids[(ids >= 0) & (ids < limit)].sort().values
            indices[b, h, : len(ids)] = ids
            lengths[b, h] = len(ids)
    return stores_attention_lse(q, stores, indices, lengths, scale, block_size)


def top_blocks(scores: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """The `k` best-scoring blocks of each row as a set: [..., NB] float32 -> [..., width] int64 holding the kept
    ids ascending, then NB (an invalid pick). Blocks scoring -inf are never kept; ties at the k-th score go to
    the lower ids (a stable sort). 0 <= k <= width."""
    num_blocks = scores.shape[-1]
    k = min(k, num_blocks)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    best = scores.gather(-1, order)
    ids = order.masked_fill(best == NEG_INF, num_blocks).sort(dim=-1).values
    out = torch.full((*scores.shape[:-1], width), num_blocks, dtype=torch.long, device=scores.device)
    out[..., :k] = ids
    return out


def ranked_blocks(ranked: torch.Tensor, skip: int, count: int, num_blocks: int):
    """Ranks [skip, count) of best-first block ids [B, Hkv, W] as a block selection: (ids [B, Hkv, count - skip]
    ascending, padded with 0 past `lengths` [B, Hkv]). Ids outside [0, num_blocks) are invalid picks, dropped."""
    picks = ranked[..., skip:count]
    keep = (picks >= 0) & (picks < num_blocks)
    lengths = keep.sum(dim=-1)
    ids = torch.where(keep, picks, torch.full_like(picks, num_blocks)).sort(dim=-1).values
    live = torch.arange(picks.shape[-1], device=ranked.device) < lengths[..., None]
    return ids.masked_fill(~live, 0), lengths


def ranked_block_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    ranked: torch.Tensor,
    skip: int,
    count: int,
    scale: float,
    block_size: int,
    key_mask: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention over ranks [skip, count) of best-first block ids (Quest's device-ranked top-k).

    ranked: [B, Hkv, W] int64, ids >= cap // block_size (or < 0) are invalid picks. Returns out [B, Hq, Lq, D]
    float32, lse [B, Hq, Lq] float32 and lengths [B, Hkv] (the valid ids attended), as sparse_attention_lse
    (k_scale / v_scale: the scales of an 8-bit store, as there).
    """
    ids, lengths = ranked_blocks(ranked, skip, count, k_store.shape[2] // block_size)
    out, lse = sparse_attention_lse(
        q, k_store, v_store, ids, lengths, scale, key_mask, block_size, k_scale, v_scale
    )
    return out, lse, lengths


def coarsen_digest(
    key_min: torch.Tensor, key_max: torch.Tensor, factor: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block key digests [B, Hkv, nblk, D] -> digests of logical blocks `factor` times larger.

    A trailing partial logical block keeps the physical blocks it has.
    """
    if factor == 1:
        return key_min, key_max
    batch, heads, nblk, head_dim = key_min.shape
    pad = (-nblk) % factor
    if pad:
        key_min = torch.cat([key_min, key_min.new_full((batch, heads, pad, head_dim), math.inf)], dim=2)
        key_max = torch.cat([key_max, key_max.new_full((batch, heads, pad, head_dim), -math.inf)], dim=2)
    shape = (batch, heads, (nblk + pad) // factor, factor, head_dim)
    return key_min.view(shape).amin(dim=3), key_max.view(shape).amax(dim=3)


def block_scores(q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor) -> torch.Tensor:
    """Quest upper bound of q.k over each block, combined over a KV head's query group (and queries) by max.

    q: [B, Hq, Lq, D]; key_min / key_max: [B, Hkv, nblk, D]. Returns [B, Hkv, nblk] float32.
    A block whose digest is empty (min = +inf, max = -inf) scores -inf.
    """
    num_kv_heads = key_min.shape[1]
    qg = _grouped(q.float(), num_kv_heads)[:, :, :, None, :]  # [B, Hkv, G*Lq, 1, D]
    kmin = key_min.float()[:, :, None]
    kmax = key_max.float()[:, :, None]
    bound = torch.maximum(qg * kmin, qg * kmax)
    scores = torch.nan_to_num(bound, nan=0.0).sum(dim=-1).amax(dim=2)  # [B, Hkv, nblk]
    empty = (key_min > key_max).any(dim=-1)  # all-padding block: its digest is (+inf, -inf)
    return scores.masked_fill(empty, NEG_INF)


def topk_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` blocks per (request, KV head) by score, ascending block order.

    scores: [B, Hkv, nblk] float32 (-inf = not selectable). Returns (indices [B, Hkv, k] int64, lengths [B, Hkv]).
    """
    k = min(k, scores.shape[-1])
    if k == 0:
        empty = torch.zeros(scores.shape[:-1] + (0,), dtype=torch.long, device=scores.device)
        return empty, torch.zeros(scores.shape[:-1], dtype=torch.long, device=scores.device)
    top_scores, top = torch.topk(scores, k, dim=-1)
    selectable = torch.isfinite(top_scores)
    # move unselectable picks to the end so `lengths` can describe them
    order = torch.argsort((~selectable).to(torch.int8) * (scores.shape[-1] + 1) + top, dim=-1, stable=True)
    top = torch.gather(top, -1, order)
    return top, selectable.sum(dim=-1)


def threshold_select(
    maw: torch.Tensor, threshold: torch.Tensor | float, num_kv_heads: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """HGCA salience: rows where any query head of a KV group has `maw > threshold`.

    maw: [B, Hq, N] float32 moving average of attention weights per row (only the first `num_rows` are live).
    threshold: scalar, or [B, Hq] / [B, Hq, 1] per head.
    Returns (indices [B, Hkv, S] int64 ascending, padded with 0; lengths [B, Hkv]).
    """
    batch, num_q_heads, _ = maw.shape
    group = num_q_heads // num_kv_heads
    live = maw[..., :num_rows]
    if isinstance(threshold, torch.Tensor) and threshold.dim() == 2:
        threshold = threshold[..., None]
    keep = (live > threshold).view(batch, num_kv_heads, group, num_rows).any(dim=2)  # [B, Hkv, N]
    lengths = keep.sum(dim=-1)
    width = int(lengths.max().item()) if lengths.numel() else 0
    # stable sort puts kept rows first, in ascending row order; the padding past `lengths` is 0
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :width]
    live_slots = torch.arange(width, device=order.device) < lengths[..., None]
    return torch.where(live_slots, order, torch.zeros_like(order)), lengths


def hot_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    maw: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per request over the hot tier, with HGCA's moving average.

    q: [B, Hq, D]; keys / values: [B, Hkv, S, D]; valid: [B, S] bool (any pattern).
    maw: optional [B, Hq, S] float32, updated in place to (1 - alpha) * maw + alpha * p, p the softmax weight of
    each slot (0 at invalid slots). Returns out [B, Hq, D] float32, lse [B, Hq] float32 (-inf, 0 with no slot).
    """
    out, lse, weights = attention_lse(q[:, :, None], keys, values, scale, valid, return_weights=True)
    if maw is not None:
        maw.mul_(1.0 - alpha).add_(weights[:, :, 0], alpha=alpha)
    return out[:, :, 0], lse[:, :, 0]


def host_block_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_ids: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    valid: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per request over selected blocks of a host KV store.

    q: [B, Hq, D]; keys / values: [B, Hkv, T, D]; block_ids: [B, Hkv, S] int (padded past `lengths`);
    lengths: [B, Hkv] int; valid: [B, T] bool. Row r of block b is b * block_size + r; rows outside [0, T) (the
    tail of a last partial block, blocks past the store) are ignored. Returns out [B, Hq, D] float32, lse [B, Hq]
    float32. An 8-bit store (int8 / float8_e4m3fn codes) comes with k_scale / v_scale [B, Hkv, T // G] float32
    and is attended as `dequantize` decodes it (float32).
    """
    if k_scale is not None:
        keys, values = dequantize(keys, k_scale), dequantize(values, v_scale)
    blocks = -(-keys.shape[2] // block_size)
    # complete the last block, and add one block, with rows that are never attended; ids outside the store
    # point at that block
    pad = blocks * block_size + block_size - keys.shape[2]
    keys = torch.nn.functional.pad(keys, (0, 0, 0, pad))
    values = torch.nn.functional.pad(values, (0, 0, 0, pad))
    valid = torch.nn.functional.pad(valid, (0, pad), value=False)
    block_ids = block_ids.long()
    block_ids = torch.where((block_ids >= 0) & (block_ids < blocks), block_ids, blocks)
    out, lse = sparse_attention_lse(
        q[:, :, None], keys, values, block_ids, lengths.long(), scale, valid, block_size
    )
    return out[:, :, 0], lse[:, :, 0]


def recall_plan(ids, k, share: float, state: dict, out: dict, block_size: int) -> None:
    """One decode step's plan for quest's recall cache (`tandem.cache.recall`), in place, per (request, KV head):

    1. hits: selected blocks (the first `k` entries of `ids` [B, Hkv, K], ids in [0, limit)) that have a slot are
       attended there (`gpu` entries [0, K): `h * S + slot`, else `dead` = Hkv * S) and marked used this step
       (`last` = step, `ref` = 1);
    2. misses, in `ids` order: the first count = min(W, floor(misses * share + 0.5)) go to `src` (copied in by
       the device), the others to `cpu` (at their positions; `limit` elsewhere);
    3. victims: a clock hand walks the slots from `hand`, taking (into `dst`, marked used) slots not used this
       step whose `ref` is 0 and clearing the `ref` of the unused slots it passes, until `count` are taken;
    4. each taken slot drops its old block and takes its `src` block (`ref` = 1); `gpu` entries [K, K + W) are
       the taken slots (`dead` past `count`); `counts` = count; `step` += 1; `counters` += (hits, count) rows.

    state: block_slot [B, Hkv, NB] (NB - 1 >= limit), slot_block / last [B, Hkv, S] int64, ref [B, Hkv, S] int8,
    hand / step [B, Hkv] int64, counters [2] int64 (or [B, 2]: each request's own), limit (int). out: cpu
    [B, Hkv, K], src / dst [B, Hkv, W], counts [B, Hkv], gpu [B, Hkv, K + W], all int64. k: an int, a [1]
    tensor, or [B] (request b's count). `gpu.recall_plan_kernel` runs the same steps.
    """
    batch, heads, width_k = ids.shape
    ks = [int(c) for c in k.reshape(-1).tolist()] if torch.is_tensor(k) else [int(k)]
    ks = ks * batch if len(ks) == 1 else ks
    width = out["src"].shape[-1]
    limit = state["limit"]
    slot_block, block_slot = state["slot_block"], state["block_slot"]
    last, ref, hand, steps = state["last"], state["ref"], state["hand"], state["step"]
    slots = slot_block.shape[-1]
    dead = heads * slots
    totals = torch.zeros(batch, 2, dtype=torch.long)
    for b in range(batch):
        k = ks[b]
        for h in range(heads):
            step = int(steps[b, h])
            gpu = [dead] * (width_k + width)
            cpu = [limit] * width_k
            misses = []
            hits = 0
            for e in range(width_k):
                block = int(ids[b, h, e])
                if e >= k or not 0 <= block < limit:
                    continue
                slot = int(block_slot[b, h, block])
                if slot >= 0:
                    hits += 1
                    last[b, h, slot] = step
                    ref[b, h, slot] = 1
                    gpu[e] = h * slots + slot
                else:
                    misses.append((e, block))
            count = min(width, math.floor(len(misses) * share + 0.5))
            src = [block for _, block in misses[:count]]
            for e, block in misses[count:]:
                cpu[e] = block
            dst = []
            position = int(hand[b, h])
            while len(dst) < count:
                if int(last[b, h, position]) != step:
                    if int(ref[b, h, position]) == 0:
                        dst.append(position)
                        last[b, h, position] = step
                    else:
                        ref[b, h, position] = 0
                position = (position + 1) % slots
            hand[b, h] = position
            for j, (slot, block) in enumerate(zip(dst, src, strict=True)):
                old = int(slot_block[b, h, slot])
                if old >= 0:
                    block_slot[b, h, old] = -1
                block_slot[b, h, block] = slot
                slot_block[b, h, slot] = block
                ref[b, h, slot] = 1
                gpu[width_k + j] = h * slots + slot
            out["gpu"][b, h] = torch.tensor(gpu)
            out["cpu"][b, h] = torch.tensor(cpu)
            out["src"][b, h, :count] = torch.tensor(src, dtype=torch.long)
            out["dst"][b, h, :count] = torch.tensor(dst, dtype=torch.long)
            out["counts"][b, h] = count
            steps[b, h] = step + 1
            totals[b] += torch.tensor([hits, count])
    counters = state["counters"]
    counters += (totals if counters.dim() == 2 else totals.sum(dim=0)).to(counters.device) * block_size


def recall_blocks(
    src_keys: torch.Tensor,
    src_values: torch.Tensor,
    src_valid: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    counts: torch.Tensor,
    block_size: int,
    slots: int,
    src_k_scale: torch.Tensor | None = None,
    src_v_scale: torch.Tensor | None = None,
) -> None:
    """Copy host blocks into the slots of a block cache, in place.

    src_keys / src_values: [B, Hkv, T, D]; src_valid: [B, T] bool. keys / values: [B, Hkv * slots * block_size, D],
    slot s of head h at rows [(h * slots + s) * block_size, ... + block_size); valid: [B, Hkv * slots * block_size].
    src_ids / dst_ids: [B, Hkv, W] int64 host block ids and slots; the first counts[b, h] ([B, Hkv]) entries are
    copied (the others may name any slot). Rows of a block past T are marked not valid. keys / values / valid
    contiguous. An 8-bit source (int8 / float8_e4m3fn codes) comes with src_k_scale / src_v_scale
    [B, Hkv, T // G] float32: the copied rows are dequantized (float32), then rounded to the cache's dtype.
    """
    batch, num_kv_heads, num_rows, head_dim = src_keys.shape
    width = src_ids.shape[-1]
    offsets = torch.arange(block_size, device=src_ids.device)
    live = torch.arange(width, device=src_ids.device) < counts[..., None]  # [B, Hkv, W]
    src_rows = src_ids[..., None] * block_size + offsets  # [B, Hkv, W, bs]
    readable = live[..., None] & (src_rows < num_rows)
    src_rows = torch.where(readable, src_rows, 0).reshape(batch, num_kv_heads, -1)
    head_base = torch.arange(num_kv_heads, device=src_ids.device)[None, :, None] * slots
    dst_rows = ((head_base + dst_ids)[..., None] * block_size + offsets).reshape(batch, -1)  # [B, Hkv*W*bs]
    put = live[..., None].expand(-1, -1, -1, block_size).reshape(batch, -1)
    # only live entries are written (entries past counts may repeat a slot): rows of the [B * rows] flattening
    flat = (torch.arange(batch, device=src_ids.device)[:, None] * keys.shape[1] + dst_rows)[put]
    for src, src_scale, dst in ((src_keys, src_k_scale, keys), (src_values, src_v_scale, values)):
        codes = src.view(torch.uint8) if src.dtype == torch.float8_e4m3fn else src  # torch has no fp8 gather
        rows = codes.gather(2, src_rows[..., None].expand(-1, -1, -1, head_dim)).view(src.dtype)
        if src_scale is not None:  # only the copied rows: each with its group's scale
            group = max(1, num_rows // max(src_scale.shape[2], 1))
            rows = dequantize(rows, src_scale.gather(2, src_rows // group))
        rows = rows.reshape(batch, -1, head_dim)
        dst.view(-1, head_dim).index_copy_(0, flat, rows[put].to(dst.dtype))
    ok = src_valid.gather(1, src_rows.reshape(batch, -1)) & readable.reshape(batch, -1)
    valid.view(-1).index_copy_(0, flat, ok[put])


def block_scores_matmul(
    q: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, block_valid: torch.Tensor
):
    """`block_scores` for one decode query, as two matmuls: max(q*min, q*max) = relu(q)*max + min(q, 0)*min
    per dim, so no [blocks, D] temporary is built (the form the GPU side uses inside a decode step).

    q: [B, Hq, D]; key_min / key_max: [B, Hkv, nblk, D], finite; block_valid: [B, nblk] bool.
    Returns [B, Hkv, nblk] float32; invalid blocks score -inf.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = key_min.shape[1]
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    positive = qg.clamp(min=0).to(key_max.dtype)
    negative = qg.clamp(max=0).to(key_min.dtype)
    bound = torch.matmul(positive, key_max.transpose(-1, -2)).float()
    bound += torch.matmul(negative, key_min.transpose(-1, -2)).float()  # [B, Hkv, G, nblk]
    return bound.amax(dim=2).masked_fill(~block_valid[:, None], NEG_INF)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalize in fp32, round to x's dtype, scale by the weight (`gpu.layers.rms_norm`)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, rms_norm(h)) with h = x + residual in x's dtype: a decoder layer's residual add and the next norm
    (`gpu.layers.add_rms_norm`)."""
    h = x + residual
    return h, rms_norm(h, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [..., 2 N] tensor holding gate then up, each op rounded as torch rounds it
    (`gpu.layers.silu_mul`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding with the half-split rotation, cos / sin [B, L, D] broadcast over heads
    (`gpu.layers.rotary`)."""

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
