"""Fluxion's offline search (`tandem.policies.fluxion_search`) against hand-computed numbers and brute force: Eq. 1
(the budget law fit), Eq. 2 (minimum budgets) and the block digests (Fluxion §5.2). The rules the policy
applies at decode time are in tests/policies/test_granularity.py."""

import math

import pytest
import torch

from tandem.kernels.reference import coarsen_digest
from tandem.policies.fluxion_search import (
    block_digests,
    budget_at,
    fit_budget_law,
    min_budgets,
    prefix_errors,
)

BLOCKS = (1, 16, 32, 64, 128)


# ---- Eq. 1: bgt(blk) = bgt0 + k log2(blk) ------------------------------------------------------------------
def test_budgets_on_a_line_give_back_its_intercept_and_slope():
    # bgt0 = 0.1, k = 0.02: 0.1 + 0.02 * (0, 4, 5, 6, 7)
    budgets = torch.tensor([0.1, 0.18, 0.2, 0.22, 0.24])
    bgt0, k = fit_budget_law(budgets, BLOCKS)
    assert bgt0.item() == pytest.approx(0.1, abs=1e-7)
    assert k.item() == pytest.approx(0.02, abs=1e-7)
    for block in BLOCKS:
        assert budget_at(bgt0, k, block).item() == pytest.approx(0.1 + 0.02 * math.log2(block), abs=1e-6)


def test_least_squares_slope_through_the_measured_finest_budget():
    # bgt0 is pinned to the budget at blk = 1; k = sum((b - bgt0) x) / sum(x^2) with x = log2(blk) = 0, 4, 5, 6, 7:
    # (0.2*4 + 0.2*5 + 0.4*6 + 0.4*7) / (16 + 25 + 36 + 49) = 7 / 126 = 1 / 18
    budgets = torch.tensor([[0.1, 0.3, 0.3, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    bgt0, k = fit_budget_law(budgets, BLOCKS)
    torch.testing.assert_close(bgt0, torch.tensor([0.1, 0.0]))
    torch.testing.assert_close(k, torch.tensor([1 / 18, 0.0]))
    # a batch of heads: [2, 3, 5] -> [2, 3]
    many = budgets[:, None].expand(2, 3, 5)
    bgt0, k = fit_budget_law(many, BLOCKS)
    assert bgt0.shape == k.shape == (2, 3)
    torch.testing.assert_close(k[0], torch.full((3,), 1 / 18))


def test_budget_at_is_clamped_to_the_unit_interval():
    bgt0 = torch.tensor([0.1, 0.9, 0.1])
    k = torch.tensor([0.02, 0.1, -0.05])
    torch.testing.assert_close(budget_at(bgt0, k, 16), torch.tensor([0.18, 1.0, 0.0]))
    torch.testing.assert_close(budget_at(bgt0, k, 1), torch.tensor([0.1, 0.9, 0.1]))
    torch.testing.assert_close(budget_at(bgt0, k, 128), torch.tensor([0.24, 1.0, 0.0]))
    # block sizes as a tensor broadcast against the heads
    per_block = budget_at(bgt0[:, None], k[:, None], torch.tensor([16, 128]))
    torch.testing.assert_close(per_block, torch.tensor([[0.18, 0.24], [1.0, 1.0], [0.0, 0.0]]))


@pytest.mark.parametrize("blocks", [(16, 32, 64, 128), (2, 16), (1,)])
def test_fit_refuses_blocks_not_starting_at_one(blocks):
    with pytest.raises(ValueError, match="must start at 1"):
        fit_budget_law(torch.zeros(len(blocks)), blocks)


# ---- coarse digests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,factor", [(112, 4), (112, 2), (112, 8), (27, 2), (61, 4), (113, 2), (113, 8)])
def test_coarsened_digests_equal_digests_built_at_the_coarse_size(rows, factor):
    g = torch.Generator().manual_seed(rows * factor)
    keys = torch.randn(3, 2, rows, 8, generator=g)
    mask = torch.ones(3, rows, dtype=torch.bool)
    mask[1, :21] = False  # a whole 16-block of padding and part of the next
    mask[2, : min(rows, 16 * factor + 3)] = False  # a whole coarse block of padding
    fine = block_digests(keys, mask, 16)
    assert fine[0].shape == (3, 2, -(-rows // 16), 8)
    coarse = coarsen_digest(*fine, factor)
    direct = block_digests(keys, mask, 16 * factor)
    assert coarse[0].shape == direct[0].shape == (3, 2, -(-rows // (16 * factor)), 8)
    assert torch.equal(coarse[0], direct[0]) and torch.equal(coarse[1], direct[1])
    # padding excluded: an all-padding block is (+inf, -inf), a real one finite
    assert torch.isinf(direct[0][2, :, 0]).all() and (direct[0][2, :, 0] > 0).all()
    assert torch.isfinite(direct[0][0]).all()


# ---- Eq. 2: minimum budgets, against brute force --------------------------------------------------------------
def _attend(q, keys, values):
    """Softmax attention of one query over rows, float64."""
    weights = torch.softmax(keys @ q, dim=0)
    return weights @ values


def brute_prefix_errors(q, hot, cpu, scale, block):
    """Eq. 2 the slow way: per request and head, rank host blocks by the head's own Quest bound (the exact logit at
    blk = 1), attend hot + the best j blocks, and normalise by the request's largest full output."""
    k_hot, v_hot, m_hot = (t.double() if t.is_floating_point() else t for t in hot)
    k_cpu, v_cpu, m_cpu = (t.double() if t.is_floating_point() else t for t in cpu)
    q = q.double()
    batch, num_q_heads, _ = q.shape
    group = num_q_heads // k_cpu.shape[1]
    rows = k_cpu.shape[2]
    nblk = -(-rows // block)
    errors = torch.zeros(batch, num_q_heads, nblk + 1, dtype=torch.float64)
    attended = torch.zeros(batch, num_q_heads, nblk + 1, dtype=torch.long)
    for b in range(batch):
        full = []
        for h in range(num_q_heads):
            kv = h // group
            keys = torch.cat([k_hot[b, kv][m_hot[b]], k_cpu[b, kv][m_cpu[b]]]) * scale
            full.append(_attend(q[b, h], keys, torch.cat([v_hot[b, kv][m_hot[b]], v_cpu[b, kv][m_cpu[b]]])))
        norm = max(o.norm() for o in full)
        for h in range(num_q_heads):
            kv = h // group
            spans = [range(i * block, min(rows, (i + 1) * block)) for i in range(nblk)]
            bounds = []
            for span in spans:
                real = [r for r in span if m_cpu[b, r]]
                if not real:
                    bounds.append(-math.inf)
                    continue
                kb = k_cpu[b, kv, real]
                bounds.append(float(torch.maximum(q[b, h] * kb.amin(0), q[b, h] * kb.amax(0)).sum()))
            order = sorted(range(nblk), key=lambda i: -bounds[i])
            for j in range(nblk + 1):
                picked = [r for i in order[:j] for r in spans[i] if m_cpu[b, r]]
                keys = torch.cat([k_hot[b, kv][m_hot[b]], k_cpu[b, kv, picked]]) * scale
                values = torch.cat([v_hot[b, kv][m_hot[b]], v_cpu[b, kv, picked]])
                errors[b, h, j] = (_attend(q[b, h], keys, values) - full[h]).norm() / norm
                attended[b, h, j] = len(picked)
    return errors, attended


def _segments(group, hot_rows=24, cpu_rows=61, head_dim=8, seed=0):
    """Random q and (hot, cpu) segments of 2 requests, 2 KV heads; request 1 has padding in both segments
    (the whole first 16-block of its host segment and part of the next)."""
    g = torch.Generator().manual_seed(seed)
    num_kv_heads = 2

    def segment(rows):
        keys = torch.randn(2, num_kv_heads, rows, head_dim, generator=g)
        values = torch.randn(2, num_kv_heads, rows, head_dim, generator=g)
        return keys, values, torch.ones(2, rows, dtype=torch.bool)

    hot, cpu = segment(hot_rows), segment(cpu_rows)
    hot[2][1, :5] = False
    cpu[2][1, :21] = False
    q = torch.randn(2, num_kv_heads * group, head_dim, generator=g) * 2.0  # sharp enough that budgets vary
    return q, hot, cpu, head_dim**-0.5


def _suffix_budget(errors, rows, real_rows, tau):
    """Smallest j from which every prefix j' >= j has error <= tau, as a share of the real host rows."""
    n = errors.shape[-1]
    j = n - 1
    while j > 0 and errors[j - 1] <= tau:
        j -= 1
    return rows[j].item() / real_rows, j


@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_prefix_errors_match_brute_force(block, group):
    q, hot, cpu, scale = _segments(group)
    errors, rows = prefix_errors(q, hot, cpu, scale, block)
    expected, expected_rows = brute_prefix_errors(q, hot, cpu, scale, block)
    assert errors.shape == (2, 2 * group, -(-61 // block) + 1)
    assert torch.isfinite(errors).all()
    torch.testing.assert_close(errors.double(), expected, atol=2e-5, rtol=1e-4)
    assert torch.equal(rows, expected_rows)
    assert (errors[..., -1] == 0).all()  # the full prefix is full attention
    assert torch.equal(rows[..., -1], cpu[2].sum(-1)[:, None].expand(-1, 2 * group))


@pytest.mark.parametrize("group", [1, 3])
def test_min_budgets_follow_the_suffix_rule(group):
    q, hot, cpu, scale = _segments(group, seed=1)
    taus = (0.0, 0.01, 0.05, 0.2)
    blocks = (1, 16)
    budgets, streaming_error = min_budgets(q, hot, cpu, scale, blocks, taus)
    assert budgets.shape == (2, 2 * group, 2, 4)
    real_rows = cpu[2].sum(-1)
    saw_partial = False
    for bi, block in enumerate(blocks):
        errors, rows = prefix_errors(q, hot, cpu, scale, block)
        brute, _ = brute_prefix_errors(q, hot, cpu, scale, block)
        for b in range(2):
            for h in range(2 * group):
                for t, tau in enumerate(taus):
                    want, j = _suffix_budget(errors[b, h], rows[b, h], real_rows[b].item(), tau)
                    assert budgets[b, h, bi, t].item() == pytest.approx(want, abs=1e-6)
                    # the budget meets tau and so does every larger prefix (brute force, up to float32 rounding)
                    assert (brute[b, h, j:] <= tau + 1e-5).all()
                    # and the prefix just below it does not (else a smaller budget would have been returned)
                    if j > 0:
                        assert brute[b, h, j - 1] > tau - 1e-5
                    saw_partial |= 0.0 < want < 1.0
                    if tau == 0.0:
                        assert budgets[b, h, bi, t].item() == 1.0  # random keys: every block has some weight
        # budgets grow with tau
        assert (budgets[:, :, bi].diff(dim=-1) <= 1e-7).all()
    assert saw_partial  # the data exercises the rule, not only budgets 0 and 1
    brute0, _ = brute_prefix_errors(q, hot, cpu, scale, 16)
    torch.testing.assert_close(streaming_error.double(), brute0[..., 0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block", [1, 16])
def test_tau_zero_skips_only_blocks_of_exactly_zero_weight(block):
    # group 1: the last host 16-block's keys point against the query, their weight underflows to exactly 0
    g = torch.Generator().manual_seed(5)
    head_dim = 8
    q = torch.randn(1, 1, head_dim, generator=g)
    hot = (torch.randn(1, 1, 8, head_dim, generator=g), torch.randn(1, 1, 8, head_dim, generator=g))
    hot = (*hot, torch.ones(1, 8, dtype=torch.bool))
    keys = torch.randn(1, 1, 64, head_dim, generator=g)
    keys[:, :, 48:] = -200.0 * q[:, :, None] / q.norm()
    cpu = (keys, torch.randn(1, 1, 64, head_dim, generator=g), torch.ones(1, 64, dtype=torch.bool))
    budgets, streaming_error = min_budgets(q, hot, cpu, head_dim**-0.5, (block,), (0.0,))
    assert budgets.item() == 0.75
    assert streaming_error.item() > 0


def test_min_budgets_with_no_host_row_are_zero():
    q, hot, cpu, scale = _segments(1)
    cpu = (cpu[0], cpu[1], torch.zeros_like(cpu[2]))
    budgets, streaming_error = min_budgets(q, hot, cpu, scale, (1, 16), (0.0, 0.1))
    assert (budgets == 0).all() and (streaming_error == 0).all()
