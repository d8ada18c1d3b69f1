"""Property-based checks (hypothesis) of the launchers tests/test_properties.py leaves out: the ranked call
(`ops.ranked_block_attention` on both paths, `ops.ranked_attention_call`), the prepared call
(`ops.prepared_attention_call`) and the Triton launchers of block attention and Quest's selection
(`gpu.host_block_attention`, `gpu.hot_decode_attention`, `gpu.block_scores`, `gpu.top_blocks`; on CPU tensors
under Triton's interpreter, since `ops` sends CPU tensors to the reference). Over shapes, dtypes, strides and
index values up to the int64 extremes, each case either raises a ValueError naming the bad argument or matches
`tandem.kernels.reference` at the tolerance of tests/tolerances.py. The defects they found are pinned by the
regression tests at the end."""

from __future__ import annotations

import functools
import math
import re
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tandem.kernels import cpu, gpu, ops, reference
from tandem.kernels.gpu import selection as gpu_selection
from tests.tolerances import assert_close

CPU_SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TRITON_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
native_only = pytest.mark.skipif(not ops.native_cpu_available(), reason="compiled CPU kernels unavailable")
triton_only = pytest.mark.skipif(
    not gpu.triton_available("cpu"), reason="Triton's interpreter is off (TRITON_INTERPRET unset?)"
)

# as tests/test_properties.py: the values the kernels once overflowed on
INT64_EXTREMES = (0, 1, -1, 2**31, 2**60, 2**62 + 1, 2**63 - 1, -(2**63))
IDS = st.one_of(st.integers(-2, 12), st.sampled_from(INT64_EXTREMES))
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])
FINITE_SCALES = st.floats(0.05, 1.5)


def _mostly(valid, invalid):
    """Valid values three times in four, so that most cases get as far as the comparison."""
    return st.integers(0, 3).flatmap(lambda i: invalid if i == 0 else valid)


SCALES = _mostly(FINITE_SCALES, st.sampled_from([math.nan, math.inf, -math.inf]))
ANY_RANK = st.one_of(st.integers(-1, 7), st.sampled_from([2**63 - 1, -(2**63)]))


def _skip_count(width: int):
    """(skip, count) with 0 <= skip <= count <= width, or anything (ints up to the int64 extremes)."""
    return _mostly(
        st.tuples(st.integers(0, width), st.integers(0, width)).map(sorted), st.tuples(ANY_RANK, ANY_RANK)
    )


# a KV store as the host tier may hold it: contiguous, every other row of a larger one, the first rows of a
# preallocated buffer, or rows not contiguous along head_dim (refused where the launcher reads it in place)
LAYOUTS = ("contiguous", "every_other_row", "capacity", "columns")
LOWEST_PRECISION = (torch.bfloat16, torch.float16, torch.float32)


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@functools.cache
def _kernel_rounding(dtype: torch.dtype):
    """How a Triton kernel run here rounds float32 to `dtype` (`x.to(dtype)` in the kernel), as a function of
    tensors. To nearest even, as torch and compiled kernels do, except where a probe on 1 + 3/512 (which the two
    modes round apart) says a bfloat16 conversion truncates: Triton 3.9's interpreter cuts the low bits, whatever
    rounding the kernel asks for. Keeps the reference of the kernels that round q to the digests' dtype exact
    under the interpreter."""
    if dtype != torch.bfloat16:
        return lambda x: x.to(dtype)
    import triton
    import triton.language as tl

    @triton.jit
    def convert(x_ptr, out_ptr):
        tl.store(out_ptr, tl.load(x_ptr).to(out_ptr.dtype.element_ty))

    probe = torch.tensor([1 + 3 / 512], dtype=torch.float32)
    out = torch.empty(1, dtype=dtype)
    convert[(1,)](probe, out)
    if out.item() == probe.to(dtype).item():
        return lambda x: x.to(dtype)
    assert out.item() == 1.0, f"Triton rounds 1 + 3/512 to {out.item()} in bfloat16: neither rounding mode"
    return lambda x: (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)  # toward zero


def _as_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t` [B, H, rows, D] copied into a tensor laid out as `layout` (one of LAYOUTS)."""
    batch, heads, rows, dim = t.shape
    if layout == "every_other_row":
        laid = torch.zeros(batch, heads, 2 * rows, dim, dtype=t.dtype)[:, :, ::2]
    elif layout == "capacity":
        laid = torch.zeros(batch, heads, rows + 5, dim, dtype=t.dtype)[:, :, :rows]
    elif layout == "columns":
        laid = torch.zeros(batch, heads, dim, rows, dtype=t.dtype).transpose(-1, -2)
    else:
        return t.contiguous()
    return laid.copy_(t)


def _store(batch, heads, rows, dim, dtype, layout, seed):
    """[B, heads, rows, D] of `dtype` laid out as `layout`."""
    return _as_layout(_randn(batch, heads, rows, dim, dtype=dtype, seed=seed), layout)


def _bits(bits: int, shape) -> torch.Tensor:
    """A bool tensor of `shape` from the bits of an int (hypothesis shrinks it towards all False)."""
    n = math.prod(shape)
    return torch.tensor([(bits >> i) & 1 == 1 for i in range(n)], dtype=torch.bool).view(shape)


def _names(err: ValueError, *names: str) -> None:
    assert re.search(r"\b(" + "|".join(re.escape(n) for n in names) + r")\b", str(err)), str(err)


# ---- the ranked call -------------------------------------------------------------------------------------


@native_only
@CPU_SETTINGS
@given(
    path=st.sampled_from(["native", "reference"]),
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    q_len=st.integers(1, 2),
    dim=st.sampled_from([8, 24]),
    rows=st.integers(1, 30),
    block=st.sampled_from([1, 4, 8]),
    dtype=DTYPES,
    layout=st.sampled_from(LAYOUTS),
    width=st.integers(0, 5),
    ids=st.lists(IDS, min_size=20, max_size=20),
    mask_bits=st.one_of(st.none(), st.integers(0, 2**60)),
    data=st.data(),
)
def test_ranked_block_attention_names_the_bad_argument_or_matches_the_reference(
    path,
    batch,
    kv_heads,
    group,
    q_len,
    dim,
    rows,
    block,
    dtype,
    layout,
    width,
    ids,
    mask_bits,
    data,
):
    """Both paths of the launcher (the compiled kernels; the reference, taken without a compiler or on CUDA).
    Ranked ids outside [0, rows // block) are invalid picks, skipped (a partial last block included)."""
    scale = data.draw(SCALES, label="scale")
    skip, count = data.draw(_skip_count(width), label="skip, count")
    q = _randn(batch, kv_heads * group, q_len, dim, dtype=dtype, seed=1)
    k = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows)
    v = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows + 1)
    ranked = torch.tensor(ids[: batch * kv_heads * width], dtype=torch.long).view(batch, kv_heads, width)
    key_mask = None if mask_bits is None else _bits(mask_bits, (batch, rows))
    native = path == "native"
    valid_call = 0 <= skip <= count <= width and math.isfinite(scale) and (k.stride(-1) == 1 or not native)
    with mock.patch.object(ops, "native_cpu_available", lambda: native):
        try:
            out, lse, lengths = ops.ranked_block_attention(
                q, k, v, ranked, skip, count, scale, block, key_mask=key_mask
            )
        except ValueError as err:
            _names(err, "skip / count", "scale", "k_store", "v_store")
            assert not valid_call, f"refused a valid call: {err}"
            event("refused")
            return
    event(f"compared with the reference ({path})")
    assert valid_call
    ref_out, ref_lse, ref_lengths = reference.ranked_block_attention(
        q, k, v, ranked, skip, count, scale, block, key_mask
    )
    assert torch.equal(lengths, ref_lengths)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")


@native_only
@CPU_SETTINGS
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 4]),
    q_len=st.sampled_from([None, 1, 2]),
    dim=st.sampled_from([8, 24]),
    rows=st.integers(1, 30),
    block=st.sampled_from([1, 4, 8]),
    dtype=DTYPES,
    layout=st.sampled_from(LAYOUTS),
    q_strided=_mostly(st.just(False), st.just(True)),
    width=st.integers(0, 5),
    masked=st.booleans(),
    scale=SCALES,
    data=st.data(),
)
def test_ranked_attention_call_names_the_bad_argument_or_matches_the_reference(
    batch, kv_heads, group, q_len, dim, rows, block, dtype, layout, q_strided, width, masked, scale, data
):
    """`cpu.RankedAttention` on fixed buffers: checked once, then called a few times with other ranks, other
    ranked ids (read in place at each call) and per-request available rows; its counts are checked too."""
    q_shape = (batch, kv_heads * group, dim) if q_len is None else (batch, kv_heads * group, q_len, dim)
    q = (
        _randn(*q_shape[:-1], 2 * dim, dtype=dtype, seed=2)[..., ::2]
        if q_strided
        else _randn(*q_shape, dtype=dtype)
    )
    k = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows)
    v = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows + 1)
    ranked = torch.zeros(batch, kv_heads, width, dtype=torch.long)
    key_mask = torch.rand(batch, rows, generator=torch.Generator().manual_seed(3)) > 0.3 if masked else None
    out, lse = torch.empty(q_shape), torch.empty(q_shape[:-1])
    try:
        call = ops.ranked_attention_call(q, k, v, ranked, scale, block, out, lse, key_mask)
    except ValueError as err:
        _names(err, "scale", "q", "k_store", "v_store")
        assert not (math.isfinite(scale) and k.stride(-1) == 1 and not q_strided), f"refused: {err}"
        event("refused at construction")
        return
    assert isinstance(call, cpu.RankedAttention)
    assert math.isfinite(scale) and k.stride(-1) == 1 and not q_strided
    q4 = q if q_len is not None else q[:, :, None]
    for _ in range(data.draw(st.integers(1, 3), label="calls")):
        ids = data.draw(st.lists(IDS, min_size=ranked.numel(), max_size=ranked.numel()), label="ranked")
        ranked.copy_(torch.tensor(ids, dtype=torch.long).view(ranked.shape))
        skip, count = data.draw(_skip_count(width), label="skip, count")
        available = data.draw(
            st.one_of(st.none(), st.lists(st.integers(0, 2 * rows), min_size=batch, max_size=batch)),
            label="available",
        )
        available_dtype = data.draw(
            _mostly(st.just(torch.int64), st.just(torch.int32)), label="available dtype"
        )
        if available is not None:
            available = torch.tensor(available, dtype=available_dtype)
        try:
            attended, device, total = call(skip, count, available)
        except ValueError as err:
            _names(err, "skip / count", "available")
            assert not (0 <= skip <= count <= width) or (
                available is not None and available.dtype != torch.int64
            ), f"refused a valid call: {err}"
            event("refused at a call")
            continue
        assert 0 <= skip <= count <= width and (available is None or available.dtype == torch.int64)
        ref_out, ref_lse, ref_lengths = reference.ranked_block_attention(
            q4, k, v, ranked, skip, count, scale, block, key_mask
        )
        assert torch.equal(call.lengths, ref_lengths)
        assert_close(out, ref_out.view(q_shape), dtype, "out")
        assert_close(lse, ref_lse.view(q_shape[:-1]), dtype, "lse")
        # the counts, independently: rows of the valid picks of all `count` ranks (clamped to the request's
        # available rows), rows of those among the first `skip`, and the available rows of every KV head
        picks = (ranked >= 0) & (ranked < rows // block)
        all_rows = picks[..., :count].sum(-1) * block
        clamp = all_rows if available is None else torch.minimum(all_rows, available[:, None])
        assert attended == int(clamp.sum())
        assert device == int(picks[..., :skip].sum()) * block
        assert total == (0 if available is None else int(available.sum()) * kv_heads)
        event("compared with the reference")


# ---- the prepared call -----------------------------------------------------------------------------------


@native_only
@CPU_SETTINGS
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 4]),
    dim=st.sampled_from([8, 24]),
    rows=st.integers(1, 30),
    block=st.sampled_from([None, 1, 4]),
    dtype=DTYPES,
    layout=st.sampled_from(LAYOUTS),
    width=st.integers(0, 5),
    spare=st.integers(0, 3),
    masked=st.booleans(),
    scale=SCALES,
    data=st.data(),
)
def test_prepared_attention_call_names_the_bad_argument_or_matches_the_reference(
    batch, kv_heads, group, dim, rows, block, dtype, layout, width, spare, masked, scale, data
):
    """`cpu.PreparedAttention` over index lists that are the first `width` columns of a wider buffer, rewritten
    in place between calls (as hgca extends its lists); lengths within [-1, width]."""
    q = _randn(batch, kv_heads * group, dim, dtype=dtype)
    k = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows)
    v = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows + 1)
    buffer = torch.zeros(batch, kv_heads, width + spare, dtype=torch.long)
    indices = buffer[..., :width]
    lengths = torch.zeros(batch, kv_heads, dtype=torch.long)
    key_mask = torch.rand(batch, rows, generator=torch.Generator().manual_seed(3)) > 0.3 if masked else None
    out, lse = torch.empty(batch, kv_heads * group, dim), torch.empty(batch, kv_heads * group)
    try:
        call = ops.prepared_attention_call(q, k, v, indices, lengths, scale, out, lse, key_mask, block)
    except ValueError as err:
        _names(err, "scale")
        assert not math.isfinite(scale)
        event("refused")
        return
    assert math.isfinite(scale)
    if call is None:  # a layout it cannot read in place: the general launcher runs, and names the argument
        assert k.stride(-1) != 1
        with pytest.raises(ValueError, match=r"\bk_store\b"):
            ops.sparse_attention_lse(q[:, :, None], k, v, indices, lengths, scale, key_mask, block)
        event("general launcher")
        return
    assert k.stride(-1) == 1
    units = rows // (block or 1)  # a partial last block is out of range, as for `sparse_attention_lse`
    for _ in range(data.draw(st.integers(1, 3), label="calls")):
        ids = data.draw(st.lists(IDS, min_size=buffer.numel(), max_size=buffer.numel()), label="ids")
        buffer.copy_(torch.tensor(ids, dtype=torch.long).view(buffer.shape))
        live_lengths = data.draw(
            st.lists(st.integers(-1, width), min_size=lengths.numel(), max_size=lengths.numel()),
            label="lengths",
        )
        lengths.copy_(torch.tensor(live_lengths).view(lengths.shape))
        live = torch.arange(width) < lengths[..., None]
        in_range = bool((((indices >= 0) & (indices < units)) | ~live).all())
        try:
            call()
        except ValueError as err:
            _names(err, "indices")
            assert not in_range, f"refused a valid call: {err}"
            event("refused at a call")
            continue
        assert in_range
        ref_out, ref_lse = reference.sparse_attention_lse(
            q[:, :, None], k, v, indices, lengths, scale, key_mask, block
        )
        assert_close(out, ref_out[:, :, 0], dtype, "out")
        assert_close(lse, ref_lse[:, :, 0], dtype, "lse")
        event("compared with the reference")


# ---- the Triton launchers (interpreted on CPU tensors) -----------------------------------------------------


def _ids_of(block: int, id_dtype: torch.dtype):
    """Ids the index type holds, its extremes and those whose first row (id * block) just overflows int64
    included."""
    info = torch.iinfo(id_dtype)
    low, high = max(info.min, -(2**63) // block), min(info.max, (2**63 - 1) // block)
    edges = [
        x
        for x in (*INT64_EXTREMES, info.max, info.min, low, high, low - 1, high + 1)
        if info.min <= x <= info.max
    ]
    return st.one_of(st.integers(-2, 12), st.sampled_from(sorted(set(edges))))


@triton_only
@TRITON_SETTINGS
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3]),
    dim=st.sampled_from([8, 16]),
    rows=st.integers(1, 40),
    block=st.sampled_from([1, 4, 16]),
    dtype=DTYPES,
    layout=st.sampled_from(LAYOUTS),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    width=st.integers(0, 5),
    num_splits=_mostly(st.sampled_from([None, 1, 2, 3]), st.just(0)),
    valid_bits=st.integers(0, 2**80),
    scale=FINITE_SCALES,
    data=st.data(),
)
def test_triton_host_block_attention_names_the_bad_argument_or_matches_the_reference(
    batch,
    kv_heads,
    group,
    dim,
    rows,
    block,
    dtype,
    layout,
    id_dtype,
    width,
    num_splits,
    valid_bits,
    scale,
    data,
):
    """Block ids outside the store (and the tail of a partial last block) are skipped; lengths clamp to
    [0, width]. A host store is read in place, so rows not contiguous along head_dim are refused."""
    q = _randn(batch, kv_heads * group, dim, dtype=dtype)
    keys = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows)
    values = _store(batch, kv_heads, rows, dim, dtype, layout, seed=rows + 1)
    n = batch * kv_heads
    ids = data.draw(st.lists(_ids_of(block, id_dtype), min_size=n * width, max_size=n * width))
    block_ids = torch.tensor(ids, dtype=id_dtype).view(batch, kv_heads, width)
    lengths = data.draw(st.lists(st.integers(-2, width + 2), min_size=n, max_size=n), label="lengths")
    lengths = torch.tensor(lengths, dtype=id_dtype).view(batch, kv_heads)
    valid = _bits(valid_bits, (batch, rows))
    valid_call = keys.stride(-1) == 1 and num_splits != 0
    try:
        out, lse = gpu.host_block_attention(
            q, keys, values, block_ids, lengths, block, valid, scale, num_splits=num_splits
        )
    except ValueError as err:
        _names(err, "keys", "num_splits")
        assert not valid_call, f"refused a valid call: {err}"
        event("refused")
        return
    assert valid_call
    ref_out, ref_lse = reference.host_block_attention(
        q, keys, values, block_ids, lengths, block, valid, scale
    )
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    event("compared with the reference")


@triton_only
@TRITON_SETTINGS
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    dim=st.sampled_from([8, 16]),
    slots=st.integers(1, 70),
    dtype=DTYPES,
    layout=st.sampled_from(LAYOUTS),
    valid_bits=st.integers(0, 2**140),
    with_maw=st.booleans(),
    alpha=_mostly(st.floats(0.0, 1.0), st.sampled_from([-0.5, 1.5])),
    scale=FINITE_SCALES,
)
def test_triton_hot_decode_names_the_bad_argument_or_matches_the_reference(
    batch, kv_heads, group, dim, slots, dtype, layout, valid_bits, with_maw, alpha, scale
):
    """The Triton kernel itself (`ops.hot_attention` sends CPU tensors to the reference, so the property test of
    tests/test_properties.py never reaches it): strided hot tiers, rows with no valid slot, the moving average
    as the live part of a wider buffer."""
    q = _randn(batch, kv_heads * group, dim, dtype=dtype)
    keys = _store(batch, kv_heads, slots, dim, dtype, layout, seed=slots)
    values = _store(batch, kv_heads, slots, dim, dtype, layout, seed=slots + 1)
    valid = _bits(valid_bits, (batch, slots))
    maw = torch.rand(batch, kv_heads * group, slots + 3)[..., :slots] if with_maw else None
    maw_ref = maw.clone() if with_maw else None
    try:
        out, lse = gpu.hot_decode_attention(q, keys, values, valid, scale, maw=maw, alpha=alpha)
    except ValueError as err:
        _names(err, "alpha")
        assert not 0 <= alpha <= 1
        event("refused")
        return
    assert 0 <= alpha <= 1
    ref_out, ref_lse = reference.hot_decode_attention(q, keys, values, valid, scale, maw=maw_ref, alpha=alpha)
    assert_close(out, ref_out, dtype, "out")
    assert_close(lse, ref_lse, dtype, "lse")
    if with_maw:
        assert_close(maw, maw_ref, dtype, "maw")
    event("compared with the reference")


@triton_only
@TRITON_SETTINGS
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 2),
    group=st.sampled_from([1, 3, 4]),
    q_heads_extra=st.sampled_from([0, 0, 0, 1]),
    dim=st.sampled_from([8, 16]),
    num_blocks=st.integers(0, 70),
    q_dtype=DTYPES,
    digest_dtype=DTYPES,
    layout=st.sampled_from(LAYOUTS),
    valid_bits=st.integers(0, 2**140),
)
def test_triton_block_scores_names_the_bad_argument_or_matches_the_reference(
    batch, kv_heads, group, q_heads_extra, dim, num_blocks, q_dtype, digest_dtype, layout, valid_bits
):
    """Quest's bounds over digests of any float dtype (q is rounded to theirs), laid out in any of LAYOUTS (the
    launcher copies rows not contiguous along head_dim), across the 64-block tile of a program."""
    q = _randn(batch, kv_heads * group + q_heads_extra, dim, dtype=q_dtype)
    centre = _randn(batch, kv_heads, num_blocks, dim, dtype=digest_dtype, seed=num_blocks)
    key_min, key_max = _as_layout(centre - 1, layout), _as_layout(centre + 1, layout)
    block_valid = _bits(valid_bits, (batch, num_blocks))
    try:
        scores = gpu.block_scores(q, key_min, key_max, block_valid)
    except ValueError as err:
        _names(err, "heads")
        assert q_heads_extra and (kv_heads * group + 1) % kv_heads
        event("refused")
        return
    assert q.shape[1] % kv_heads == 0
    # the kernel's contract: q rounded to the digests' dtype, products summed in float32 (the reference's own
    # matmuls in bf16 would round each sum to bf16, off by more than the table allows at small scores); rounded
    # as the Triton that runs the kernel rounds inside one
    rounded = _kernel_rounding(digest_dtype)(q).float()
    expected = reference.block_scores_matmul(rounded, key_min.float(), key_max.float(), block_valid)
    lowest = next(d for d in LOWEST_PRECISION if d in (q_dtype, digest_dtype))
    assert_close(scores, expected, lowest, "scores")
    event("compared with the reference")


@triton_only
@TRITON_SETTINGS
@given(
    lead=st.sampled_from([(1,), (3,), (2, 2)]),
    num_blocks=st.integers(1, 80),
    width=st.integers(1, 8),
    k=st.one_of(st.integers(-2, 10), st.sampled_from(INT64_EXTREMES)),
    kernel=st.sampled_from(["registers", "tiles", "split"]),
    transposed=st.booleans(),
    data=st.data(),
)
def test_triton_top_blocks_match_the_reference_with_k_clamped(
    lead, num_blocks, width, k, kernel, transposed, data
):
    """Ties, -inf and the float32 extremes; scores not contiguous; every kernel (long-row ones with 64-block tiles).
    `k` lives on the device (a graph replays it), so the launcher cannot refuse it without a host sync: outside
    [0, width] it acts as clamped there, never writing past `out`."""
    values = st.sampled_from([-math.inf, -1.0, -0.0, 0.0, 0.5, 0.5, 2.0, 3.0e38])
    cells = math.prod(lead) * num_blocks
    scores = torch.tensor(data.draw(st.lists(values, min_size=cells, max_size=cells), label="scores"))
    scores = scores.view(*lead, num_blocks)
    if transposed:
        scores = scores.transpose(0, -1).contiguous().transpose(0, -1)
    rows = math.prod(lead)
    buffer = torch.full((rows * width + 4,), -7, dtype=torch.long)  # guard entries past `out`
    out = buffer[: rows * width].view(*lead, width)
    patches = []
    if kernel != "registers":
        patches = [
            mock.patch.object(gpu_selection, "REGISTER_TOP_BLOCKS", 0),
            mock.patch.object(gpu_selection, "LONG_ROWS", kernel),
            mock.patch.object(gpu_selection, "TOP_BLOCKS_TILE", 64),
            mock.patch.object(gpu_selection, "SPLIT_TOP_BLOCKS_TILE", 64),
        ]
    for patch in patches:
        patch.start()
    try:
        ids = gpu.top_blocks(scores, torch.tensor([k]), width, out=out)
    finally:
        for patch in patches:
            patch.stop()
    assert ids.data_ptr() == out.data_ptr() and torch.all(buffer[rows * width :] == -7)
    assert torch.equal(ids, reference.top_blocks(scores, min(max(k, 0), width), width))


# ---- defects the properties above found, pinned as regressions ----------------------------------------------


@triton_only
@pytest.mark.parametrize(("block_id", "block_size"), [(2**62 + 1, 4), (-(2**63), 2)])
def test_triton_host_block_attention_skips_ids_whose_rows_overflow_int64(block_id, block_size):
    q, keys = _randn(1, 2, 8), _randn(1, 1, 16, 8, seed=1)
    args = (torch.tensor([[[block_id]]]), torch.ones(1, 1, dtype=torch.long), block_size)
    valid = torch.ones(1, 16, dtype=torch.bool)
    out, lse = gpu.host_block_attention(q, keys, keys, *args, valid, 0.3)
    ref_out, ref_lse = reference.host_block_attention(q, keys, keys, *args, valid, 0.3)
    assert torch.all(ref_lse == -math.inf)  # nothing selected: the id is past the store's 4 blocks
    assert_close(lse, ref_lse, torch.float32, "lse")  # was the lse of block 1 (resp. 0): the id wrapped
    assert_close(out, ref_out, torch.float32, "out")


@triton_only
def test_triton_top_blocks_tie_minus_zero_with_zero():
    scores = torch.tensor([[-0.0, 0.0]])
    assert torch.equal(reference.top_blocks(scores, 1, 1), torch.tensor([[0]]))
    assert torch.equal(gpu.top_blocks(scores, torch.tensor([1]), 1), torch.tensor([[0]]))  # was [[1]]


@triton_only
def test_triton_top_blocks_split_kernel_writes_every_entry_when_k_exceeds_the_blocks():
    scores = torch.tensor([[-math.inf]])
    out = torch.full((1, 2), -7, dtype=torch.long)  # what torch.empty may hold
    with (
        mock.patch.object(gpu_selection, "REGISTER_TOP_BLOCKS", 0),
        mock.patch.object(gpu_selection, "LONG_ROWS", "split"),
    ):
        gpu.top_blocks(scores, torch.tensor([2]), 2, out=out)
    assert torch.equal(reference.top_blocks(scores, 2, 2), torch.tensor([[1, 1]]))
    assert torch.equal(out, torch.tensor([[1, 1]]))  # was [[-7, 1]]: slot 0 left unwritten


def test_ranked_block_attention_refuses_a_non_finite_scale_on_every_path():
    q, k = _randn(1, 2, 1, 8), _randn(1, 1, 16, 8, seed=1)
    ranked = torch.tensor([[[0, 1]]])
    with mock.patch.object(ops, "native_cpu_available", lambda: False):
        with pytest.raises(ValueError, match=r"\bscale\b"):
            ops.ranked_block_attention(q, k, k, ranked, 0, 2, math.nan, 4)


@native_only
def test_prepared_attention_call_follows_lists_grown_in_place_up_to_the_buffer_and_no_further():
    """The lists are the rows of the buffer under the view (hgca extends them in place): lengths past the
    view's width S read the buffer's entries up to its row stride W, and lengths past W are capped at W."""
    q, k = _randn(1, 2, 8), _randn(1, 1, 16, 8, seed=1)
    buffer = torch.tensor([[[0, 1, 2, 3]]])
    view, lengths = buffer[..., :2], torch.tensor([[3]])
    out, lse = torch.empty(1, 2, 8), torch.empty(1, 2)
    call = ops.prepared_attention_call(q, k, k, view, lengths, 0.3, out, lse)
    for length, attended in ((3, 3), (4, 4), (9, 4)):
        lengths.fill_(length)
        call()
        ref_out, ref_lse = reference.sparse_attention_lse(
            q[:, :, None], k, k, buffer[..., :attended], lengths, 0.3
        )
        assert_close(lse, ref_lse[:, :, 0], torch.float32, "lse")
        assert_close(out, ref_out[:, :, 0], torch.float32, "out")


@native_only
def test_prepared_attention_refuses_strides_that_reach_past_the_storage():
    q, k = _randn(1, 2, 8), _randn(1, 1, 16, 8, seed=1)
    short = torch.arange(4).as_strided((1, 1, 2), (64, 64, 1))  # claims rows of 64 entries over 4
    args = (q, k, k, short, torch.tensor([[2]]), 0.3, torch.empty(1, 2, 8), torch.empty(1, 2))
    with pytest.raises(ValueError, match="indices"):
        cpu.PreparedAttention(*args)
    assert ops.prepared_attention_call(*args) is None  # the general launcher runs instead


@triton_only
def test_triton_block_scores_match_the_reference_where_rounding_modes_differ():
    """q in float32, digests in bfloat16: a q whose entries round differently to nearest and toward zero (hypothesis
    found it), compared with q rounded as the kernel's Triton rounds (`_kernel_rounding`)."""
    q = _randn(1, 2, 8)
    centre = _randn(1, 2, 52, 8, dtype=torch.bfloat16, seed=52)
    valid = _bits(2, (1, 52))
    scores = gpu.block_scores(q, centre - 1, centre + 1, valid)
    rounded = _kernel_rounding(torch.bfloat16)(q).float()
    expected = reference.block_scores_matmul(rounded, (centre - 1).float(), (centre + 1).float(), valid)
    assert_close(scores, expected, torch.bfloat16, "scores")
