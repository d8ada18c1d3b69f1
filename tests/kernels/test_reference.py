"""The plain-torch kernels of `tandem.kernels.reference` against naive loops and against each other.

Every fast kernel is tested against these references, so they are checked here independently: LSE merge
exactness, GQA head mapping, masks, sparse selection by rows and by blocks, Quest digests and HGCA selection.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tandem.kernels import reference
from tests.tolerances import assert_close

INF = float("inf")
HEADS = [(4, 4), (12, 4), (8, 1)]  # (num_q_heads, num_kv_heads): GQA ratios 1, 3 and 8
TOKENS = [27, 61, 113]  # not multiples of any block size


@pytest.fixture(autouse=True)
def one_torch_thread():
    # these tensors are tiny: intra-op threads only add spin-wait overhead (100x on a busy 2-core box)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_qkv(batch, num_q_heads, num_kv_heads, q_len, tokens, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q_heads, q_len, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, num_kv_heads, tokens, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, tokens, head_dim, generator=gen).to(dtype)
    return q, k, v, gen


def naive_attention(q, k, v, scale, key_mask=None):
    """One (request, query head) at a time, K/V repeated per query head: the textbook definition."""
    batch, num_q_heads, q_len, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    k_rep = k.float().repeat_interleave(group, dim=1)
    v_rep = v.float().repeat_interleave(group, dim=1)
    out = torch.zeros(batch, num_q_heads, q_len, head_dim)
    lse = torch.full((batch, num_q_heads, q_len), -INF)
    for b in range(batch):
        for h in range(num_q_heads):
            logits = q[b, h].float() @ k_rep[b, h].T * scale  # [Lq, T]
            if key_mask is not None:
                mask = key_mask[b] if key_mask.dim() == 3 else key_mask[b].expand(q_len, -1)
                logits = logits.masked_fill(~mask, -INF)
            attended = ~torch.isinf(logits).all(dim=-1)  # a query that attends nothing: out 0, lse -inf
            out[b, h, attended] = torch.softmax(logits[attended], dim=-1) @ v_rep[b, h]
            lse[b, h, attended] = torch.logsumexp(logits[attended], dim=-1)
    return out, lse


# ---- (a) LSE merge ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("batch", [1, 3])
def test_merge_of_disjoint_parts_equals_one_softmax(batch, heads, tokens, head_dim, dtype):
    num_q_heads, num_kv_heads = heads
    seed = batch * 1000 + num_q_heads * 100 + tokens + head_dim
    q, k, v, gen = make_qkv(batch, num_q_heads, num_kv_heads, 3, tokens, head_dim, dtype, seed)
    split = int(torch.randint(1, tokens, (1,), generator=gen))
    scale = head_dim**-0.5
    out_a, lse_a = reference.attention_lse(q, k[:, :, :split], v[:, :, :split], scale)
    out_b, lse_b = reference.attention_lse(q, k[:, :, split:], v[:, :, split:], scale)
    out, lse = reference.merge_lse(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.attention_lse(q, k, v, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")


def test_merge_ragged_batch_with_a_fully_masked_part():
    # row 1 is left-padded past the split, so its first part attends nothing (lse -inf) in every head
    q, k, v, _ = make_qkv(3, 12, 4, 2, 61, 16, torch.float32, seed=7)
    valid = torch.ones(3, 61, dtype=torch.bool)
    valid[1, :40] = False
    valid[2, :5] = False
    out_a, lse_a = reference.attention_lse(q, k[:, :, :27], v[:, :, :27], 0.25, valid[:, :27])
    out_b, lse_b = reference.attention_lse(q, k[:, :, 27:], v[:, :, 27:], 0.25, valid[:, 27:])
    assert torch.isneginf(lse_a[1]).all() and torch.isfinite(lse_a[[0, 2]]).all()
    out, lse = reference.merge_lse(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = reference.attention_lse(q, k, v, 0.25, valid)
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert_close(out, ref_out, torch.float32, "out")


@pytest.mark.parametrize("empty_side", ["a", "b"])
def test_merge_with_one_empty_side_returns_the_other(empty_side):
    q, k, v, _ = make_qkv(2, 8, 1, 1, 27, 16, torch.float32, seed=3)
    out_full, lse_full = reference.attention_lse(q, k, v, 0.25)
    nothing = torch.zeros(2, 27, dtype=torch.bool)
    out_none, lse_none = reference.attention_lse(q, k, v, 0.25, nothing)
    assert torch.isneginf(lse_none).all() and not out_none.any()
    if empty_side == "a":
        out, lse = reference.merge_lse(out_none, lse_none, out_full, lse_full)
    else:
        out, lse = reference.merge_lse(out_full, lse_full, out_none, lse_none)
    assert_close(lse, lse_full, torch.float32, "lse")
    assert_close(out, out_full, torch.float32, "out")


def test_merge_of_two_empty_sides_is_zero_and_neg_inf():
    out_a = torch.zeros(2, 4, 3, 16)
    lse_a = torch.full((2, 4, 3), -INF)
    out, lse = reference.merge_lse(out_a, lse_a, out_a.clone(), lse_a.clone())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


# ---- (b) dense attention against the naive loop -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "batch", "per_query"])
@pytest.mark.parametrize("heads", HEADS)
def test_attention_lse_matches_naive_loop(heads, mask_kind, dtype):
    num_q_heads, num_kv_heads = heads
    q, k, v, gen = make_qkv(2, num_q_heads, num_kv_heads, 5, 27, 16, dtype, seed=num_q_heads * num_kv_heads)
    if mask_kind == "none":
        key_mask = None
    elif mask_kind == "batch":
        key_mask = torch.rand(2, 27, generator=gen) > 0.3
        key_mask[1, :9] = False  # left padding of a ragged row
    else:
        key_mask = torch.rand(2, 5, 27, generator=gen) > 0.3
        key_mask[0, 2] = False  # one query attends nothing
    out, lse, weights = reference.attention_lse(q, k, v, 0.25, key_mask, return_weights=True)
    ref_out, ref_lse = naive_attention(q, k, v, 0.25, key_mask)
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")
    assert weights.shape == (2, num_q_heads, 5, 27)
    assert_close(weights @ v.float().repeat_interleave(num_q_heads // num_kv_heads, dim=1), ref_out, dtype)
    if key_mask is not None:
        mask = key_mask if key_mask.dim() == 3 else key_mask[:, None, :].expand(-1, 5, -1)
        assert not weights.masked_select(~mask[:, None]).any()


# ---- (c) sparse attention ---------------------------------------------------------------------------------


def random_selection(gen, batch, num_kv_heads, units, width):
    """Sorted unique ids [B, Hkv, width], ragged lengths; entries past a length are live-looking junk."""
    picks = [torch.randperm(units, generator=gen)[:width].sort().values for _ in range(batch * num_kv_heads)]
    indices = torch.stack(picks).view(batch, num_kv_heads, width)
    lengths = torch.randint(1, width + 1, (batch, num_kv_heads), generator=gen)
    lengths.view(-1)[0] = width
    return indices, lengths


def masked_per_kv_head(q, k, v, scale, keep):
    """attention_lse one KV head at a time with keep [B, Hkv, T] as the key mask."""
    num_kv_heads = k.shape[1]
    group = q.shape[1] // num_kv_heads
    outs, lses = [], []
    for h in range(num_kv_heads):
        sl = slice(h * group, (h + 1) * group)
        out, lse = reference.attention_lse(q[:, sl], k[:, h : h + 1], v[:, h : h + 1], scale, keep[:, h])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_sparse_with_every_row_selected_equals_dense(heads, dtype):
    num_q_heads, num_kv_heads = heads
    q, k, v, _ = make_qkv(3, num_q_heads, num_kv_heads, 2, 61, 16, dtype, seed=11)
    indices = torch.arange(61).expand(3, num_kv_heads, 61)
    lengths = torch.full((3, num_kv_heads), 61)
    out, lse = reference.sparse_attention_lse(q, k, v, indices, lengths, 0.25)
    ref_out, ref_lse = reference.attention_lse(q, k, v, 0.25)
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")


@pytest.mark.parametrize("with_key_mask", [False, True])
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("heads", HEADS)
def test_sparse_subset_equals_dense_with_complement_masked(heads, tokens, with_key_mask):
    num_q_heads, num_kv_heads = heads
    q, k, v, gen = make_qkv(3, num_q_heads, num_kv_heads, 2, tokens, 16, torch.float32, seed=tokens)
    indices, lengths = random_selection(gen, 3, num_kv_heads, tokens, tokens // 3)
    key_mask = None
    keep = torch.zeros(3, num_kv_heads, tokens, dtype=torch.bool)
    for b, h in itertools.product(range(3), range(num_kv_heads)):
        keep[b, h, indices[b, h, : lengths[b, h]]] = True
    if with_key_mask:
        key_mask = torch.ones(3, tokens, dtype=torch.bool)
        key_mask[2, : tokens // 2] = False  # padding rows are never attended, even when selected
        keep &= key_mask[:, None, :]
    out, lse = reference.sparse_attention_lse(q, k, v, indices, lengths, 0.25, key_mask)
    ref_out, ref_lse = masked_per_kv_head(q, k, v, 0.25, keep)
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert_close(out, ref_out, torch.float32, "out")


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sparse_block_ids_equal_expanded_row_ids(block_size):
    num_blocks = 7
    tokens = num_blocks * block_size
    q, k, v, gen = make_qkv(2, 8, 2, 1, tokens, 16, torch.bfloat16, seed=block_size)
    blocks, block_lengths = random_selection(gen, 2, 2, num_blocks, 4)
    key_mask = torch.rand(2, tokens, generator=gen) > 0.2
    rows = (blocks[..., None] * block_size + torch.arange(block_size)).flatten(-2)
    out, lse = reference.sparse_attention_lse(q, k, v, blocks, block_lengths, 0.25, key_mask, block_size)
    ref_out, ref_lse = reference.sparse_attention_lse(
        q, k, v, rows, block_lengths * block_size, 0.25, key_mask
    )
    assert_close(lse, ref_lse, torch.float32, "lse")
    assert_close(out, ref_out, torch.float32, "out")


def test_sparse_empty_selection_gives_zeros_and_neg_inf():
    q, k, v, _ = make_qkv(2, 4, 2, 3, 27, 16, torch.float32, seed=5)
    indices = torch.randint(0, 27, (2, 2, 5))  # ignored: every length is 0
    out, lse = reference.sparse_attention_lse(q, k, v, indices, torch.zeros(2, 2, dtype=torch.long), 0.25)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    # a selection of padding rows only is empty too
    lengths = torch.full((2, 2), 5)
    mask = torch.zeros(2, 27, dtype=torch.bool)
    out, lse = reference.sparse_attention_lse(q, k, v, indices, lengths, 0.25, mask)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


# ---- (d) Quest digests ------------------------------------------------------------------------------------


def digest_of(keys, block_size):
    """Per-block per-dim min/max of keys [B, Hkv, T, D]; a trailing partial block keeps what it has."""
    batch, heads, tokens, head_dim = keys.shape
    num_blocks = -(-tokens // block_size)
    key_min = torch.empty(batch, heads, num_blocks, head_dim, dtype=keys.dtype)
    key_max = torch.empty_like(key_min)
    for i in range(num_blocks):
        part = keys[:, :, i * block_size : (i + 1) * block_size]
        key_min[:, :, i] = part.amin(dim=2)
        key_max[:, :, i] = part.amax(dim=2)
    return key_min, key_max


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_block_scores_bound_every_key_of_the_block(heads, block_size):
    num_q_heads, num_kv_heads = heads
    group = num_q_heads // num_kv_heads
    num_blocks = 113 // block_size
    tokens = num_blocks * block_size
    q, k, _, _ = make_qkv(2, num_q_heads, num_kv_heads, 2, tokens, 16, torch.float32, seed=block_size)
    key_min, key_max = digest_of(k, block_size)
    scores = reference.block_scores(q, key_min, key_max)
    assert scores.shape == (2, num_kv_heads, num_blocks)
    logits = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)  # [B, Hq, Lq, T]
    per_block = logits.view(2, num_kv_heads, group * 2, num_blocks, block_size).amax(dim=(2, 4))
    slack = 1e-4 * (1 + per_block.abs())
    assert (per_block <= scores + slack).all()
    # the bound is the Quest formula, not anything larger
    bound = torch.maximum(
        q[:, :, :, None] * key_min.repeat_interleave(group, dim=1)[:, :, None],
        q[:, :, :, None] * key_max.repeat_interleave(group, dim=1)[:, :, None],
    ).sum(-1)
    expected = bound.view(2, num_kv_heads, group * 2, num_blocks).amax(dim=2)
    assert_close(scores, expected, torch.float32)
    if block_size == 1:  # a one-key block's bound is exact
        assert_close(scores, per_block, torch.float32)


def test_empty_digest_scores_neg_inf_and_is_never_picked():
    q, k, _, _ = make_qkv(1, 4, 1, 1, 12, 16, torch.float32, seed=2)
    key_min, key_max = digest_of(k, 4)  # 3 blocks
    key_min[0, 0, 1], key_max[0, 0, 1] = INF, -INF  # block 1 is all padding (as HostTier digests it)
    scores = reference.block_scores(q, key_min, key_max)
    ids, lengths = reference.topk_blocks(scores, 2)
    assert torch.isneginf(scores[0, 0, 1]) and torch.isfinite(scores[0, 0, [0, 2]]).all()
    assert lengths.item() == 2 and ids[0, 0].tolist() == [0, 2]


@pytest.mark.parametrize("k", [0, 1, 7, 40, 61, 100])
def test_topk_blocks_ascending_top_scores(k):
    gen = torch.Generator().manual_seed(k)
    scores = torch.randn(2, 3, 61, generator=gen)
    scores[0, 0, ::3] = -INF  # 40 selectable blocks
    scores[1, 2] = -INF  # none selectable
    ids, lengths = reference.topk_blocks(scores, k)
    assert ids.dtype == lengths.dtype == torch.long
    assert ids.shape == (2, 3, min(k, 61)) and lengths.shape == (2, 3)
    for b, h in itertools.product(range(2), range(3)):
        finite = torch.isfinite(scores[b, h])
        n = int(lengths[b, h])
        assert n == min(k, int(finite.sum()))
        chosen = ids[b, h, :n]
        assert torch.equal(chosen, chosen.sort().values) and len(set(chosen.tolist())) == n
        expected = torch.topk(scores[b, h], n).indices.sort().values if n else chosen
        assert torch.equal(chosen, expected)
        assert torch.isneginf(scores[b, h, ids[b, h, n:]]).all()
    assert lengths[1, 2] == 0
    if 40 > k > 0:
        assert lengths[0, 0] == k
    if k > 40:
        assert lengths[0, 0] == 40 < ids.shape[-1]


@pytest.mark.parametrize("factor", [1, 2, 3, 8])
def test_coarsen_digest_equals_digest_at_larger_block(factor):
    q, k, _, _ = make_qkv(2, 8, 2, 1, 7 * 4, 16, torch.bfloat16, seed=factor)
    key_min, key_max = digest_of(k, 4)  # 7 physical blocks: 3 does not divide them
    # a view of a larger store, as HostTier.digest() returns
    store_min = torch.zeros(2, 2, 10, 16, dtype=torch.bfloat16)
    store_max = torch.zeros_like(store_min)
    store_min[:, :, :7], store_max[:, :, :7] = key_min, key_max
    coarse_min, coarse_max = reference.coarsen_digest(store_min[:, :, :7], store_max[:, :, :7], factor)
    ref_min, ref_max = digest_of(k, 4 * factor)
    assert coarse_min.shape == ref_min.shape == (2, 2, math.ceil(7 / factor), 16)
    assert torch.equal(coarse_min, ref_min) and torch.equal(coarse_max, ref_max)


# ---- (e) HGCA threshold selection -------------------------------------------------------------------------


def naive_threshold_select(maw, threshold, num_kv_heads, num_rows):
    batch, num_q_heads, _ = maw.shape
    group = num_q_heads // num_kv_heads
    thr = torch.as_tensor(threshold, dtype=torch.float32).reshape(-1)
    thr = thr.expand(batch * num_q_heads).reshape(batch, num_q_heads)
    rows = {}
    for b, h in itertools.product(range(batch), range(num_kv_heads)):
        rows[b, h] = [
            r
            for r in range(num_rows)
            if any(maw[b, qh, r] > thr[b, qh] for qh in range(h * group, (h + 1) * group))
        ]
    return rows


@pytest.mark.parametrize("threshold_kind", ["scalar", "per_head", "per_head_1"])
@pytest.mark.parametrize("heads", HEADS)
def test_threshold_select_matches_naive_loop(heads, threshold_kind):
    num_q_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(num_q_heads + num_kv_heads)
    maw = torch.rand(3, num_q_heads, 70, generator=gen) ** 3
    maw[2, : num_q_heads // num_kv_heads] = 0.0  # request 2, KV head 0 keeps nothing: ragged lengths
    threshold = {
        "scalar": 0.5,
        "per_head": torch.rand(3, num_q_heads, generator=gen),
        "per_head_1": torch.rand(3, num_q_heads, 1, generator=gen),
    }[threshold_kind]
    indices, lengths = reference.threshold_select(maw, threshold, num_kv_heads, 61)  # 9 dead rows
    expected = naive_threshold_select(maw, threshold, num_kv_heads, 61)
    assert lengths.shape == (3, num_kv_heads) and lengths[2, 0] == 0
    assert indices.shape == (3, num_kv_heads, max(len(r) for r in expected.values()))
    for (b, h), rows in expected.items():
        assert lengths[b, h] == len(rows)
        assert indices[b, h, : len(rows)].tolist() == rows


def test_threshold_select_pads_with_zero():
    maw = torch.zeros(1, 2, 10)
    maw[0, 0, [1, 5, 7, 9]] = 1.0
    maw[0, 1, 3] = 1.0
    indices, lengths = reference.threshold_select(maw, 0.5, 2, 10)
    assert lengths.tolist() == [[4, 1]]
    assert indices[0, 1].tolist() == [3, 0, 0, 0]
