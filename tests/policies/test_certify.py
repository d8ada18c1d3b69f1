"""Soundness of the certified bounds (`tandem.policies.certify`): over random and adversarial keys and values
(float32 / bfloat16, GQA groups 1-8, ragged padding), the attention mass a selection skips and the output's
deviation from full attention never exceed the certificate, also where another rule's selection is kept first
(fluxion's, `forced`). One violation fails."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.policies import certify

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _keys(kind: str, shape, gen, dtype):
    if kind == "gaussian":
        x = torch.randn(shape, generator=gen)
    elif kind == "outliers":  # a few huge keys among small ones: the box bound is loose, the ball bound tight
        x = torch.randn(shape, generator=gen) * 0.1
        x.view(-1, shape[-1])[::7] *= 300.0
    elif kind == "aligned":  # keys nearly parallel to one direction, large logits
        direction = torch.randn(shape[-1], generator=gen)
        x = direction * (5 + torch.rand(shape[:-1] + (1,), generator=gen) * 20) + 0.01 * torch.randn(
            shape, generator=gen
        )
    else:  # "constant" blocks: zero radius
        x = torch.randn(shape[:-2] + (1, shape[-1]), generator=gen).expand(shape).clone()
    return x.to(dtype)


def _logits(q, keys, valid, scale):
    """The exact scaled logits [B, Hq, n] in float64, -inf at padding rows."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads, n = keys.shape[1], keys.shape[2]
    qg = q.double().view(batch, num_kv_heads, num_q_heads // num_kv_heads, dim)
    logits = (qg @ keys.double().transpose(-1, -2)) * scale
    return logits.masked_fill(~valid[:, None, None, :], -math.inf).view(batch, num_q_heads, n)


def _measure(q, hot_k, hot_v, hot_valid, keys, values, valid, union, block_size, scale):
    """Exact (p skipped, ||o_full - o_sparse||, lse of the attended part, o_sparse) per query head, in float64."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    rows = torch.cat([hot_k, keys], 2).double()
    vals = torch.cat([hot_v, values], 2).double()
    live = torch.cat([hot_valid, valid], 1)
    qg = q.double().view(batch, num_kv_heads, group, dim)
    logits = (qg @ rows.transpose(-1, -2)) * scale  # [B, Hkv, G, S + n]
    logits = logits.masked_fill(~live[:, None, None, :], -math.inf)
    host_attended = union[..., None].expand(-1, -1, -1, block_size).reshape(batch, num_kv_heads, -1)
    attended = torch.cat([torch.ones_like(hot_valid)[:, None].expand(-1, num_kv_heads, -1), host_attended], 2)
    sparse = logits.masked_fill(~attended[:, :, None, :], -math.inf)
    lse_full, lse_sparse = logits.logsumexp(-1), sparse.logsumexp(-1)
    o_full = torch.softmax(logits, -1) @ vals
    o_sparse = torch.softmax(sparse, -1) @ vals
    p = 1 - torch.exp(lse_sparse - lse_full)
    deviation = (o_full - o_sparse).norm(dim=-1)
    shape = (batch, num_q_heads)
    return (
        p.view(shape),
        deviation.view(shape),
        lse_sparse.view(shape),
        o_sparse.reshape(batch, num_q_heads, dim),
    )


@SETTINGS
@given(
    batch=st.integers(1, 2),
    num_kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4, 8]),
    dim=st.sampled_from([4, 16]),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kind=st.sampled_from(["gaussian", "outliers", "aligned", "constant"]),
    q_scale=st.sampled_from([0.1, 1.0, 8.0]),
    epsilon=st.sampled_from([0.001, 0.05, 0.3]),
    max_share=st.sampled_from([0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
    pad=st.integers(0, 20),
    bound=st.sampled_from(["digest", "sketch"]),
    use_lower=st.booleans(),
    forced_share=st.sampled_from([None, 0.0, 0.3, 1.0]),
)
def test_the_certificate_bounds_the_measured_skip_and_deviation(
    batch,
    num_kv_heads,
    group,
    dim,
    num_blocks,
    block_size,
    dtype,
    kind,
    q_scale,
    epsilon,
    max_share,
    seed,
    pad,
    bound,
    use_lower,
    forced_share,
):
    gen = torch.Generator().manual_seed(seed)
    num_q_heads, n = num_kv_heads * group, num_blocks * block_size
    q = (torch.randn(batch, num_q_heads, dim, generator=gen) * q_scale).to(dtype)
    keys = _keys(kind, (batch, num_kv_heads, n, dim), gen, dtype)
    values = (torch.randn(batch, num_kv_heads, n, dim, generator=gen) * (1 + 10 * (kind == "outliers"))).to(
        dtype
    )
    valid = torch.ones(batch, n, dtype=torch.bool)
    valid[-1, : min(pad, n)] = False  # left padding of a ragged batch: whole blocks may be empty
    hot_k = torch.randn(batch, num_kv_heads, 5, dim, generator=gen).to(dtype)
    hot_v = torch.randn(batch, num_kv_heads, 5, dim, generator=gen).to(dtype)
    hot_valid = torch.ones(batch, 5, dtype=torch.bool)
    scale = dim**-0.5

    centre, radius, value_norm, rows = certify.block_digest(keys, values, valid, block_size)
    live = valid[:, None, :, None]
    view = (batch, num_kv_heads, num_blocks, block_size, dim)
    key_min = keys.masked_fill(~live, math.inf).view(view).amin(3)
    key_max = keys.masked_fill(~live, -math.inf).view(view).amax(3)
    logits = _logits(q, keys, valid, scale)
    if bound == "sketch":
        upper, lower = certify.sketch_logit_bounds(q, *certify.key_sketch(keys, valid), valid, scale)
        assert torch.all(upper.double() >= logits), "a row over its upper bound"
        assert torch.all(lower.double() <= logits), "a row under its lower bound"
        mass, lower = (certify.sketch_mass_bounds(b, block_size) for b in (upper, lower))
    else:
        mass = certify.mass_bounds(
            certify.logit_bounds(q, key_min, key_max, centre, radius, rows, scale), rows
        )
        lower = certify.ball_lower_mass(q, centre, radius, rows, scale)
    block_mass = logits.view(batch, num_q_heads, num_blocks, block_size).logsumexp(-1)
    assert torch.all(lower.double() <= block_mass) and torch.all(mass.double() >= block_mass)
    hot = certify.hot_mass(q, hot_k, hot_valid, scale)
    max_blocks = max(1, math.ceil(max_share * num_blocks))
    # another rule's selection (fluxion's), kept in any case: a random share of each KV head's blocks
    forced = None
    if forced_share is not None:
        forced = torch.rand(batch, num_kv_heads, num_blocks, generator=gen) < forced_share
    union, needed, kept = certify.certified_blocks(
        mass, hot, epsilon, max_blocks, num_kv_heads, lower if use_lower else None, forced
    )
    cap = torch.tensor(max_blocks)
    if forced is None:
        _, needed_hot_only, _ = certify.certified_blocks(mass, hot, epsilon, max_blocks, num_kv_heads)
        assert torch.all(needed <= needed_hot_only), "the kept blocks' lower bounds can only lower the need"
    else:
        assert torch.all(union[forced]), "a forced block was dropped"
        cap = torch.maximum(cap, forced.sum(-1).repeat_interleave(group, dim=1))  # [B, Hq]

    p, deviation, attended_lse, out = _measure(
        q, hot_k, hot_v, hot_valid, keys, values, valid, union, block_size, scale
    )
    p_cert, bound = certify.certificate(mass, union, value_norm, rows, attended_lse.float(), out.float())
    assert torch.all(p <= p_cert.double() + 1e-6), (p, p_cert)
    assert torch.all(deviation <= bound.double() * (1 + 1e-4) + 1e-5), (deviation, bound)
    met = needed <= cap
    assert torch.all(p_cert[met] <= epsilon * (1 + 1e-4)), (
        "a head that met epsilon at selection has a larger bound"
    )
    assert torch.all(kept <= cap)


def test_the_ball_bound_is_tighter_than_the_box_on_isotropic_keys_and_never_looser():
    """Keys spread alike in every one of 128 dims: the box widens in each dim (about sqrt(2 D / pi) of its half
    width adds up), the ball grows with the radius only."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 64, 128, generator=gen) + 3.0
    values, valid = torch.randn_like(keys), torch.ones(1, 64, dtype=torch.bool)
    q = torch.randn(1, 4, 128, generator=gen)
    centre, radius, _, rows = certify.block_digest(keys, values, valid, 16)
    view = keys.view(1, 1, 4, 16, 128)
    box = certify.logit_bounds(q, view.amin(3), view.amax(3), centre, radius, rows, 1.0, ball=False)
    both = certify.logit_bounds(q, view.amin(3), view.amax(3), centre, radius, rows, 1.0)
    assert torch.all(both <= box) and torch.all(both < box - 1.0)


def test_an_epsilon_met_by_the_hot_tier_alone_selects_nothing_and_a_tiny_one_selects_more():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 128, 16, generator=gen)
    values, valid = torch.randn_like(keys), torch.ones(1, 128, dtype=torch.bool)
    q = torch.randn(1, 4, 16, generator=gen)
    centre, radius, _, rows = certify.block_digest(keys, values, valid, 8)
    view = keys.view(1, 2, 16, 8, 16)
    mass = certify.mass_bounds(
        certify.logit_bounds(q, view.amin(3), view.amax(3), centre, radius, rows, 0.25), rows
    )
    huge_hot = torch.full((1, 4), 50.0)  # the hot tier holds e^50: nothing on the host can matter
    union, needed, _ = certify.certified_blocks(mass, huge_hot, 0.01, 16, 2)
    assert not union.any() and torch.all(needed == 0)
    small_hot = torch.full((1, 4), 0.0)
    loose, _, _ = certify.certified_blocks(mass, small_hot, 0.5, 16, 2)
    tight, needed, kept = certify.certified_blocks(mass, small_hot, 1e-4, 16, 2)
    assert loose.sum() <= tight.sum() and torch.all(needed == kept)
    capped, needed, kept = certify.certified_blocks(mass, small_hot, 1e-4, 2, 2)
    assert torch.all(kept <= 2) and torch.any(needed > 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hot_mass_is_the_log_sum_of_exp_logits_over_valid_slots(dtype):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 8, generator=gen).to(dtype)
    keys = torch.randn(2, 2, 6, 8, generator=gen).to(dtype)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    got = certify.hot_mass(q, keys, valid, 0.5)
    for b in range(2):
        for h in range(4):
            logits = (keys[b, h // 2].float() @ q[b, h].float()) * 0.5
            assert got[b, h].item() == pytest.approx(logits[valid[b]].logsumexp(0).item(), rel=1e-5)


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_the_sketch_bound_survives_fp32_rounding_of_large_cancelling_dot_products(dim):
    """Keys the sketch holds exactly (integers up to 127: error radius 0) and a huge query made orthogonal to each
    in float64: q.k is ~0 while fp32 sums terms of ~1e8, so its rounding error dwarfs the logit slack. Only
    the radius' rounding padding (`certify.sketch_rounding`) keeps the bound above the truth."""
    gen = torch.Generator().manual_seed(dim)
    keys = torch.randint(-127, 128, (1, 1, 64, dim), generator=gen).float()
    keys[..., 0] = 127  # every row's scale is exactly 1
    valid = torch.ones(1, 64, dtype=torch.bool)
    q0 = torch.randn(64, dim, generator=gen, dtype=torch.float64) * 1e6
    k64 = keys[0, 0].double()
    orthogonal = q0 - (q0 * k64).sum(-1, keepdim=True) / (k64 * k64).sum(-1, keepdim=True) * k64
    codes, row_scale, error = certify.key_sketch(keys, valid)
    assert torch.equal(codes.float(), keys) and torch.all(row_scale == 1.0)
    for i in range(64):  # one query per key, each against all 64 rows
        q = orthogonal[i].float().view(1, 1, dim)
        upper, lower = certify.sketch_logit_bounds(q, codes, row_scale, error, valid, 1.0)
        truth = _logits(q, keys, valid, 1.0)
        assert torch.all(upper.double() >= truth), (i, (truth - upper.double()).max())
        assert torch.all(lower.double() <= truth), (i, (lower.double() - truth).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sketch_bound_is_tight_where_the_block_digests_are_not(dtype):
    """Rotating keys of many spread dims (post-RoPE-like): the block digests over-state a block's mass by
    orders of magnitude, the per-row sketch by some 20%; both stay above it."""
    gen = torch.Generator().manual_seed(3)
    batch, kv_heads, group, n, dim, block = 1, 2, 4, 256, 64, 16
    keys = (torch.randn(batch, kv_heads, n, dim, generator=gen) * 2.0 + 0.5).to(dtype)
    valid = torch.ones(batch, n, dtype=torch.bool)
    q = (torch.randn(batch, kv_heads * group, dim, generator=gen) * 2.0).to(dtype)
    scale = dim**-0.5
    truth = _logits(q, keys, valid, scale).view(batch, kv_heads * group, n // block, block).logsumexp(-1)
    sketch = certify.sketch_mass_bounds(
        certify.sketch_logit_bounds(q, *certify.key_sketch(keys, valid), valid, scale)[0], block
    ).double()
    centre, radius, _, rows = certify.block_digest(keys, keys, valid, block)
    view = keys.view(batch, kv_heads, n // block, block, dim)
    digest = certify.mass_bounds(
        certify.logit_bounds(q, view.amin(3), view.amax(3), centre, radius, rows, scale), rows
    ).double()
    assert torch.all(sketch >= truth) and torch.all(digest >= truth)
    over = (sketch - truth).exp()
    assert over.median() < 1.3 and over.max() < 1.5, "the sketch over-states a block's mass by more than 50%"
    assert (digest - truth).exp().median() > 100.0


def test_key_sketch_zeroes_padding_rows_and_keeps_zero_keys_exact():
    keys = torch.randn(2, 1, 8, 4, generator=torch.Generator().manual_seed(4))
    keys[0, 0, 3] = 0.0
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, :5] = False
    codes, row_scale, error = certify.key_sketch(keys, valid)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert row_scale[0, 0, 3] == 0 and error[0, 0, 3] == 0 and torch.all(codes[0, 0, 3] == 0)
    for part in (codes, row_scale, error):
        assert torch.all(part[1, :, :5] == 0)
    decoded = codes.float() * row_scale[..., None]
    assert torch.all((keys - decoded).norm(dim=-1)[valid[:, None]] <= error[valid[:, None]])
    assert torch.all(error[valid[:, None]] <= row_scale[valid[:, None]] * 4**0.5 / 2 * 1.01 + 1e-30)


def test_row_units_keep_the_heavy_rows_where_blocks_keep_their_whole_blocks():
    """Three planted rows hold almost all of each head's host mass, in three different blocks: certified over
    rows (the sketch's per-row bounds as units) the selection keeps about those rows; over blocks it keeps their
    three whole blocks. Both meet epsilon, and the measured skipped share of each stays under its certificate."""
    gen = torch.Generator().manual_seed(7)
    batch, kv_heads, group, n, dim, block = 1, 2, 2, 256, 32, 16
    keys = torch.randn(batch, kv_heads, n, dim, generator=gen) * 0.1
    q = torch.randn(batch, kv_heads * group, dim, generator=gen)
    heavy = torch.tensor([5, 100, 200])  # rows in blocks 0, 6 and 12
    keys[:, :, heavy] = q.view(batch, kv_heads, group, dim).mean(2)[:, :, None] * 6.0
    valid = torch.ones(batch, n, dtype=torch.bool)
    scale = dim**-0.5
    upper, lower = certify.sketch_logit_bounds(q, *certify.key_sketch(keys, valid), valid, scale)
    known = torch.zeros(batch, kv_heads * group)  # a hot tier of mass 1
    epsilon = 0.05
    rows, needed_rows, kept_rows = certify.certified_blocks(upper, known, epsilon, n, kv_heads, lower)
    blocks, _, _ = certify.certified_blocks(
        certify.sketch_mass_bounds(upper, block), known, epsilon, n // block, kv_heads,
        certify.sketch_mass_bounds(lower, block),
    )  # fmt: skip
    assert torch.all(needed_rows == kept_rows)  # met
    assert rows[:, :, heavy].all() and 3 <= int(rows.sum(-1).max()) <= 12
    assert blocks[:, :, heavy // block].all() and int(blocks.sum(-1).min()) >= 3
    assert int(rows.sum()) < int(blocks.sum()) * block // 4
    truth = _logits(q, keys, valid, scale)  # [B, Hq, n] exact, float64
    per_head = rows[:, :, None].expand(-1, -1, group, -1).reshape(batch, kv_heads * group, n)
    skipped = truth.masked_fill(per_head, -math.inf).logsumexp(-1)
    attended = torch.logaddexp(known.double(), truth.masked_fill(~per_head, -math.inf).logsumexp(-1))
    assert torch.all(torch.sigmoid(skipped - attended) <= epsilon)
