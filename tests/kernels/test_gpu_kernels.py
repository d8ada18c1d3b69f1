"""Triton GPU kernels (tandem.kernels.gpu) against the plain-torch references, at the dtype-keyed tolerances of
tests/tolerances.py. Without CUDA they run on CPU tensors under Triton's interpreter (tests/conftest.py turns it
on); tests marked `cuda` add what only a GPU shows: the zero-copy pinned store and CUDA-graph replay."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tolerances import assert_close

pytest.importorskip("triton")

from tandem.kernels import gpu, reference  # noqa: E402
from tandem.kernels.gpu import selection as gpu_selection  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
no_cuda_skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
pytestmark = pytest.mark.skipif(
    not gpu.triton_available(DEVICE),
    reason=f"Triton kernels cannot run on {DEVICE} (TRITON_INTERPRET unset?)",
)


def randn(*shape, dtype=torch.float32, gen, device=DEVICE):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def ragged_valid(batch, num_slots, gen, device=DEVICE):
    """Random holes everywhere; the first request has every slot, the last (when B > 1) none."""
    valid = torch.rand(batch, num_slots, generator=gen) > 0.35
    valid[0] = True
    if batch > 1:
        valid[-1] = False
    return valid.to(device)


def hot_case(batch, num_kv_heads, group, num_slots, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    keys = randn(batch, num_kv_heads, num_slots, head_dim, dtype=dtype, gen=gen)
    values = randn(batch, num_kv_heads, num_slots, head_dim, dtype=dtype, gen=gen)
    maw = torch.rand(batch, num_kv_heads * group, num_slots, generator=gen).to(DEVICE)
    return q, keys, values, ragged_valid(batch, num_slots, gen), maw


def check_hot(q, keys, values, valid, maw, alpha, dtype):
    scale = 1 / math.sqrt(q.shape[-1])
    maw_ref = maw.clone()
    out, lse = gpu.hot_decode_attention(q, keys, values, valid, scale, maw=maw, alpha=alpha)
    ref_out, ref_lse = reference.hot_decode_attention(q, keys, values, valid, scale, maw=maw_ref, alpha=alpha)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")
    assert_close(maw, maw_ref, dtype, "maw")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "batch, num_kv_heads, group, num_slots, head_dim",
    [(3, 2, 1, 27, 64), (2, 2, 4, 61, 64), (2, 1, 8, 113, 128), (1, 1, 4, 300, 80), (2, 1, 4, 150, 256)],
)
def test_hot_decode_matches_reference(batch, num_kv_heads, group, num_slots, head_dim, dtype):
    q, keys, values, valid, maw = hot_case(batch, num_kv_heads, group, num_slots, head_dim, dtype)
    maw_before = maw.clone()
    out, lse = check_hot(q, keys, values, valid, maw, 0.25, dtype)
    if batch > 1:  # the request without a valid slot: nothing attended, the moving average only decays
        assert torch.all(lse[-1] == float("-inf")) and torch.all(out[-1] == 0)
        assert_close(maw[-1], 0.75 * maw_before[-1], torch.float32)


def test_hot_decode_strided_inputs_and_preallocated_outputs():
    # the hot tier as the live part of a larger preallocated buffer, and outputs reused as a CUDA graph would
    q, keys, values, valid, maw = hot_case(2, 2, 4, 80, 64, torch.float16, seed=1)
    live = slice(0, 61)
    args = (q, keys[:, :, live], values[:, :, live], valid[:, live], 0.125)
    maw_ref = maw.clone()
    out = torch.full((2, 8, 64), float("nan"), device=DEVICE)
    lse = torch.full((2, 8), float("nan"), device=DEVICE)
    got = gpu.hot_decode_attention(*args, maw=maw[..., live], alpha=0.5, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    ref_out, ref_lse = reference.hot_decode_attention(*args, maw=maw_ref[..., live], alpha=0.5)
    assert_close(out, ref_out, torch.float16)
    assert_close(lse, ref_lse, torch.float16)
    assert_close(maw, maw_ref, torch.float16)  # slots past the live part untouched


def test_hot_decode_without_maw_and_without_slots():
    q, keys, values, valid, _ = hot_case(2, 1, 4, 27, 64, torch.float32, seed=2)
    out, lse = gpu.hot_decode_attention(q, keys, values, valid, 0.125)
    ref_out, ref_lse = reference.hot_decode_attention(q, keys, values, valid, 0.125)
    assert_close(out, ref_out, torch.float32)
    assert_close(lse, ref_lse, torch.float32)
    out, lse = gpu.hot_decode_attention(q, keys[:, :, :0], values[:, :, :0], valid[:, :0], 0.125)
    assert torch.all(lse == float("-inf")) and torch.all(out == 0)


def test_merge_lse_in_place_matches_reference():
    gen = torch.Generator().manual_seed(3)
    shape = (2, 3, 7)
    out_a, out_b = randn(*shape, 100, gen=gen), randn(*shape, 100, gen=gen)  # head_dim not a power of two
    lse_a, lse_b = randn(*shape, gen=gen) * 4, randn(*shape, gen=gen) * 4
    lse_a[0, 0, :3] = float("-inf")  # a empty
    lse_b[0, 1, :3] = float("-inf")  # b empty
    lse_a[1, 2, :2] = lse_b[1, 2, :2] = float("-inf")  # both empty
    for lse, out in ((lse_a, out_a), (lse_b, out_b)):
        out[torch.isinf(lse)] = 0.0  # the convention of an empty partial attention
    ref_out, ref_lse = reference.merge_lse(out_a, lse_a, out_b, lse_b)
    got = gpu.merge_lse_(out_a, lse_a, out_b, lse_b)
    assert got[0] is out_a and got[1] is lse_a
    assert_close(lse_a, ref_lse, torch.float32, "lse")
    assert_close(out_a, ref_out, torch.float32, "out")
    assert torch.all(out_a[1, 2, :2] == 0) and torch.all(lse_a[1, 2, :2] == float("-inf"))


def test_merge_lse_ignores_garbage_in_an_empty_side():
    gen = torch.Generator().manual_seed(4)
    out_a, out_b = randn(4, 64, gen=gen), torch.full((4, 64), float("nan"), device=DEVICE)
    lse_a, lse_b = randn(4, gen=gen), torch.full((4,), float("-inf"), device=DEVICE)
    expected = out_a.clone(), lse_a.clone()
    gpu.merge_lse_(out_a, lse_a, out_b, lse_b)
    assert_close(out_a, expected[0], torch.float32)
    assert_close(lse_a, expected[1], torch.float32)


def block_case(batch, num_kv_heads, group, num_rows, head_dim, block_size, dtype, id_dtype, seed=0):
    """Store with padding rows (left padding in request 0), sorted distinct block picks, ragged lengths with
    one empty selection, garbage ids past the lengths, and the partial last block picked where there is one."""
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    keys = randn(batch, num_kv_heads, num_rows, head_dim, dtype=dtype, gen=gen)
    values = randn(batch, num_kv_heads, num_rows, head_dim, dtype=dtype, gen=gen)
    valid = torch.rand(batch, num_rows, generator=gen) > 0.1
    valid[0, :5] = False
    num_blocks = -(-num_rows // block_size)
    width = max(1, num_blocks - 1)
    picks = []
    for _ in range(batch * num_kv_heads):
        pick = torch.randperm(num_blocks, generator=gen)[:width]
        pick[0] = num_blocks - 1
        picks.append(pick.sort().values)
    block_ids = torch.stack(picks).view(batch, num_kv_heads, width)
    lengths = torch.randint(1, width + 1, (batch, num_kv_heads), generator=gen)
    lengths.view(-1)[-1] = width  # one full selection, with the last (partial) block
    if batch * num_kv_heads > 1:
        lengths.view(-1)[0] = 0
    past = torch.arange(width)[None, None, :] >= lengths[..., None]
    block_ids = torch.where(past, torch.full_like(block_ids, 10**6), block_ids)  # never read
    return (
        q,
        keys,
        values,
        block_ids.to(DEVICE, id_dtype),
        lengths.to(DEVICE, id_dtype),
        valid.to(DEVICE),
    )


def check_block(case, block_size, dtype, num_splits=None):
    q, keys, values, block_ids, lengths, valid = case
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = gpu.host_block_attention(
        q, keys, values, block_ids, lengths, block_size, valid, scale, num_splits=num_splits
    )
    ref_out, ref_lse = reference.host_block_attention(
        q.cpu(), keys.cpu(), values.cpu(), block_ids.cpu(), lengths.cpu(), block_size, valid.cpu(), scale
    )
    assert out.dtype == lse.dtype == torch.float32
    assert_close(lse.cpu(), ref_lse, dtype, "lse")
    assert_close(out.cpu(), ref_out, dtype, "out")
    return out, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "batch, num_kv_heads, group, num_rows, head_dim, block_size, id_dtype",
    [
        (2, 2, 4, 61, 64, 16, torch.int64),
        (3, 1, 8, 113, 64, 32, torch.int32),
        (1, 2, 1, 27, 128, 8, torch.int64),
        (2, 1, 4, 50, 80, 16, torch.int32),
        (2, 1, 4, 150, 256, 16, torch.int64),  # Gemma 3's head_dim: float32 tiles are halved to fit
    ],
)
def test_host_block_attention_matches_reference(
    batch, num_kv_heads, group, num_rows, head_dim, block_size, id_dtype, dtype
):
    case = block_case(batch, num_kv_heads, group, num_rows, head_dim, block_size, dtype, id_dtype)
    out, lse = check_block(case, block_size, dtype)
    if batch * num_kv_heads > 1:  # the empty selection of (request 0, KV head 0)
        assert torch.all(lse[0, :group] == float("-inf")) and torch.all(out[0, :group] == 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_host_block_attention_reads_a_registered_huge_page_store_in_place():
    # the host tier's allocation (tandem.cache.memory): an mmap'ed store registered with cudaHostRegister
    from tandem.cache.memory import host_zeros

    q, keys, values, block_ids, lengths, valid = block_case(
        1, 2, 4, 8200, 128, 16, torch.bfloat16, torch.int64
    )
    stores = []
    for t in (keys, values):
        store = host_zeros(tuple(t.shape), t.dtype, pin=True)
        assert store.is_pinned() and store.numel() * store.element_size() >= 2 << 20
        stores.append(store.copy_(t))
    valid_host = valid.cpu().pin_memory()
    check_block((q, *stores, block_ids, lengths, valid_host), 16, torch.bfloat16)


@pytest.mark.parametrize("num_splits", [2, 3, 100])
def test_host_block_attention_splits_merge_exactly(num_splits):
    case = block_case(2, 2, 4, 150, 64, 16, torch.float32, torch.int64, seed=5)
    check_block(case, 16, torch.float32, num_splits=num_splits)


def test_host_block_attention_skips_padding_only_blocks():
    q, keys, values, block_ids, lengths, valid = block_case(1, 1, 4, 40, 64, 16, torch.float32, torch.int32)
    valid[:] = False
    out, lse = gpu.host_block_attention(q, keys, values, block_ids, lengths, 16, valid, 0.125)
    assert torch.all(lse == float("-inf")) and torch.all(out == 0)


def score_case(batch, num_kv_heads, group, num_blocks, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, num_kv_heads * group, head_dim, dtype=dtype, gen=gen)
    center = torch.randn(batch, num_kv_heads, num_blocks, head_dim, generator=gen)
    spread = torch.rand(batch, num_kv_heads, num_blocks, head_dim, generator=gen)
    key_min = (center - spread).to(DEVICE, dtype)
    key_max = (center + spread).to(DEVICE, dtype)
    block_valid = (torch.rand(batch, num_blocks, generator=gen) > 0.2).to(DEVICE)
    return q, key_min, key_max, block_valid


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("batch", "num_kv_heads", "group", "num_blocks", "head_dim"), [
    (1, 1, 1, 27, 64), (2, 2, 4, 61, 128), (1, 2, 7, 130, 64), (2, 1, 8, 113, 96),
])  # fmt: skip
def test_block_scores_match_reference(batch, num_kv_heads, group, num_blocks, head_dim, dtype):
    q, key_min, key_max, block_valid = score_case(batch, num_kv_heads, group, num_blocks, head_dim, dtype)
    scores = gpu.block_scores(q, key_min, key_max, block_valid)
    expected = reference.block_scores_matmul(q, key_min, key_max, block_valid)
    assert scores.dtype == torch.float32
    assert_close(scores, expected, dtype, "scores")
    # blocks without a real row are never picked
    assert torch.isneginf(scores[~block_valid[:, None].expand_as(scores)]).all()


def test_block_scores_strided_digests_and_preallocated_out():
    q, key_min, key_max, block_valid = score_case(2, 2, 4, 70, 64, torch.float32, seed=3)
    out = torch.full((2, 2, 61), 7.0, device=DEVICE)
    # a prefix of a larger digest store (the host tier's capacity), as the decode step passes it
    scores = gpu.block_scores(q, key_min[:, :, :61], key_max[:, :, :61], block_valid[:, :61], out=out)
    assert scores.data_ptr() == out.data_ptr()
    expected = reference.block_scores_matmul(q, key_min[:, :, :61], key_max[:, :, :61], block_valid[:, :61])
    assert_close(out, expected, torch.float32, "scores")


def tied_scores(rows, num_blocks, seed=0):
    """Scores with the cases a top-k meets: -inf blocks (a row of them), ties across the k-th score, negative
    zero and the extremes."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, num_blocks, generator=gen) * 10
    scores[0, : num_blocks // 3] = float("-inf")
    scores[-1, 3 : 3 + num_blocks // 4] = 1.25  # a long tie
    scores[-1, 1] = -0.0
    scores[-1, 2] = 0.0
    if rows > 2:
        scores[1] = float("-inf")
        scores[2, 0] = torch.finfo(torch.float32).max
        scores[2, 1] = -torch.finfo(torch.float32).max
    return scores.to(DEVICE)


def long_rows(kernel: str, monkeypatch) -> None:
    """Send every row through one kernel: "registers", or a long-row kernel ("tiles", "split") with 64-block
    tiles, so small rows already span several tiles (and the output's padding more)."""
    if kernel != "registers":
        monkeypatch.setattr(gpu_selection, "REGISTER_TOP_BLOCKS", 0)
        monkeypatch.setattr(gpu_selection, "LONG_ROWS", kernel)
        monkeypatch.setattr(gpu_selection, "TOP_BLOCKS_TILE", 64)
        monkeypatch.setattr(gpu_selection, "SPLIT_TOP_BLOCKS_TILE", 64)


TOP_BLOCKS_KERNELS = ["registers", "tiles", "split"]


@pytest.mark.parametrize(
    ("rows", "num_blocks", "width", "k"),
    [
        (3, 100, 20, 13),
        (4, 1000, 60, 60),
        (1, 37, 10, 0),
        (2, 50, 50, 50),
        (4, 300, 40, 17),
        pytest.param(3, 4100, 300, 211, marks=pytest.mark.slow),  # minutes in Triton's interpreter
    ],
)
@pytest.mark.parametrize("kernel", TOP_BLOCKS_KERNELS)
def test_top_blocks_match_reference(rows, num_blocks, width, k, kernel, monkeypatch):
    long_rows(kernel, monkeypatch)
    scores = tied_scores(rows, num_blocks, seed=k)
    ids = gpu.top_blocks(scores, torch.tensor([k], device=DEVICE), width)
    assert ids.dtype == torch.int64 and ids.shape == (rows, width)
    assert torch.equal(ids, reference.top_blocks(scores, k, width))
    # as a set: the kept blocks are the k best (ties to the lower id), ascending, padded with num_blocks
    for r in range(rows):
        kept = ids[r][ids[r] < num_blocks]
        assert torch.equal(kept, kept.sort().values) and kept.numel() <= k
        rest = scores[r][~torch.isin(torch.arange(num_blocks, device=DEVICE), kept)]
        if kept.numel() and rest.numel():
            assert scores[r, kept].min() >= rest.max()


@pytest.mark.parametrize("kernel", TOP_BLOCKS_KERNELS)
def test_top_blocks_ties_across_tiles_go_to_the_lower_ids(kernel, monkeypatch):
    long_rows(kernel, monkeypatch)
    scores = torch.ones(3, 200, device=DEVICE)  # one tie over four tiles, cut by k
    scores[1, ::7] = float("-inf")
    scores[2, 150:] = 2.0
    ids = gpu.top_blocks(scores, torch.tensor([150], device=DEVICE), 170)
    assert torch.equal(ids, reference.top_blocks(scores, 150, 170))
    assert torch.equal(ids[0, :150], torch.arange(150, device=DEVICE))


@pytest.mark.parametrize("kernel", TOP_BLOCKS_KERNELS)
def test_top_blocks_keep_no_minus_inf_when_k_exceeds_the_finite_scores(kernel, monkeypatch):
    long_rows(kernel, monkeypatch)
    scores = torch.full((2, 300), float("-inf"), device=DEVICE)
    scores[0, [3, 90, 150, 151, 299]] = torch.tensor([1.0, 5.0, 1.0, -2.0, 0.0], device=DEVICE)
    ids = gpu.top_blocks(scores, torch.tensor([40], device=DEVICE), 50)
    assert torch.equal(ids, reference.top_blocks(scores, 40, 50))
    assert (
        ids[0, :5].tolist() == [3, 90, 150, 151, 299] and (ids[0, 5:] == 300).all() and (ids[1] == 300).all()
    )


def test_top_blocks_leading_dims_and_preallocated_out():
    scores = tied_scores(6, 130, seed=4).view(2, 3, 130)
    out = torch.empty(2, 3, 16, dtype=torch.int64, device=DEVICE)
    ids = gpu.top_blocks(scores, torch.tensor([9], device=DEVICE), 16, out=out)
    assert ids.data_ptr() == out.data_ptr()
    assert torch.equal(out, reference.top_blocks(scores, 9, 16))


@pytest.mark.parametrize("kernel", TOP_BLOCKS_KERNELS)
def test_top_blocks_keep_each_requests_own_count(kernel, monkeypatch):
    """k [B]: request b's rows (its KV heads) keep k[b] blocks, as that request alone would with k[b]."""
    long_rows(kernel, monkeypatch)
    scores = tied_scores(4 * 3, 210, seed=11).view(4, 3, 210)
    counts = [17, 0, 40, 3]
    ids = gpu.top_blocks(scores, torch.tensor(counts, device=DEVICE), 40)
    for b, k in enumerate(counts):
        assert torch.equal(ids[b], reference.top_blocks(scores[b], k, 40)), b
    with pytest.raises(ValueError, match=r"k must have shape \[1\] or \[scores.shape\[0\]\]"):
        gpu.top_blocks(scores, torch.tensor(counts[:3], device=DEVICE), 40)


def test_triton_available():
    assert gpu.triton_available(DEVICE)
    assert gpu.triton_available("cpu") == gpu.interpreted()
    assert not gpu.triton_available("meta")


def _hot_args(**change):
    q, keys, values, valid, maw = hot_case(1, 2, 4, 27, 64, torch.float32)
    args = dict(q=q, keys=keys, values=values, valid=valid, scale=0.125, maw=maw, alpha=0.1)
    args.update(change)
    return args


def _block_args(**change):
    q, keys, values, block_ids, lengths, valid = block_case(1, 2, 4, 40, 64, 16, torch.float32, torch.int64)
    args = dict(
        q=q,
        keys=keys,
        values=values,
        block_ids=block_ids,
        lengths=lengths,
        block_size=16,
        valid=valid,
        scale=0.125,
    )
    args.update(change)
    return args


def _score_args(num_kv_heads=2, group=4):
    return dict(
        zip(
            ("q", "key_min", "key_max", "block_valid"),
            score_case(1, num_kv_heads, group, 30, 64, torch.float32),
        )
    )


def _top_args():
    return {"scores": tied_scores(2, 40), "k": torch.tensor([3], device=DEVICE), "width": 8}


def _merge_args(**change):
    args = dict(
        out_a=torch.zeros(2, 3, 64, device=DEVICE),
        lse_a=torch.zeros(2, 3, device=DEVICE),
        out_b=torch.zeros(2, 3, 64, device=DEVICE),
        lse_b=torch.zeros(2, 3, device=DEVICE),
    )
    args.update(change)
    return args


def _meta(t):
    return torch.empty_like(t, device="meta")


BAD_CALLS = {
    "hot q 2-D": (gpu.hot_decode_attention, _hot_args, lambda a: {"q": a["q"][0]}, "q must have shape"),
    "hot head_dim": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {
            "q": torch.zeros(1, 8, 320, device=DEVICE),
            "keys": torch.zeros(1, 2, 27, 320, device=DEVICE),
        },
        r"head_dim \(q.shape\[-1\]\) must lie in \[1, 256\]",
    ),
    "hot keys dtype": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"keys": a["keys"].half()},
        "keys.dtype must be float32",
    ),
    "hot heads": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"q": a["q"][:, :7]},
        "multiple of keys heads",
    ),
    "hot valid dtype": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"valid": a["valid"].int()},
        "valid.dtype must be bool",
    ),
    "hot valid shape": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"valid": a["valid"][:, :5]},
        r"valid must have shape \[B, S\]",
    ),
    "hot maw dtype": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"maw": a["maw"].half()},
        "maw.dtype must be float32",
    ),
    "hot alpha": (gpu.hot_decode_attention, _hot_args, lambda a: {"alpha": 1.5}, "alpha must lie in"),
    "hot scale tensor": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"scale": torch.tensor(0.1)},
        "scale must be a Python float",
    ),
    "hot out shape": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"out": torch.empty(1, 8, 32, device=DEVICE)},
        "out must have shape",
    ),
    "hot device": (gpu.hot_decode_attention, _hot_args, lambda a: {"q": _meta(a["q"])}, "q is on meta"),
    "hot keys device": (
        gpu.hot_decode_attention,
        _hot_args,
        lambda a: {"keys": _meta(a["keys"])},
        "keys must be on",
    ),
    "block block_size 0": (gpu.host_block_attention, _block_args, lambda a: {"block_size": 0}, "block_size"),
    "block block_size -16": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"block_size": -16},
        "block_size",
    ),
    "block block_size float": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"block_size": 2.5},
        "block_size",
    ),
    "block ids dtype": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"block_ids": a["block_ids"].float()},
        "block_ids.dtype must be int32 or int64",
    ),
    "block ids shape": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"block_ids": a["block_ids"][0]},
        r"block_ids must have shape \[B, Hkv, S\]",
    ),
    "block lengths shape": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"lengths": a["lengths"][:, :1]},
        "lengths must have shape",
    ),
    "block valid shape": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"valid": a["valid"][:, 1:]},
        r"valid must have shape \[B, T\]",
    ),
    "block values shape": (
        gpu.host_block_attention,
        _block_args,
        lambda a: {"values": a["values"][:, :, 1:]},
        "values must have shape",
    ),
    "block num_splits": (gpu.host_block_attention, _block_args, lambda a: {"num_splits": 0}, "num_splits"),
    "scores q shape": (
        gpu.block_scores,
        _score_args,
        lambda a: {"q": a["q"][:, :, None]},
        r"q must have shape \[B, Hq, D\]",
    ),
    "scores group": (
        gpu.block_scores,
        lambda: _score_args(3, 1),
        lambda a: {"q": a["q"][:, :2]},
        "multiple of key_min's 3 KV heads",
    ),
    "scores key_max shape": (
        gpu.block_scores,
        _score_args,
        lambda a: {"key_max": a["key_max"][:, :, 1:]},
        "key_max must have shape",
    ),
    "scores block_valid dtype": (
        gpu.block_scores,
        _score_args,
        lambda a: {"block_valid": a["block_valid"].long()},
        "block_valid.dtype must be bool",
    ),
    "top k dtype": (
        gpu.top_blocks,
        _top_args,
        lambda a: {"k": a["k"].int()},
        r"k.dtype must be int64",
    ),
    "top scores dtype": (
        gpu.top_blocks,
        _top_args,
        lambda a: {"scores": a["scores"].double()},
        r"scores.dtype must be float32",
    ),
    "top width": (
        gpu.top_blocks,
        _top_args,
        lambda a: {"width": 0},
        "width must be a positive int",
    ),
    "merge shape": (
        gpu.merge_lse_,
        _merge_args,
        lambda a: {"out_b": a["out_b"][:, :2]},
        "out_b must have shape",
    ),
    "merge dtype": (gpu.merge_lse_, _merge_args, lambda a: {"lse_b": a["lse_b"].half()}, "lse_b.dtype"),
    "merge in place": (
        gpu.merge_lse_,
        _merge_args,
        lambda a: {"out_a": a["out_a"].transpose(0, 1).contiguous().transpose(0, 1)},
        "out_a must be contiguous",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_launchers_refuse_bad_input(case):
    launcher, make_args, change, message = BAD_CALLS[case]
    args = make_args()
    args.update(change(args))
    with pytest.raises(ValueError, match=message):
        launcher(**args)


# ---- CUDA only: zero-copy reads of a pinned host store, CUDA-graph capture -------------------------------------


@pytest.mark.cuda
@no_cuda_skip
def test_scores_and_top_blocks_replay_with_a_new_k():
    """Quest's selection as the decode step records it: the graph reads q, the digests and k at replay."""
    q, key_min, key_max, block_valid = score_case(2, 8, 4, 8300, 128, torch.bfloat16, seed=12)
    k = torch.tensor([400], device="cuda")
    gpu.top_blocks(gpu.block_scores(q, key_min, key_max, block_valid), k, 415)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = gpu.top_blocks(gpu.block_scores(q, key_min, key_max, block_valid), k, 415)
    new_q = score_case(2, 8, 4, 8300, 128, torch.bfloat16, seed=13)[0]
    q.copy_(new_q)
    k.fill_(407)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference.top_blocks(
        reference.block_scores_matmul(new_q, key_min, key_max, block_valid), 407, 415
    )
    # the reference rounds its bounds to bf16, the kernel does not: compare the sets, allowing near-ties
    same = sum(
        len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ids.view(-1, 415), expected.view(-1, 415))
    )
    assert same >= 0.97 * expected.numel()
    assert (ids[..., 407:] == 8300).all()


def pinned(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().pin_memory()


@pytest.mark.cuda
@no_cuda_skip
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 64])
def test_host_block_attention_reads_pinned_store_zero_copy(dtype, block_size):
    batch, num_kv_heads, group, num_rows, head_dim = 2, 8, 4, 4099, 128
    case = block_case(batch, num_kv_heads, group, num_rows, head_dim, block_size, dtype, torch.int32, seed=6)
    q, keys, values, block_ids, lengths, valid = case
    keys, values, valid = pinned(keys), pinned(values), pinned(valid)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    check_block((q, keys, values, block_ids, lengths, valid), block_size, dtype)
    # only the selection's partial results live on the GPU, never a copy of the store
    assert torch.cuda.max_memory_allocated() - before < keys.nbytes // 8


@pytest.mark.cuda
@no_cuda_skip
def test_pinned_ids_and_lengths_and_refused_pageable_store():
    q, keys, values, block_ids, lengths, valid = block_case(2, 2, 4, 300, 64, 16, torch.bfloat16, torch.int64)
    case = (q, pinned(keys), pinned(values), pinned(block_ids), pinned(lengths), pinned(valid))
    check_block(case, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="keys is in pageable host memory"):
        gpu.host_block_attention(q, keys.cpu(), pinned(values), block_ids, lengths, 16, valid, 0.125)


@pytest.mark.cuda
@no_cuda_skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hot_decode_long_hot_tier_on_gpu(dtype):
    q, keys, values, valid, maw = hot_case(2, 8, 4, 3001, 128, dtype, seed=7)
    check_hot(q, keys, values, valid, maw, 0.1, dtype)


@pytest.mark.cuda
@no_cuda_skip
def test_kernels_replay_in_cuda_graph_with_changed_inputs():
    dtype, block_size, scale, alpha = torch.bfloat16, 16, 1 / math.sqrt(128), 0.1
    q, keys, values, valid, maw = hot_case(2, 4, 4, 300, 128, dtype, seed=8)
    _, store_k, store_v, block_ids, lengths, store_valid = block_case(
        2, 4, 4, 1000, 128, block_size, dtype, torch.int64, seed=9
    )
    store_k, store_v, store_valid = pinned(store_k), pinned(store_v), pinned(store_valid)
    hot_out, hot_lse = torch.empty(2, 16, 128, device="cuda"), torch.empty(2, 16, device="cuda")
    host_out, host_lse = torch.empty_like(hot_out), torch.empty_like(hot_lse)

    def step():
        gpu.hot_decode_attention(
            q, keys, values, valid, scale, maw=maw, alpha=alpha, out=hot_out, lse=hot_lse
        )
        gpu.host_block_attention(
            q,
            store_k,
            store_v,
            block_ids,
            lengths,
            block_size,
            store_valid,
            scale,
            out=host_out,
            lse=host_lse,
        )
        gpu.merge_lse_(hot_out, hot_lse, host_out, host_lse)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # new inputs written in place, on the GPU and in the pinned store; the replay must see them all
    new_q, new_keys, _, new_valid, new_maw = hot_case(2, 4, 4, 300, 128, dtype, seed=10)
    _, new_store_k, _, new_ids, new_lengths, _ = block_case(
        2, 4, 4, 1000, 128, block_size, dtype, torch.int64, 11
    )
    q.copy_(new_q)
    keys.copy_(new_keys)
    valid.copy_(new_valid)
    maw.copy_(new_maw)
    store_k.copy_(new_store_k.cpu())
    block_ids.copy_(new_ids)
    lengths.copy_(new_lengths)
    graph.replay()
    torch.cuda.synchronize()

    maw_ref = new_maw.clone()
    ref_hot = reference.hot_decode_attention(q, keys, values, valid, scale, maw_ref, alpha)
    ref_host = reference.host_block_attention(
        q.cpu(), store_k, store_v, block_ids.cpu(), lengths.cpu(), block_size, store_valid, scale
    )
    ref_out, ref_lse = reference.merge_lse(*ref_hot, *(t.cuda() for t in ref_host))
    assert_close(hot_lse, ref_lse, dtype, "lse")
    assert_close(hot_out, ref_out, dtype, "out")
    assert_close(maw, maw_ref, dtype, "maw")


def test_tiles_of_float32_at_head_dim_256_are_halved_to_fit_shared_memory():
    from tandem.kernels.gpu._common import TILE_BYTES, _tile_rows

    assert _tile_rows(64, torch.float32, 256) == 32 and 32 * 256 * 4 <= TILE_BYTES
    assert _tile_rows(64, torch.bfloat16, 256) == 64  # 16-bit tiles keep their rows
    assert _tile_rows(64, torch.float32, 128) == 64 and _tile_rows(64, torch.int8, 256) == 64
    assert _tile_rows(16, torch.float32, 512) == 16  # never below 16 rows (tl.dot's smallest tile)
