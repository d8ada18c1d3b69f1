"""Certified sparse attention: a sound bound, per query head and step, on what the host blocks a selection skips
could change, and the selection that keeps that bound under a user's epsilon.

For a query q (logits s = scale * q.k) and a host block b of n_b rows, `logit_bounds` gives an upper bound u_b of
every logit in the block, the smaller of two:
- the box bound from the block's per-dimension key min / max (Quest's score): sum_d max(q_d min_d, q_d max_d);
- the ball bound from the keys' centre c_b and radius r_b = max ||k - c_b||: q.c_b + ||q|| r_b.
Both are scaled, and a slack covers fp32 rounding in the kernels' dot products. The skipped mass is then at most
D = sum over skipped blocks of n_b exp(u_b), and with W the exact mass of what was attended (hot tier plus
selection), the probability the skipped rows hold is p <= D / (W + D). The output moves by at most
||o - o_sparse|| <= p (max ||v|| over the skipped blocks + ||o_sparse||): o is the mix (1 - p) o_sparse + p o_tail
with ||o_tail|| at most the largest skipped value norm.

With `certified.bound="sketch"` (`TandemConfig`) the bound is per row instead: every host key k_i is kept as an
int8 sketch k~_i = s_i c_i (a symmetric scale s_i per row, codes c_i in [-127, 127]) with its error radius
e_i = ||k_i - k~_i|| (`key_sketch`), so that q.k_i <= q.k~_i + ||q|| e_i (Cauchy-Schwarz); a block's mass bound is
the sum of its rows' exp(scaled bound) (`sketch_mass_bounds`), not n_b times its largest: a far tighter bound than
the block digests' on the default model (docs/certified.md § Tightness on the default model).

`certified_blocks` picks, per query head, the fewest best blocks or rows (ranked by their mass bound, to within a
histogram bucket) whose tail certifies p <= epsilon against a lower bound of W known before the host part runs
(the hot tier's mass, plus the kept units' lower mass bounds: the sketch's q.k~_i - ||q|| e_i, or the ball's
q.c_b - ||q|| r_b), capped at `max_blocks`; each KV head attends the union of its group's picks. `certificate` gives, after the step, the tighter
bound with W the exact attended mass. Everything here is plain torch on the compute device (graph-safe: no host
reads).
"""

from __future__ import annotations

import math

import torch

from ..kernels import cpu as _cpu
from ..kernels import ops, reference

# the bounds' slack and the selection's histogram, shared with the compiled kernel (`kernels.reference`)
SLACK_ABS, SLACK_REL = reference.CERTIFY_SLACK_ABS, reference.CERTIFY_SLACK_REL
BUCKETS, BUCKET_NATS, TAIL_MARGIN = (
    reference.CERTIFY_BUCKETS, reference.CERTIFY_BUCKET_NATS, reference.CERTIFY_TAIL_MARGIN,
)  # fmt: skip
SKETCH_TOP = 127  # int8 codes are symmetric: [-127, 127]
# fp32 bytes of codes converted at a time on a CPU (`sketch_logit_bounds`): a whole 128K-token layer at once
# measured slower than pieces of a few MB, which stay in cache
SKETCH_CHUNK_BYTES = 1 << 23


def block_digest(keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, block_size: int):
    """Per block of `block_size` rows, over its non-padding rows: (centre [B, Hkv, nb, D] float32, radius
    [B, Hkv, nb], largest value norm [B, Hkv, nb], rows [B, nb] float32). An all-padding block has 0 rows (and
    zeros elsewhere). keys / values: [B, Hkv, n, D] with n a multiple of block_size; valid: [B, n] bool."""
    batch, heads, n, dim = keys.shape
    nb = n // block_size
    live = valid.view(batch, 1, nb, block_size)
    rows = live[:, 0].sum(-1).float()  # [B, nb]
    k = keys.float().view(batch, heads, nb, block_size, dim)
    centre = (k * live[..., None]).sum(3) / rows.clamp(min=1.0)[:, None, :, None]
    radius = (k - centre[:, :, :, None]).norm(dim=-1).masked_fill(~live, 0.0).amax(-1)
    value_norm = values.float().view(batch, heads, nb, block_size, dim).norm(dim=-1).masked_fill(~live, 0.0)
    return centre, radius, value_norm.amax(-1), rows


def sketch_rounding(dim: int) -> float:
    """The relative padding `key_sketch` gives the error radius so that the fp32 arithmetic of the sketch bound
    stays sound: fl(q.c) is within gamma_D sum_d |q_d c_d| <= gamma_D ||q|| ||c|| of q.c (any summation order,
    gamma_D ~ D u, u = 2^-24); s (q.c), ||q||, the sketch rows and the radius each add a few u more. Four times
    (D + 8) u covers them all (1.1e-5 at D = 64)."""
    return 4.0 * (dim + 8) * 2.0**-24


def key_sketch(keys: torch.Tensor, valid: torch.Tensor):
    """The int8 sketch of every key row: (codes [B, Hkv, n, D] int8, scale [B, Hkv, n] float32, error [B, Hkv, n]
    float32). Row i decodes as k~_i = scale_i * codes_i, scale_i = max_d |k_id| / 127, and error_i bounds
    ||k_i - k~_i|| from above including fp32 rounding (`sketch_rounding`): with it, ||q|| error_i + scale_i
    (q.codes_i) computed in fp32 is at least q.k_i. Padding rows are all zero. keys: [B, Hkv, n, D] any float
    dtype (the radius is taken from the real key, in fp32); valid: [B, n] bool."""
    k = keys.float()
    row_scale = k.abs().amax(-1) / SKETCH_TOP  # [B, Hkv, n]; 0 for a zero row
    codes = (k / row_scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).round().clamp(-127, 127)
    sketch = codes * row_scale[..., None]
    pad = sketch_rounding(k.shape[-1])
    error = ((k - sketch).norm(dim=-1) * (1 + pad) + sketch.norm(dim=-1) * pad) * (1 + pad)
    live = valid[:, None, :]
    return (
        codes.to(torch.int8).masked_fill(~live[..., None], 0),
        row_scale.masked_fill(~live, 0.0),
        error.masked_fill(~live, 0.0),
    )


def sketch_logit_bounds(q, codes, row_scale, error, row_valid, scale: float):
    """(upper, lower) bounds of the scaled logits of every row, per query head: [B, Hq, n] float32 each, -inf
    for a padding row: scale (q.k~_i +- ||q|| e_i), widened by the slack. q: [B, Hq, D]; codes: [B, Hkv, n, D]
    int8; row_scale / error: [B, Hkv, n] (`key_sketch`); row_valid: [B, n] bool. On CUDA a Triton kernel
    computes the same (`kernels.gpu.sketch_bounds`), reading the codes as they are."""
    fused = ops.certify_sketch_bounds(q, codes, row_scale, error, row_valid, scale)
    if fused is not None:
        return fused
    batch, num_q_heads, dim = q.shape
    num_kv_heads, n = codes.shape[1], codes.shape[2]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    # [B, Hkv, G, n]: q.c_i (the codes are exact in fp32). On a CPU the codes convert a few MB at a time: one
    # fp32 copy of them all costs more, in page faults and memory traffic
    chunk = n if codes.is_cuda else max(256, SKETCH_CHUNK_BYTES // (4 * batch * num_kv_heads * dim))
    dots = torch.cat(
        [qg @ codes[:, :, r0 : r0 + chunk].float().transpose(-1, -2) for r0 in range(0, n, chunk)], -1
    )
    centre = dots * row_scale[:, :, None] * scale
    reach = qg.norm(dim=-1, keepdim=True) * error[:, :, None] * scale
    upper, lower = centre + reach, centre - reach
    upper = upper + SLACK_ABS + SLACK_REL * upper.abs()
    lower = lower - SLACK_ABS - SLACK_REL * lower.abs()
    padding = ~row_valid[:, None, None, :]
    return tuple(b.masked_fill(padding, -math.inf).view(batch, num_q_heads, n) for b in (upper, lower))


def sketch_mass_bounds(row_bounds: torch.Tensor, block_size: int) -> torch.Tensor:
    """log of a bound of each block's attention mass, the sum of its rows' exp(bound) (an upper bound from the
    upper row bounds, a lower one from the lower): [B, Hq, nb], -inf for a block without rows. row_bounds:
    [B, Hq, nb * block_size] (`sketch_logit_bounds`)."""
    batch, num_q_heads, n = row_bounds.shape
    return row_bounds.view(batch, num_q_heads, n // block_size, block_size).logsumexp(-1)


def logit_bounds(q, key_min, key_max, centre, radius, rows, scale: float, ball: bool = True) -> torch.Tensor:
    """Upper bounds of the scaled logits of every row of each block, per query head: [B, Hq, nb] float32, -inf
    for a block without rows. q: [B, Hq, D]; key_min / key_max / centre: [B, Hkv, nb, D]; radius: [B, Hkv, nb];
    rows: [B, nb]. `ball` False: the box bound alone (for comparison)."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads, nb = key_min.shape[1], key_min.shape[2]
    group = num_q_heads // num_kv_heads
    qg = q.float().view(batch, num_kv_heads, group, dim)
    empty = (rows == 0)[:, None, None, :]  # [B, 1, 1, nb]
    kmin = key_min.float().masked_fill(empty[:, :, 0, :, None], 0.0)
    kmax = key_max.float().masked_fill(empty[:, :, 0, :, None], 0.0)
    box = qg.clamp(min=0) @ kmax.transpose(-1, -2) + qg.clamp(max=0) @ kmin.transpose(
        -1, -2
    )  # [B, Hkv, G, nb]
    bound = box
    if ball:
        centred = (
            qg @ centre.float().transpose(-1, -2) + qg.norm(dim=-1, keepdim=True) * radius.float()[:, :, None]
        )
        bound = torch.minimum(box, centred)
    bound = bound * scale
    bound = bound + SLACK_ABS + SLACK_REL * bound.abs()
    return bound.masked_fill(empty, -math.inf).view(batch, num_q_heads, nb)


def ball_lower_mass(q, centre, radius, rows, scale: float) -> torch.Tensor:
    """log of a lower bound of each block's attention mass from its centre and radius digest: every row's logit is
    at least scale (q.c_b - ||q|| r_b), so the mass at least n_b times its exp. [B, Hq, nb], -inf for a block
    without rows. q: [B, Hq, D]; centre: [B, Hkv, nb, D]; radius: [B, Hkv, nb]; rows: [B, nb]."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads, nb = centre.shape[1], centre.shape[2]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    lower = qg @ centre.float().transpose(-1, -2) - qg.norm(dim=-1, keepdim=True) * radius.float()[:, :, None]
    lower = lower * scale
    lower = lower - SLACK_ABS - SLACK_REL * lower.abs()
    lower = lower.view(batch, num_q_heads, nb) + rows.clamp(min=1.0).log()[:, None, :]
    return lower.masked_fill((rows == 0)[:, None, :], -math.inf)


def mass_bounds(bounds: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """log(n_b) + u_b: the log of an upper bound of each block's attention mass, [B, Hq, nb] (-inf when empty)."""
    return bounds + rows.clamp(min=1.0).log()[:, None, :]


def hot_mass(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """log of the exact attention mass of the hot tier, per query head: [B, Hq]. keys: [B, Hkv, S, D]; valid:
    [B, S] bool."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    qg = q.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    logits = (qg @ keys.float().transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    logits = logits.masked_fill(~valid[:, None, None, :], -math.inf)
    return logits.logsumexp(-1).view(batch, num_q_heads)


def certified_blocks(
    mass: torch.Tensor,
    known_lse: torch.Tensor,
    epsilon: float,
    max_blocks,
    num_kv_heads: int,
    lower: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
):
    """The certified selection: (union [B, Hkv, n] bool, needed [B, Hq], kept [B, Hq]). A unit is a block, or,
    given per-row bounds, a row (`certified.unit`).

    mass: the log of each unit's upper mass bound [B, Hq, n] (-inf: a unit without rows); known_lse: [B, Hq] log
    of a lower bound of the hot tier's mass; lower: [B, Hq, n] the log of a lower bound of each unit's mass, or
    None. Each query head keeps its best units by `mass`, the fewest whose tail certifies p <= epsilon against
    the attended mass they give at least (the hot tier's plus, with `lower`, the kept units' lower bounds), at
    most `max_blocks` (`kept`; a head with kept < needed does not meet epsilon this step). A KV head attends the
    union of its group's units, so each head's certificate holds for the union too. max_blocks: an int, or a
    tensor broadcasting to [B, Hq].

    The ranking is a histogram, not a sort: units fall into buckets of BUCKET_NATS by how far their bound lies
    under the head's best (or the hot tier's mass), the tail and the attended mass are summed per bucket in
    float64, and a head keeps the fewest whole buckets, best first, that certify. That is the sorted prefix
    rounded up to a bucket boundary (its rows within BUCKET_NATS of the last one needed), for O(n) work instead
    of a sort: on a CPU a sort of 9 heads x 4K rows takes longer than the step's attention.

    forced: [B, Hkv, n] bool, units each KV head attends in any case (another rule's selection), or None.
    They are kept first for every head of the group, even past `max_blocks`; their lower bounds count toward the
    attended mass, `needed` and `kept` count them too, and the union holds them all.
    """
    batch, num_q_heads, n = mass.shape
    group = num_q_heads // num_kv_heads
    live = torch.isfinite(mass)
    if forced is None:
        first = torch.zeros_like(live)
    else:
        first = forced[:, :, None].expand(-1, -1, group, -1).reshape(batch, num_q_heads, n)
    free = live & ~first  # the units the histogram ranks
    top = torch.maximum(mass.masked_fill(~free, -math.inf).amax(-1), known_lse.float())
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).double()[..., None]  # [B, Hq, 1]
    rows = batch * num_q_heads
    tail, count, gained = ops.certify_histogram(
        mass.reshape(rows, n), None if lower is None else lower.reshape(rows, n), free.reshape(rows, n),
        top.reshape(rows),
    )  # fmt: skip
    tail, count = tail.view(batch, num_q_heads, BUCKETS), count.view(batch, num_q_heads, BUCKETS)
    known = (known_lse.double()[..., None] - top).exp()  # [B, Hq, 1]
    if lower is not None:
        if forced is not None:
            low = (lower.double() - top).exp().masked_fill(~(first & live), 0.0)
            known = known + low.sum(-1, keepdim=True)
        gained = gained.view(batch, num_q_heads, BUCKETS).cumsum(-1)
        known = torch.cat([known, known + gained], -1)  # [B, Hq, BUCKETS + 1]: keeping buckets [0, j)
    # what keeping buckets [0, j) leaves: summed from the far end (positive terms, no cancellation)
    tail = torch.cat([tail.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(tail[..., :1])], -1)
    # p <= eps <=> D <= eps / (1 - eps) W; a relative margin covers float64 rounding of the sums
    certifies = tail * (1.0 + TAIL_MARGIN) <= known * (epsilon / (1.0 - epsilon))  # true at j = BUCKETS
    forced_count = first.sum(-1, keepdim=True)
    units = torch.cat([forced_count, forced_count + count.cumsum(-1)], -1)  # [B, Hq, BUCKETS + 1]
    need_at = certifies.long().argmax(-1, keepdim=True)  # the first j that certifies
    most = torch.maximum(torch.as_tensor(max_blocks, device=mass.device), forced_count[..., 0])[..., None]
    cap_at = (units <= most).sum(-1, keepdim=True) - 1  # the last j within the cap (j = 0: forced units only)
    needed = units.gather(-1, need_at)[..., 0]
    take_at = torch.minimum(need_at, cap_at)
    bucket = ((top - mass.double()) / BUCKET_NATS).clamp(0, BUCKETS - 1).long()
    picked = first | (free & (bucket < take_at))
    union = picked.view(batch, num_kv_heads, group, n).any(dim=2)
    return union, needed, units.gather(-1, take_at)[..., 0]


def certified_rows(
    q, codes, row_scale, error, row_valid, scale: float, known_lse, epsilon: float, max_units, num_kv_heads: int,
    value_norm, block_size: int, forced=None,
):  # fmt: skip
    """The certified selection over single host rows, from the key sketch, with what its certificate needs:
    (union [B, Hkv, n] bool, needed [B, Hq] int64, kept [B, Hq] int64, tail_lse [B, Hq] float32, skipped_norm
    [B, Hkv] float32). The rows' bounds are `sketch_logit_bounds`, the selection `certified_blocks` with a row as
    the unit, and the rest `skipped_rows`. q: [B, Hq, D]; codes / row_scale / error: the sketch of n rows
    (`key_sketch`); row_valid: [B, n] bool; known_lse: [B, Hq]; max_units: an int or a tensor broadcasting to
    [B, Hq]; value_norm: [B, Hkv, n // block_size] each block's largest value norm; forced: [B, Hkv, n] bool rows
    kept in any case, or None. On CPU tensors the compiled kernel runs it (`tandem.kernels.cpu.certified_rows`),
    elsewhere `certified_rows_reference`."""
    args = (q, codes, row_scale, error, row_valid, scale, known_lse, epsilon, max_units, num_kv_heads, value_norm,
            block_size, forced)  # fmt: skip
    if ops.native_cpu_available() and not q.is_cuda and not codes.is_cuda and _cpu.has_certified_rows():
        return _cpu.certified_rows(*args)
    return certified_rows_reference(*args)


def certified_rows_reference(
    q, codes, row_scale, error, row_valid, scale: float, known_lse, epsilon: float, max_units, num_kv_heads: int,
    value_norm, block_size: int, forced=None,
):  # fmt: skip
    """`certified_rows` in plain torch (any device; graph-safe)."""
    upper, lower = sketch_logit_bounds(q, codes, row_scale, error, row_valid, scale)
    union, needed, kept = certified_blocks(upper, known_lse, epsilon, max_units, num_kv_heads, lower, forced)
    return (union, needed, kept, *skipped_rows(upper, union, row_valid, value_norm, block_size))


def skipped_rows(upper, union, row_valid, value_norm, block_size: int):
    """(tail_lse [B, Hq], skipped_norm [B, Hkv]): the log of the upper mass bound of the live rows outside `union`
    (-inf where none is skipped) and the largest value norm of the blocks holding one. upper: [B, Hq, n] the rows'
    bounds; union: [B, Hkv, n] bool; row_valid: [B, n]; value_norm: [B, Hkv, n // block_size]."""
    batch, num_q_heads, n = upper.shape
    num_kv_heads = union.shape[1]
    group = num_q_heads // num_kv_heads
    skipped = ~union & row_valid[:, None, :]
    per_head = skipped[:, :, None].expand(-1, -1, group, -1).reshape(batch, num_q_heads, n)
    tail = upper.masked_fill(~per_head, -math.inf).logsumexp(-1)
    in_block = skipped.view(batch, num_kv_heads, n // block_size, block_size).any(-1)
    return tail, value_norm.float().masked_fill(~in_block, 0.0).amax(-1)


def certificate_from_tail(tail_lse, skipped_norm, attended_lse, out):
    """(p [B, Hq], output bound [B, Hq]) from the skipped units' log mass bound tail_lse [B, Hq], the largest
    skipped value norm per KV head skipped_norm [B, Hkv], the exact log attended mass attended_lse [B, Hq] and the
    attended output out [B, Hq, D]: p = D / (W + D), and the output moves by at most p (max ||v|| + ||o||)."""
    batch, num_q_heads = tail_lse.shape
    group = num_q_heads // skipped_norm.shape[1]
    p = torch.sigmoid(tail_lse - attended_lse.float())  # 0 when nothing is skipped
    largest = skipped_norm[:, :, None].expand(-1, -1, group).reshape(batch, num_q_heads)
    return p, p * (largest + out.float().norm(dim=-1))


def skipped_blocks(mass, union, value_norm, rows):
    """(tail_lse [B, Hq], skipped_norm [B, Hkv]) of a block selection: the log of the mass bound of the blocks
    with rows outside `union` [B, Hkv, nb] (-inf where none is skipped) and their largest value norm. mass: [B, Hq,
    nb] (`mass_bounds`); value_norm: [B, Hkv, nb]; rows: [B, nb]."""
    batch, num_q_heads, nb = mass.shape
    num_kv_heads = union.shape[1]
    group = num_q_heads // num_kv_heads
    skipped = ~union & (rows > 0)[:, None, :]
    per_head = skipped[:, :, None].expand(-1, -1, group, -1).reshape(batch, num_q_heads, nb)
    tail = mass.masked_fill(~per_head, -math.inf).logsumexp(-1)
    return tail, value_norm.float().masked_fill(~skipped, 0.0).amax(-1)


def certificate(mass, union, value_norm, rows, attended_lse, out):
    """After the step: (p [B, Hq], output bound [B, Hq]) with `attended_lse` [B, Hq] the exact log mass of what
    was attended (hot tier and selection, merged) and `out` [B, Hq, D] its output. union: [B, Hkv, nb] bool the
    attended blocks; value_norm: [B, Hkv, nb]; rows: [B, nb]."""
    return certificate_from_tail(*skipped_blocks(mass, union, value_norm, rows), attended_lse, out)
