"""Fluxion's decode-time rules (`tandem.policies.granularity`) against hand-computed numbers: the per-head
budgets of Eq. 1, Eq. 3 (data volume and the granularity it picks) and the per-group block selection
(Fluxion §5.3). The offline search that fits the budgets is in tests/policies/test_fluxion_search.py."""

import math

import pytest
import torch

from tandem.policies.granularity import (
    blocks_for_budget,
    choose_granularity,
    data_volume,
    head_budgets,
    ids_selection,
    mask_to_ids,
    select_blocks,
)

SELECTION = (16, 32, 64, 128)


# ---- Eq. 1 at each selectable block size -------------------------------------------------------------------
def test_head_budgets_are_eq1_at_each_block_size_and_zero_for_inactive_heads():
    bgt0 = torch.tensor([[0.1, 0.5]])
    k = torch.tensor([[0.02, 0.1]])
    active = torch.tensor([[True, False]])
    budgets = head_budgets(bgt0, k, active, SELECTION)
    torch.testing.assert_close(budgets, torch.tensor([[[0.18, 0.2, 0.22, 0.24], [0.0, 0.0, 0.0, 0.0]]]))


# ---- Eq. 3: V(blk) = 2 L / blk + 2 L sum_h bgt_h(blk) ------------------------------------------------------
def _in_1024ths(*rows):
    """Budgets given as multiples of 1/1024 (exact in float32): with L = 1024, 2 L bgt = 2 m."""
    return torch.tensor(rows, dtype=torch.float32) / 1024


def test_data_volume_and_choice_by_hand():
    host_rows = torch.tensor([1024])
    blocks = torch.tensor(SELECTION)
    budgets = _in_1024ths(
        # group 0: sums m = 64, 20, 56, 100 -> V = 128 + 128, 64 + 40, 32 + 112, 16 + 200 -> 32
        [40, 10, 30, 60],
        [24, 10, 26, 40],
        # group 1: sums m = 60, 40, 20, 8 -> V = 128 + 120, 64 + 80, 32 + 40, 16 + 16 -> 128
        [30, 20, 10, 4],
        [30, 20, 10, 4],
        # group 2: sums m = 64, 40, 56, 100 -> V = 256, 144, 144, 216: a tie, the smaller block wins -> 32
        [40, 20, 30, 60],
        [24, 20, 26, 40],
    )[None]
    volume = data_volume(budgets, host_rows, blocks, num_kv_heads=3)
    expected = torch.tensor(
        [[[256.0, 104.0, 144.0, 216.0], [248.0, 144.0, 72.0, 32.0], [256.0, 144.0, 144.0, 216.0]]]
    )
    assert volume.dtype == torch.float32
    torch.testing.assert_close(volume, expected, atol=0, rtol=0)
    choice = choose_granularity(budgets, host_rows, blocks, num_kv_heads=3)
    assert [SELECTION[i] for i in choice[0].tolist()] == [32, 128, 32]


def test_data_volume_per_request_host_rows():
    # the same budgets over L = 1024 and L = 256: only the per-request scale changes
    budgets = _in_1024ths([40, 10, 30, 60], [24, 10, 26, 40])[None].expand(2, -1, -1)
    volume = data_volume(budgets, torch.tensor([1024, 256]), torch.tensor(SELECTION), num_kv_heads=1)
    torch.testing.assert_close(volume[0], torch.tensor([[256.0, 104.0, 144.0, 216.0]]))
    torch.testing.assert_close(volume[1], volume[0] / 4)
    # a group with no retrieval head reads only digests: the coarsest block is cheapest
    zero = torch.zeros(1, 2, 4)
    assert SELECTION[choose_granularity(zero, torch.tensor([1024]), torch.tensor(SELECTION), 1).item()] == 128


# ---- per-group selection ---------------------------------------------------------------------------------------
# six 16-token base blocks, D = 1; a head with q = +1 ranks blocks by key max, one with q = -1 by -(key min)
KMAX = [6.0, 1.0, 5.0, 2.0, 3.0, 4.0]
KMIN = [-1.0, -6.0, -2.0, -3.0, -4.0, -5.0]  # -kmin: 1, 6, 2, 3, 4, 5


def _digests(num_kv_heads=1, kmin=KMIN, kmax=KMAX):
    key_min = torch.tensor(kmin)[None, None, :, None].expand(2, num_kv_heads, -1, 1).contiguous()
    key_max = torch.tensor(kmax)[None, None, :, None].expand(2, num_kv_heads, -1, 1).contiguous()
    return key_min, key_max


def _chosen(mask):
    return [[torch.nonzero(m).flatten().tolist() for m in per_b] for per_b in mask]


def test_select_blocks_by_hand():
    q = torch.tensor([[[1.0], [-1.0]]]).expand(2, -1, -1)  # one group of two heads
    key_min, key_max = _digests()
    host_rows = torch.tensor([96, 96])
    # budgets at (16, 32); request 0 uses blk 16, request 1 blk 32
    budgets = torch.tensor([[[0.3, 0.3], [0.1, 0.4]]]).expand(2, -1, -1)
    choice = torch.tensor([[0], [1]])
    mask = select_blocks(q, key_min, key_max, budgets, choice, host_rows, (16, 32), 16)
    assert mask.shape == (2, 1, 6) and mask.dtype == torch.bool
    # blk 16: head 0 takes ceil(0.3 * 96 / 16) = 2 blocks by kmax -> {0, 2}; head 1 ceil(0.6) = 1 by -kmin -> {1}
    # blk 32: logical blocks (0,1) (2,3) (4,5); head 0 ceil(0.9) = 1 by kmax (6, 5, 4) -> L0;
    #         head 1 ceil(1.2) = 2 by -kmin (6, 3, 5) -> L0, L2 -> base {0, 1, 4, 5}
    assert _chosen(mask) == [[[0, 1, 2]], [[0, 1, 4, 5]]]
    assert blocks_for_budget(0.3, 96, 16) == 2 and blocks_for_budget(0.4, 96, 32) == 2
    ids = mask_to_ids(mask)
    assert ids.tolist() == [[[0, 1, 2, 6, 6, 6]], [[0, 1, 4, 5, 6, 6]]]


def test_select_blocks_zero_budgets_and_idle_groups():
    # two KV groups of two heads; group 1's heads are inactive (budget 0), in group 0 head 1 has budget 0
    q = torch.tensor([[[1.0], [-1.0], [1.0], [-1.0]]]).expand(2, -1, -1)
    key_min, key_max = _digests(num_kv_heads=2)
    budgets = torch.zeros(2, 4, 2)
    budgets[:, 0] = 0.3
    choice = torch.tensor([[0, 0], [1, 1]])
    mask = select_blocks(q, key_min, key_max, budgets, choice, torch.tensor([96, 96]), (16, 32), 16)
    assert _chosen(mask) == [[[0, 2], []], [[0, 1], []]]
    assert mask_to_ids(mask)[:, 1].eq(6).all()


def test_select_blocks_partial_logical_block_and_empty_blocks():
    # seven base blocks at blk 32: the last logical block holds base block 6 only; base block 3 is all padding
    # (+inf, -inf) and must never be picked even when the budget asks for everything
    kmax = [6.0, 1.0, 5.0, -math.inf, 3.0, 4.0, 9.0]
    kmin = [-1.0, -6.0, -2.0, math.inf, -4.0, -5.0, 0.0]
    key_min, key_max = _digests(kmin=kmin, kmax=kmax)
    q = torch.tensor([[[1.0]]]).expand(2, -1, -1)
    budgets = torch.tensor([[[1 / 7, 1 / 7]], [[1.0, 1.0]]])  # request 0: one block; request 1: everything
    choice = torch.tensor([[1], [0]])
    mask = select_blocks(q, key_min, key_max, budgets, choice, torch.tensor([112, 112]), (16, 32), 16)
    # request 0, blk 32: ceil(112 / 7 / 32) = 1 logical block, the best by kmax is L3 = base block 6 alone
    # request 1, blk 16: every base block but the empty one
    assert _chosen(mask) == [[[6]], [[0, 1, 2, 4, 5, 6]]]
    assert mask_to_ids(mask).tolist() == [[[6, 7, 7, 7, 7, 7, 7]], [[0, 1, 2, 4, 5, 6, 7]]]


def test_mask_to_ids():
    mask = torch.tensor(
        [[[True, False, True, False], [False, False, False, False], [False, True, True, True]]]
    )
    assert mask_to_ids(mask).tolist() == [[[0, 2, 4, 4], [4, 4, 4, 4], [1, 2, 3, 4]]]
    full = torch.ones(1, 2, 3, dtype=torch.bool)
    full[0, 1, 2] = False  # one row with nothing left out, one with its last entry left out
    assert mask_to_ids(full).tolist() == [[[0, 1, 2], [0, 1, 3]]]
    assert mask_to_ids(torch.zeros(1, 2, 0, dtype=torch.bool)).shape == (1, 2, 0)


@pytest.mark.parametrize("unit", [None, 16])
def test_ids_selection_of_random_masks_matches_a_count(unit):
    """`ids_selection` bisects `mask_to_ids`'s sorted rows for their lengths and keeps the first max(lengths)
    columns, invalid picks as 0: the same lists as counting the mask."""
    gen = torch.Generator().manual_seed(4)
    for density in (0.0, 0.01, 0.3, 1.0):
        mask = torch.rand(3, 4, 257, generator=gen) < density
        ids = mask_to_ids(mask)
        assert ids.is_contiguous()
        selection = ids_selection(ids, unit)
        counts = mask.sum(-1)
        if not counts.any():
            assert selection.kind == "none"
            continue
        assert selection.kind == ("blocks" if unit else "rows") and selection.block_size == unit
        assert torch.equal(selection.lengths, counts)
        assert selection.indices.shape[-1] == int(counts.max())
        for b in range(3):
            for h in range(4):
                n = int(counts[b, h])
                assert selection.indices[b, h, :n].tolist() == mask[b, h].nonzero().flatten().tolist()
                assert not selection.indices[b, h, n:].any()
