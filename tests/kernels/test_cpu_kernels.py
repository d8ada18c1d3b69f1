"""Compiled CPU kernels (tandem.kernels.cpu) against the plain-torch references, on every SIMD path
this CPU supports, at the dtype-keyed tolerances of tests/tolerances.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tandem.kernels import cpu, ops, reference
from tests.tolerances import assert_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
needs_native = pytest.mark.skipif(not cpu.is_available(), reason="CPU kernels unavailable (no compiler?)")


def make_case(
    batch, num_q_heads, num_kv_heads, q_len, head_dim, cap, width, dtype, *, block_size=None, seed=0
):
    """Random q, K/V store [B, Hkv, cap, D], sorted unique selections with ragged lengths (one empty)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q_heads, q_len, head_dim, generator=gen)
    k = torch.randn(batch, num_kv_heads, cap, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, num_kv_heads, cap, head_dim, generator=gen).to(dtype)
    units = cap // block_size if block_size else cap
    width = min(width, units)
    picks = [torch.randperm(units, generator=gen)[:width].sort().values for _ in range(batch * num_kv_heads)]
    indices = torch.stack(picks).view(batch, num_kv_heads, width)
    lengths = torch.randint(0, width + 1, (batch, num_kv_heads), generator=gen)
    lengths.view(-1)[-1] = width
    if batch * num_kv_heads > 1:
        lengths.view(-1)[0] = 0
    return q, k, v, indices, lengths


def check_attention(q, k, v, indices, lengths, dtype, **kwargs):
    out, lse = cpu.sparse_attention_lse(q, k, v, indices, lengths, 0.125, **kwargs)
    kwargs.pop("num_threads", None)
    ref_out, ref_lse = reference.sparse_attention_lse(q, k, v, indices, lengths, 0.125, **kwargs)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")
    return out, lse


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("rows", [27, 61, 113])
def test_sparse_attention_matches_reference(isa, dtype, group, rows):
    case = make_case(2, 2 * group, 2, 1, 64, cap=rows + 9, width=rows, dtype=dtype, seed=rows)
    check_attention(*case, dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_block_indices_match_reference(isa, dtype, block_size):
    case = make_case(2, 8, 2, 1, 128, cap=7 * block_size + 5, width=5, dtype=dtype, block_size=block_size)
    check_attention(*case, dtype, block_size=block_size)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_token_queries_and_key_mask(isa, dtype):
    q, k, v, indices, lengths = make_case(2, 8, 2, 3, 72, cap=113, width=61, dtype=dtype)  # D=72: tails
    key_mask = torch.rand(2, 113, generator=torch.Generator().manual_seed(1)) > 0.3
    key_mask[0, :] = False  # a request whose selected rows are all padding: lse = -inf
    _, lse = check_attention(q, k, v, indices, lengths, dtype, key_mask=key_mask)
    assert torch.isinf(lse[0]).all()


@needs_native
@pytest.mark.parametrize(("group", "q_len"), [(1, 1), (1, 3), (2, 3), (4, 1), (8, 2)])
def test_query_blocks_at_head_dim_128(isa, group, q_len):
    # query counts (group * Lq) that leave every remainder of the 8/4/2/1 register blocks
    case = make_case(2, 2 * group, 2, q_len, 128, cap=140, width=61, dtype=torch.bfloat16, seed=group)
    check_attention(*case, torch.bfloat16)


@needs_native
def test_empty_selection_gives_zeros_and_neg_inf(isa):
    q, k, v, indices, _ = make_case(2, 8, 2, 1, 64, cap=27, width=27, dtype=torch.bfloat16)
    for idx, lengths in (
        (indices, torch.zeros(2, 2, dtype=torch.long)),
        (indices[..., :0], torch.zeros(2, 2).long()),
    ):
        out, lse = cpu.sparse_attention_lse(q, k, v, idx, lengths, 0.125)
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()


@needs_native
@pytest.mark.parametrize("num_threads", [1, 2, 7])
def test_rows_split_across_threads(isa, num_threads):
    # one long segment: pieces of it land on several threads and are merged by LSE
    case = make_case(1, 8, 1, 1, 128, cap=2000, width=1500, dtype=torch.bfloat16)
    check_attention(*case, torch.bfloat16, num_threads=num_threads)
    ragged = make_case(3, 12, 3, 1, 64, cap=600, width=400, dtype=torch.float16, seed=3)
    check_attention(*ragged, torch.float16, num_threads=num_threads)


@needs_native
@pytest.mark.parametrize("masked", ["head", "tail"])
def test_long_piece_spans_with_masked_runs(isa, masked):
    # one thread, one segment of 1400 rows: several 512-row spans merged online; a masked run at the head
    # (spans made of later rows) or at the tail (a last span with no row left)
    q, k, v, indices, lengths = make_case(1, 4, 1, 1, 128, cap=3000, width=1400, dtype=torch.bfloat16)
    lengths.fill_(1400)
    key_mask = torch.ones(1, 3000, dtype=torch.bool)
    if masked == "head":
        key_mask[0, :1200] = False
    else:
        key_mask[0, 1800:] = False
    check_attention(q, k, v, indices, lengths, torch.bfloat16, key_mask=key_mask, num_threads=1)


@needs_native
def test_strided_store_view():
    q, k, v, indices, lengths = make_case(2, 8, 4, 1, 64, cap=120, width=61, dtype=torch.bfloat16)
    # a head slice and a row slice of larger stores: rows stay contiguous, strides do the rest
    k_view, v_view = k[:, 1:3, :113], v[:, 1:3, :113]
    idx = indices[:, 1:3].clamp(max=112)
    check_attention(q[:, 2:6], k_view, v_view, idx, lengths[:, 1:3], torch.bfloat16)


@needs_native
def test_bad_input_names_the_argument():
    """Arguments are checked by the launcher (`ops`) before the compiled kernel runs; the binding itself refuses
    only what it cannot read safely: ids outside the store (checked by the kernel) and rows not contiguous."""
    q, k, v, indices, lengths = make_case(1, 4, 1, 1, 64, cap=27, width=27, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"k_store\.dtype must be float32, float16, bfloat16, int8"):
        ops.sparse_attention_lse(q, k.to(torch.int16), v, indices, lengths, 0.1)
    with pytest.raises(ValueError, match="k_store and v_store must have the same dtype"):
        ops.sparse_attention_lse(q, k, v.float(), indices, lengths, 0.1)
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k_store heads \(3\)"):
        ops.sparse_attention_lse(
            q, k.expand(1, 3, 27, 64).contiguous(), v.expand(1, 3, 27, 64), indices, lengths, 0.1
        )
    for launcher in (cpu.sparse_attention_lse, ops.sparse_attention_lse):
        with pytest.raises(ValueError, match=r"indices must lie in \[0, 27\) \(rows of k_store\)"):
            launcher(q, k, v, indices + 27, lengths, 0.1)
        with pytest.raises(ValueError, match="k_store must be contiguous in its last dim"):
            launcher(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, indices, lengths, 0.1)


def make_ranked(batch, num_kv_heads, num_blocks, width, seed=0):
    """Best-first block ids [B, Hkv, width]: distinct picks, some invalid (>= num_blocks, as quest's
    device_select pads), ragged per (request, KV head)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_blocks + 5, generator=gen)[:width] for _ in range(batch * num_kv_heads)]
    return torch.stack(rows).view(batch, num_kv_heads, width)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("skip", "count"), [(0, 13), (4, 13), (6, 6), (0, 0), (13, 13)])
def test_ranked_attention_matches_reference(isa, dtype, group, skip, count):
    batch, num_kv_heads, block_size, cap = 2, 2, 16, 16 * 27 + 5  # a partial block at the end of the store
    q, k, v, _, _ = make_case(batch, group * num_kv_heads, num_kv_heads, 1, 64, cap, 1, dtype, seed=group)
    ranked = make_ranked(batch, num_kv_heads, cap // block_size, 13, seed=skip)
    key_mask = torch.rand(batch, cap, generator=torch.Generator().manual_seed(1)) > 0.2
    q = q.to(dtype)
    out, lse, lengths = cpu.ranked_block_attention(q, k, v, ranked, skip, count, 0.125, block_size, key_mask)
    ref_out, ref_lse, ref_lengths = reference.ranked_block_attention(
        q, k, v, ranked, skip, count, 0.125, block_size, key_mask
    )
    assert torch.equal(lengths, ref_lengths)
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")


@needs_native
@pytest.mark.parametrize("num_threads", [1, 2])
def test_ranked_attention_in_place_with_counts(num_threads):
    """The prepared call writes out / lse in place and counts what _record_selection would count."""
    batch, num_kv_heads, block_size, cap = 3, 2, 16, 16 * 61
    q, k, v, _, _ = make_case(batch, 8, num_kv_heads, 1, 128, cap, 1, torch.bfloat16)
    q = q[:, :, 0].to(torch.bfloat16).contiguous()  # the decode buffers' [B, Hq, D]
    ranked = make_ranked(batch, num_kv_heads, cap // block_size, 40)
    key_mask = torch.ones(batch, cap, dtype=torch.bool)
    key_mask[1, : 16 * 50] = False  # request 1: 11 blocks of real rows
    out, lse = torch.empty(batch, 8, 128), torch.empty(batch, 8)
    call = cpu.RankedAttention(q, k, v, ranked, 0.125, block_size, out, lse, key_mask, num_threads)
    available = key_mask.sum(dim=1)
    for skip, count in ((10, 40), (0, 25), (25, 25)):
        attended, device, total = call(skip, count, available)
        ref_out, ref_lse, _ = reference.ranked_block_attention(
            q[:, :, None], k, v, ranked, skip, count, 0.125, block_size, key_mask
        )
        assert_close(out, ref_out[:, :, 0], torch.bfloat16, "out")
        assert_close(lse, ref_lse[:, :, 0], torch.bfloat16, "lse")
        _, lengths = reference.ranked_blocks(ranked, 0, count, cap // block_size)
        _, before = reference.ranked_blocks(ranked, 0, skip, cap // block_size)
        assert attended == int(torch.minimum(lengths * block_size, available[:, None]).sum())
        assert device == int(before.sum()) * block_size
        assert total == int(available.sum()) * num_kv_heads
    with pytest.raises(ValueError, match="skip / count"):
        call(5, 41)
    with pytest.raises(ValueError, match="skip / count"):
        call(6, 5)
    with pytest.raises(ValueError, match="available"):
        call(0, 5, available.int())
    with pytest.raises(ValueError, match=r"out must be q's shape = \[3, 8, 128\], got \(3, 4, 128\)"):
        ops.ranked_attention_call(q, k, v, ranked, 0.125, block_size, out[:, :4], lse, key_mask)
    with pytest.raises(ValueError, match="ranked must be int64"):
        ops.ranked_attention_call(q, k, v, ranked.int(), 0.125, block_size, out, lse, key_mask)
    with pytest.raises(ValueError, match="ranked must be contiguous"):  # read in place: the binding checks it
        cpu.RankedAttention(q, k, v, ranked.mT.contiguous().mT, 0.125, block_size, out, lse, key_mask)


@needs_native
@pytest.mark.parametrize("block_size", [None, 16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_prepared_attention_reads_lists_in_place(block_size, num_threads):
    """The prepared call over a view of a wider index buffer (as hgca keeps its lists) gives the general
    launcher's result, follows lengths and indices updated in place, and writes out / lse in place."""
    batch, num_kv_heads, cap = 2, 2, 16 * 40
    q, k, v, indices, lengths = make_case(
        batch, 8, num_kv_heads, 1, 64, cap, 30, torch.bfloat16, block_size=block_size, seed=3
    )
    q = q[:, :, 0].to(torch.bfloat16).contiguous()
    buffer = torch.zeros(batch, num_kv_heads, 37, dtype=torch.int64)  # wider than the lists, as hgca's
    width = indices.shape[-1]
    buffer[..., :width] = indices
    lens = lengths.clone()
    key_mask = torch.ones(batch, cap, dtype=torch.bool)
    key_mask[1, :100] = False
    out, lse = torch.empty(batch, 8, 64), torch.empty(batch, 8)
    call = cpu.PreparedAttention(
        q, k, v, buffer[..., :width], lens, 0.125, out, lse, key_mask, block_size, num_threads
    )
    for _ in range(2):
        call()
        ref_out, ref_lse = cpu.sparse_attention_lse(
            q[:, :, None], k, v, buffer[..., :width].contiguous(), lens, 0.125, key_mask, block_size
        )
        assert_close(out, ref_out[:, :, 0], torch.bfloat16, "out")
        assert_close(lse, ref_lse[:, :, 0], torch.bfloat16, "lse")
        lens.fill_(width - 5)  # the policy updates its lists in place; the next call reads them
    bad = buffer.clone()
    bad[0, 0, 0] = 10**6
    with pytest.raises(ValueError, match="fall outside"):
        cpu.PreparedAttention(q, k, v, bad[..., :width], lens, 0.125, out, lse, key_mask, block_size)()
    with pytest.raises(ValueError, match="indices must have stride 1"):
        cpu.PreparedAttention(q, k, v, buffer.mT.contiguous().mT, lens, 0.125, out, lse, key_mask, block_size)
    with pytest.raises(ValueError, match=r"out must be q's shape = \[2, 8, 64\]"):
        ops.prepared_attention_call(q, k, v, buffer, lens, 0.125, out[:, :4], lse, key_mask, block_size)


def make_digests(batch, num_kv_heads, num_blocks, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    center = torch.randn(batch, num_kv_heads, num_blocks, head_dim, generator=gen)
    spread = torch.rand(batch, num_kv_heads, num_blocks, head_dim, generator=gen)
    return (center - spread).to(dtype), (center + spread).to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_block_scores_match_reference(isa, dtype, group):
    q = torch.randn(2, 2 * group, 2, 72)  # Lq = 2, D = 72 (not a multiple of the vector width)
    key_min, key_max = make_digests(2, 2, 61, 72, dtype)
    assert_close(cpu.block_scores(q, key_min, key_max), reference.block_scores(q, key_min, key_max), dtype)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7])
def test_block_scores_small_groups_with_empty_digests(isa, dtype, group):
    # every query-block split under 8 queries (4 + 2 + 1), with empty digests among scored ones
    q = torch.randn(2, 2 * group, 1, 128)
    key_min, key_max = make_digests(2, 2, 61, 128, dtype, seed=group)
    empty = torch.zeros(2, 2, 61, dtype=torch.bool)
    for b, h, blk in ((0, 0, 4), (0, 1, 5), (1, 0, 30), (1, 1, 60)):
        key_min[b, h, blk], key_max[b, h, blk] = float("inf"), float("-inf")
        empty[b, h, blk] = True
    scores = cpu.block_scores(q, key_min, key_max)
    assert (scores[empty] == float("-inf")).all() and torch.isfinite(scores[~empty]).all()
    expected = reference.block_scores(
        q, key_min.where(~empty[..., None], 0), key_max.where(~empty[..., None], 0)
    )
    assert_close(scores[~empty], expected[~empty], dtype)


@needs_native
@pytest.mark.parametrize("factor", [1, 2, 4, 8])
def test_score_topk_matches_reference(isa, factor):
    # 113 physical blocks: at factors 2, 4 and 8 the last logical block is short
    q = torch.randn(2, 8, 1, 128)
    key_min, key_max = make_digests(2, 2, 113, 128, torch.bfloat16, seed=factor)
    ids, lengths = cpu.score_topk(q, key_min, key_max, 5, factor)
    ref_ids, ref_lengths = reference.topk_blocks(
        reference.block_scores(q, *reference.coarsen_digest(key_min, key_max, factor)), 5
    )
    assert torch.equal(ids, ref_ids) and torch.equal(lengths, ref_lengths)


@needs_native
def test_empty_digest_scores_neg_inf():
    # documented in reference.block_scores; its code gives +inf (q*+inf beats q*-inf), reported upstream
    q = torch.randn(1, 4, 1, 64)
    key_min, key_max = make_digests(1, 1, 27, 64, torch.float32)
    key_min[0, 0, 3], key_max[0, 0, 3] = float("inf"), float("-inf")
    scores = cpu.block_scores(q, key_min, key_max)
    assert scores[0, 0, 3] == float("-inf") and torch.isfinite(scores[0, 0, :3]).all()
    ids, lengths = cpu.score_topk(q, key_min, key_max, 27)
    assert lengths.item() == 26 and 3 not in ids[0, 0, :26].tolist()


@needs_native
@pytest.mark.parametrize("k", [0, 1, 7, 61, 100])
def test_topk_blocks_matches_reference(k):
    scores = torch.randn(2, 3, 61)
    scores[0, 0, ::3] = float("-inf")  # 21 unselectable blocks
    scores[1, 2] = float("-inf")
    ids, lengths = cpu.topk_blocks(scores, k)
    ref_ids, ref_lengths = reference.topk_blocks(scores, k)
    assert ids.shape == ref_ids.shape and torch.equal(lengths, ref_lengths)
    for b in range(2):
        for h in range(3):
            n = lengths[b, h]
            assert torch.equal(ids[b, h, :n], ref_ids[b, h, :n])


def ranked_picks(row: list[float], k: int) -> tuple[list[int], int]:
    """The documented top-k order in plain Python: best score first (NaN highest, -0 == +0, ties by lower
    id), then the finite picks in ascending id, then the non-finite ones in ascending id."""
    rank = [(math.inf if math.isnan(x) else x) + 0.0 for x in row]
    top = sorted(range(len(row)), key=lambda i: (-rank[i], i))[:k]
    finite = sorted(i for i in top if math.isfinite(row[i]))
    return finite + sorted(i for i in top if not math.isfinite(row[i])), len(finite)


@needs_native
@pytest.mark.parametrize("k", [1, 5, 40, 300, 1000])
def test_topk_blocks_ties_nan_and_signed_zero(k):
    # few distinct values, so the k-th score is tied many times and the radix select must cut the ties by id
    gen = torch.Generator().manual_seed(k)
    scores = torch.randint(-3, 4, (2, 2, 1000), generator=gen).float()
    scores[scores == 0] = torch.where(torch.rand(int((scores == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    scores[0, 0, ::7] = float("nan")
    scores[0, 1, ::5] = float("inf")
    scores[1, 0, ::3] = float("-inf")
    scores[1, 1, 1::2] = 1e-40  # subnormal ties
    ids, lengths = cpu.topk_blocks(scores, k)
    for b in range(2):
        for h in range(2):
            picks, n = ranked_picks(scores[b, h].tolist(), k)
            assert ids[b, h].tolist() == picks and lengths[b, h] == n


@needs_native
@pytest.mark.parametrize("threshold_kind", ["scalar", "per_head", "per_head_1"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_threshold_select_matches_reference(threshold_kind, group):
    gen = torch.Generator().manual_seed(group)
    maw = torch.rand(2, 2 * group, 5000, generator=gen) ** 4
    threshold = {
        "scalar": 0.5,
        "per_head": torch.rand(2, 2 * group, generator=gen),
        "per_head_1": torch.rand(2, 2 * group, 1, generator=gen),
    }[threshold_kind]
    ids, lengths = cpu.threshold_select(maw, threshold, 2, 4999, num_threads=2)
    ref_ids, ref_lengths = reference.threshold_select(maw, threshold, 2, 4999)
    assert ids.shape == ref_ids.shape and torch.equal(lengths, ref_lengths)
    for b in range(2):
        for h in range(2):
            n = lengths[b, h]
            assert torch.equal(ids[b, h, :n], ref_ids[b, h, :n])
            assert not ids[b, h, n:].any()  # padded with 0
    # the selection feeds sparse attention directly
    k = torch.randn(2, 2, 5000, 64)
    check_attention(torch.randn(2, 2 * group, 1, 64), k, k, ids, lengths, torch.float32)


@needs_native
def test_threshold_select_nothing_kept():
    ids, lengths = cpu.threshold_select(torch.zeros(1, 4, 27), 1.0, 2, 27)
    assert ids.shape == (1, 2, 0) and not lengths.any()


@needs_native
def test_read_sum():
    data = torch.rand(1_000_003)
    assert cpu.read_sum(data, num_threads=2) == pytest.approx(float(data.double().sum()), rel=1e-5)


def run_script(script: str, **env: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]  # the repository, so the subprocess imports this tandem
    full_env = {**os.environ, "PYTHONPATH": str(root), **env}
    full_env.pop("TANDEM_CPU_ISA", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


FALLBACK_SCRIPT = """
    import warnings, torch
    from tandem.kernels import cpu, reference
    q, k = torch.randn(1, 4, 1, 64), torch.randn(1, 1, 27, 64)
    idx, lengths = torch.arange(27).view(1, 1, 27), torch.tensor([[27]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = cpu.sparse_attention_lse(q, k, k, idx, lengths, 0.1)
        cpu.sparse_attention_lse(q, k, k, idx, lengths, 0.1)
        cpu.block_scores(q, k, k)
    ref_out, ref_lse = reference.sparse_attention_lse(q, k, k, idx, lengths, 0.1)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not cpu.is_available()
    print("warnings:", len(caught), caught[0].message if caught else "")
"""


def test_fallback_warns_once_and_runs_reference():
    result = run_script(FALLBACK_SCRIPT, TANDEM_CPU_KERNELS="off")
    assert result.returncode == 0, result.stderr
    assert "warnings: 1 " in result.stdout and "TANDEM_CPU_KERNELS" in result.stdout


THREADS_SCRIPT = """
    import os, torch
    from tandem.kernels import cpu, reference
    assert cpu.default_num_threads() == int(os.environ["OMP_NUM_THREADS"])
    q, k = torch.randn(1, 32, 1, 128), torch.randn(1, 8, 3000, 128).bfloat16()
    idx = torch.rand(1, 8, 3000).argsort(-1)[..., :1500].sort(-1).values
    lengths = torch.full((1, 8), 1500)
    out, lse = cpu.sparse_attention_lse(q, k, k, idx, lengths, 0.1)
    ref_out, ref_lse = reference.sparse_attention_lse(q, k, k, idx, lengths, 0.1)
    torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    print("ok", cpu.isa())
"""


@needs_native
@pytest.mark.parametrize("omp_threads", ["1", "2"])
def test_omp_num_threads_sets_default(omp_threads):
    result = run_script(THREADS_SCRIPT, OMP_NUM_THREADS=omp_threads)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


@pytest.mark.skipif(not cpu.is_available(), reason="compiled CPU kernels unavailable")
def test_compiled_merge_lse_matches_reference_and_ignores_an_empty_side():
    gen = torch.Generator().manual_seed(3)
    shape = (2, 3, 7)
    out_a, out_b = torch.randn(*shape, 100, generator=gen), torch.randn(*shape, 100, generator=gen)
    lse_a, lse_b = torch.randn(*shape, generator=gen) * 4, torch.randn(*shape, generator=gen) * 4
    lse_a[0, 0, :3] = float("-inf")  # a empty
    lse_b[0, 1, :3] = float("-inf")  # b empty
    lse_a[1, 2, :2] = lse_b[1, 2, :2] = float("-inf")  # both empty
    out_a[torch.isinf(lse_a)] = 0.0
    out_b[torch.isinf(lse_b)] = float("nan")  # garbage in an empty side is never read
    clean_b = torch.where(torch.isinf(lse_b)[..., None], 0.0, out_b)
    ref_out, ref_lse = reference.merge_lse(out_a, lse_a, clean_b, lse_b)
    got = cpu.merge_lse_(out_a, lse_a, out_b, lse_b)
    assert got[0] is out_a and got[1] is lse_a
    torch.testing.assert_close(lse_a, ref_lse, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_a, ref_out, atol=1e-6, rtol=1e-6)
    assert torch.all(out_a[1, 2, :2] == 0) and torch.all(lse_a[1, 2, :2] == float("-inf"))
    strided = torch.randn(4, 2, 8, generator=gen).transpose(0, 1)  # not contiguous: the reference runs
    lse_s = torch.randn(2, 4, generator=gen)
    expected = reference.merge_lse(strided, lse_s, strided, lse_s)
    cpu.merge_lse_(strided, lse_s, strided.clone(), lse_s.clone())
    torch.testing.assert_close(strided, expected[0])
    torch.testing.assert_close(lse_s, expected[1])


@pytest.mark.skipif(not cpu.is_available(), reason="compiled CPU kernels unavailable")
def test_prepared_merge_merges_its_buffers_at_every_call():
    gen = torch.Generator().manual_seed(5)
    out_a, out_b = torch.randn(2, 9, 64, generator=gen), torch.zeros(2, 9, 64)
    lse_a, lse_b = torch.randn(2, 9, generator=gen), torch.zeros(2, 9)
    merge = cpu.PreparedMerge(out_a, lse_a, out_b, lse_b)
    for step in range(3):  # new contents in the same buffers, as a decode step writes them
        out_b.copy_(torch.randn(2, 9, 64, generator=gen))
        lse_b.copy_(torch.randn(2, 9, generator=gen))
        lse_b[0, step] = float("-inf")
        expected = reference.merge_lse(out_a.clone(), lse_a.clone(), out_b, lse_b)
        merge()
        torch.testing.assert_close(out_a, expected[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse_a, expected[1], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu.PreparedMerge(out_a.double(), lse_a, out_b, lse_b)
    with pytest.raises(ValueError, match="must match"):
        cpu.PreparedMerge(out_a, lse_a, out_b[:1], lse_b[:1])


def _own_stores(caps, num_kv_heads, head_dim, dtype, block_size, gen, kind=None):
    """One store per request, of the given capacities: (k, v, key_mask, k_scale, v_scale) each, with a few padding
    rows masked in each, and 8-bit codes with per-block scales where `kind` names a format."""
    stores = []
    for cap in caps:
        k = torch.randn(1, num_kv_heads, cap, head_dim, generator=gen)
        v = torch.randn(1, num_kv_heads, cap, head_dim, generator=gen)
        mask = torch.rand(1, cap, generator=gen) > 0.1
        if kind is None:
            stores.append((k.to(dtype), v.to(dtype), mask, None, None))
            continue
        k, k_scale = reference.quantize_blocks(k, mask, block_size, kind)
        v, v_scale = reference.quantize_blocks(v, mask, block_size, kind)
        stores.append((k, v, mask, k_scale, v_scale))
    return stores


@needs_native
@pytest.mark.parametrize(
    "dtype, kind",
    [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, "int8")],
)
@pytest.mark.parametrize("block_size", [None, 16])
def test_stores_attention_matches_each_request_over_its_own_store(isa, dtype, kind, block_size):
    """One call over requests that each keep their own store (capacities differ; one request attends nothing)
    gives, per request, the reference over that store alone, and reads lengths changed in place."""
    gen = torch.Generator().manual_seed(5)
    caps, num_kv_heads, head_dim, bs = (16 * 10, 16 * 25, 16 * 7, 16 * 3), 2, 64, block_size or 1
    stores = _own_stores(caps, num_kv_heads, head_dim, dtype, bs, gen, kind)
    width = max(caps) // bs
    indices = torch.zeros(len(caps), num_kv_heads, width, dtype=torch.int64)
    lengths = torch.zeros(len(caps), num_kv_heads, dtype=torch.int64)
    for b, cap in enumerate(caps):
        for h in range(num_kv_heads):
            units = cap // bs
            picks = torch.randperm(units, generator=gen)[: units // 2 + h].sort().values
            indices[b, h, : len(picks)] = picks
            lengths[b, h] = len(picks)
    lengths[2] = 0  # a request with nothing to attend: out 0, lse -inf
    q = torch.randn(len(caps), 8, head_dim, generator=gen).to(dtype if kind is None else torch.float32)
    out, lse = torch.empty(len(caps), 8, head_dim), torch.empty(len(caps), 8)
    call = ops.stores_attention_call(q, stores, indices, lengths, 0.125, out, lse, block_size, 2)
    for _ in range(2):
        call()
        ref_out, ref_lse = reference.stores_attention_lse(q, stores, indices, lengths, 0.125, block_size)
        assert_close(out, ref_out, torch.bfloat16 if kind else dtype, "out")
        assert_close(lse, ref_lse, torch.bfloat16 if kind else dtype, "lse")
        assert torch.all(lse[2] == float("-inf")) and torch.all(out[2] == 0)
        lengths[0] = 1  # read at every call
    bad = indices.clone()
    bad[3, 0, 0] = caps[3] // bs  # a block of a larger request's store, past this one's
    lengths[3] = 1
    with pytest.raises(ValueError, match="fall outside"):
        ops.stores_attention_call(q, stores, bad, lengths, 0.125, out, lse, block_size, 2)()


@needs_native
def test_stores_attention_call_names_the_bad_argument():
    gen = torch.Generator().manual_seed(6)
    stores = _own_stores((32, 48), 2, 64, torch.float32, 16, gen)
    q = torch.randn(2, 4, 64)
    indices, lengths = torch.zeros(2, 2, 3, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64)
    out, lse = torch.empty(2, 4, 64), torch.empty(2, 4)
    with pytest.raises(ValueError, match="one store per request"):
        ops.stores_attention_call(q, stores[:1], indices, lengths, 0.125, out, lse, 16)
    odd = (stores[1][0][:, :1].contiguous(), stores[1][1][:, :1].contiguous(), None, None, None)
    with pytest.raises(ValueError, match=r"stores\[1\] must match stores\[0\]'s dtype, Hkv and D"):
        ops.stores_attention_call(q, [stores[0], odd], indices, lengths, 0.125, out, lse, 16)
    with pytest.raises(ValueError, match="lengths"):
        ops.stores_attention_call(q, stores, indices, lengths[:, :1], 0.125, out, lse, 16)


@needs_native
@pytest.mark.parametrize(
    "dtype, kind", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8")]
)
def test_ranked_rows_attention_matches_each_request_over_its_own_ranks(isa, dtype, kind):
    """One call over requests with their own stores and rankings, each keeping its own ranks [skip, count), gives
    the reference per request, and each request's counters as `RankedAttention` gives them alone."""
    gen = torch.Generator().manual_seed(8)
    caps, num_kv_heads, head_dim, bs = (16 * 12, 16 * 30, 16 * 5), 2, 64, 16
    stores = _own_stores(caps, num_kv_heads, head_dim, dtype, bs, gen, kind)
    width = max(caps) // bs
    ranked = torch.full((len(caps), num_kv_heads, width), -1, dtype=torch.int64)
    for b, cap in enumerate(caps):
        for h in range(num_kv_heads):
            ranked[b, h, : cap // bs] = torch.randperm(cap // bs, generator=gen)
    ranked[1, 0, 3] = caps[1] // bs + 7  # an invalid pick past the store: skipped
    q = torch.randn(len(caps), 8, head_dim, generator=gen).to(dtype if kind is None else torch.float32)
    out, lse = torch.empty(len(caps), 8, head_dim), torch.empty(len(caps), 8)
    call = ops.ranked_rows_call(q, stores, ranked, 0.125, bs, out, lse, 2)
    available = torch.tensor([cap - 5 for cap in caps], dtype=torch.int64)
    for skips, counts in (([0, 2, 1], [6, 14, 3]), ([1, 0, 0], [1, 30, 5])):
        call.skips.copy_(torch.tensor(skips))
        call.counts.copy_(torch.tensor(counts))
        stats = call(available).clone()
        ref_out, ref_lse = reference.ranked_rows_attention_lse(q, stores, ranked, skips, counts, 0.125, bs)
        tol = torch.bfloat16 if kind else dtype
        assert_close(out, ref_out, tol, "out")
        assert_close(lse, ref_lse, tol, "lse")
        for b, (k, v, mask, k_scale, v_scale) in enumerate(stores):  # each request's counters, as alone
            alone = cpu.RankedAttention(
                q[b : b + 1].contiguous(), k, v, ranked[b : b + 1].contiguous(), 0.125, bs,
                torch.empty(1, 8, head_dim), torch.empty(1, 8), mask, 2, k_scale, v_scale,
            )  # fmt: skip
            assert tuple(stats[b].tolist()) == alone(skips[b], counts[b], available[b : b + 1])
    call.counts[0] = width + 1
    with pytest.raises(ValueError, match="skips / counts must satisfy"):
        call(available)


@needs_native
@pytest.mark.parametrize("dtype, kind", [(torch.bfloat16, None), (torch.bfloat16, "int8")])
def test_ranked_rows_call_follows_a_replaced_store(dtype, kind):
    """`ops.ranked_rows_set_store`: a request of a prepared call re-pointed at another store (of another capacity)
    gives what a call built with that store gives; a store of another dtype, head count or layout is refused."""
    gen = torch.Generator().manual_seed(9)
    caps, num_kv_heads, head_dim, bs = (16 * 12, 16 * 30, 16 * 5), 2, 64, 16
    stores = _own_stores(caps, num_kv_heads, head_dim, dtype, bs, gen, kind)
    other = _own_stores((16 * 20,), num_kv_heads, head_dim, dtype, bs, gen, kind)[0]
    width = 20
    ranked = torch.stack([torch.randperm(width, generator=gen) for _ in range(3 * num_kv_heads)])
    ranked = ranked.view(3, num_kv_heads, width).contiguous()
    ranked[0, :, 12:] = -1
    ranked[2, :, 5:] = -1
    q = torch.randn(3, 8, head_dim, generator=gen).to(dtype if kind is None else torch.float32)
    results = []
    for given in (stores[:1] + [other] + stores[2:], stores):
        out, lse = torch.empty(3, 8, head_dim), torch.empty(3, 8)
        call = ops.ranked_rows_call(q, given, ranked, 0.125, bs, out, lse, 2)
        if given is stores:
            ops.ranked_rows_set_store(call, 1, other)
        call.skips.copy_(torch.tensor([0, 1, 0]))
        call.counts.copy_(torch.tensor([12, 20, 5]))
        stats = call().clone()
        results.append((out, lse, stats))
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.equal(got, want)
    wrong = (other[0].float(), other[1].float(), other[2], None, None)
    with pytest.raises(ValueError, match="store must match the call's dtype, Hkv and D"):
        ops.ranked_rows_set_store(call, 1, wrong)
    one_head = tuple(t[:, :1].contiguous() if t is not None and t.dim() == 4 else t for t in other)
    with pytest.raises(ValueError, match="store must match the call's dtype, Hkv and D"):
        ops.ranked_rows_set_store(call, 1, one_head)
    with pytest.raises(ValueError, match=r"b must be a request of the call, in \[0, 3\)"):
        ops.ranked_rows_set_store(call, 3, other)
