"""The compressed host tier on the compiled CPU kernels: K/V stores of 8-bit codes (int8, float8_e4m3fn) with one
float32 scale per (request, KV head, group of rows), dequantized in registers. Every launcher against
`reference.sparse_attention_lse` over `reference.dequantize`d float32 stores, on every SIMD path this CPU has, at
the float32 tolerance (the codes are exact; only the fp32 arithmetic differs)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tandem.kernels import cpu, ops, reference
from tandem.kernels.cpu import _library
from tests.tolerances import assert_close

KINDS = tuple(reference.QUANT_DTYPES)  # "int8", "fp8"
SCALE_ROWS = 16  # rows per scale (G) unless a test says otherwise
needs_native = pytest.mark.skipif(not cpu.is_available(), reason="CPU kernels unavailable (no compiler?)")


def make_store(kind, batch, num_kv_heads, cap, head_dim, key_mask, gen, scale_rows=SCALE_ROWS):
    """Quantized K and V: (k_codes, v_codes, k_scale, v_scale) and their float32 decodings (k, v)."""
    k_codes, k_scale = reference.quantize_blocks(
        2 * torch.randn(batch, num_kv_heads, cap, head_dim, generator=gen), key_mask, scale_rows, kind
    )
    v_codes, v_scale = reference.quantize_blocks(
        torch.randn(batch, num_kv_heads, cap, head_dim, generator=gen), key_mask, scale_rows, kind
    )
    decoded = reference.dequantize(k_codes, k_scale), reference.dequantize(v_codes, v_scale)
    return (k_codes, v_codes, k_scale, v_scale), decoded


def make_selection(batch, num_kv_heads, units, width, gen):
    """Sorted unique ids [B, Hkv, width] with ragged lengths (the first (request, KV head) empty)."""
    picks = [torch.randperm(units, generator=gen)[:width].sort().values for _ in range(batch * num_kv_heads)]
    indices = torch.stack(picks).view(batch, num_kv_heads, width)
    lengths = torch.randint(0, width + 1, (batch, num_kv_heads), generator=gen)
    lengths.view(-1)[-1] = width
    lengths.view(-1)[0] = 0
    return indices, lengths


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 72])  # 72: a tail past the vector blocks
def test_launchers_match_dequantized_reference(isa, kind, block_size, group, q_len, head_dim):
    batch, num_kv_heads, cap = 2, 2, 16 * 9 + 16  # 10 scale groups; with block_size 16 one block per group
    gen = torch.Generator().manual_seed(head_dim + group + q_len)
    q = torch.randn(batch, num_kv_heads * group, q_len, head_dim, generator=gen)
    key_mask = torch.rand(batch, cap, generator=gen) > 0.2
    if q_len == 3:
        key_mask[0] = False  # request 0 has only padding rows: lse = -inf
    (k_codes, v_codes, k_scale, v_scale), (k, v) = make_store(
        kind, batch, num_kv_heads, cap, head_dim, key_mask, gen
    )
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    units = cap // block_size
    indices, lengths = make_selection(batch, num_kv_heads, units, 61 if block_size == 1 else 6, gen)
    bs = None if block_size == 1 else block_size
    expected = reference.sparse_attention_lse(q, k, v, indices, lengths, 0.125, key_mask, bs)
    for launcher in (cpu.sparse_attention_lse, ops.sparse_attention_lse):
        out, lse = launcher(
            q, k_codes, v_codes, indices, lengths, 0.125, key_mask, bs, num_threads=2, **scales
        )
        assert_close(lse, expected[1], torch.float32, f"{launcher.__module__} lse")
        assert_close(out, expected[0], torch.float32, f"{launcher.__module__} out")

    # device-ranked picks, invalid ones (>= units) among them, skipped
    ranked = torch.stack([torch.randperm(units + 5, generator=gen)[:13] for _ in range(batch * num_kv_heads)])
    ranked = ranked.view(batch, num_kv_heads, 13)
    ref_out, ref_lse, ref_lengths = reference.ranked_block_attention(
        q, k, v, ranked, 2, 11, 0.125, block_size, key_mask
    )
    out, lse, lengths_ranked = ops.ranked_block_attention(
        q, k_codes, v_codes, ranked, 2, 11, 0.125, block_size, key_mask, **scales
    )
    assert torch.equal(lengths_ranked, ref_lengths)
    assert_close(lse, ref_lse, torch.float32, "ranked lse")
    assert_close(out, ref_out, torch.float32, "ranked out")
    out, lse = torch.empty(q.shape), torch.empty(q.shape[:-1])
    call = ops.ranked_attention_call(
        q, k_codes, v_codes, ranked, 0.125, block_size, out, lse, key_mask, **scales
    )
    assert isinstance(call, cpu.RankedAttention)
    call(2, 11)
    assert_close(lse, ref_lse, torch.float32, "RankedAttention lse")
    assert_close(out, ref_out, torch.float32, "RankedAttention out")

    if q_len == 1:  # the prepared call takes decode queries [B, Hq, D]
        q3 = q[:, :, 0].contiguous()
        out, lse = torch.empty(q3.shape), torch.empty(q3.shape[:-1])
        call = ops.prepared_attention_call(
            q3, k_codes, v_codes, indices, lengths, 0.125, out, lse, key_mask, bs, 2, **scales
        )
        assert isinstance(call, cpu.PreparedAttention)
        call()
        assert_close(lse, expected[1][:, :, 0], torch.float32, "PreparedAttention lse")
        assert_close(out, expected[0][:, :, 0], torch.float32, "PreparedAttention out")


@needs_native
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale_rows", [1, 48, 144])  # one scale per row, per 3 blocks, per head
def test_scale_groups_and_long_spans(isa, kind, scale_rows):
    # 2000 selected rows of one head: several spans of a piece, split over threads, each row with its group's scale
    batch, num_kv_heads, cap, head_dim = 1, 1, 144 * 15, 128
    gen = torch.Generator().manual_seed(scale_rows)
    q = torch.randn(batch, 4, 1, head_dim, generator=gen)
    key_mask = torch.ones(batch, cap, dtype=torch.bool)
    (k_codes, v_codes, k_scale, v_scale), (k, v) = make_store(
        kind, batch, num_kv_heads, cap, head_dim, key_mask, gen, scale_rows
    )
    indices = torch.randperm(cap, generator=gen)[:2000].sort().values.view(1, 1, 2000)
    lengths = torch.tensor([[2000]])
    expected = reference.sparse_attention_lse(q, k, v, indices, lengths, 0.125)
    for threads in (1, 2):
        out, lse = cpu.sparse_attention_lse(
            q,
            k_codes,
            v_codes,
            indices,
            lengths,
            0.125,
            num_threads=threads,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        assert_close(lse, expected[1], torch.float32, "lse")
        assert_close(out, expected[0], torch.float32, "out")


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_every_code_decodes_exactly(isa, kind):
    # one attended row: out = its V row exactly (weight 1), so each of the 256 codes shows its decoded value
    # (e4m3fn subnormals included; 0x7f / 0xff, NaN in e4m3fn, are never stored and stand in as 0 here)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kind == "fp8":
        codes[[0x7F, 0xFF]] = 0
    store = codes.view(reference.QUANT_DTYPES[kind]).view(1, 1, 1, 256)
    scale = torch.tensor([[[0.5]]])
    out, lse = cpu.sparse_attention_lse(
        torch.randn(1, 1, 1, 256), store, store, torch.zeros(1, 1, 1, dtype=torch.long), torch.ones(1, 1).long(),
        0.125, k_scale=scale, v_scale=scale,
    )  # fmt: skip
    assert torch.equal(out.view(256), store.float().view(256) * 0.5)
    assert torch.isfinite(lse).all()


@needs_native
@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_ids_are_refused(kind):
    gen = torch.Generator().manual_seed(0)
    key_mask = torch.ones(1, 64, dtype=torch.bool)
    (k_codes, v_codes, k_scale, v_scale), _ = make_store(kind, 1, 2, 64, 64, key_mask, gen)
    q = torch.randn(1, 4, 1, 64)
    for indices, bs in (
        (torch.tensor([[[3, 64]], [[0, 1]]]).view(1, 2, 2), None),
        (torch.full((1, 2, 1), 4), 16),
    ):
        for launcher in (cpu.sparse_attention_lse, ops.sparse_attention_lse):
            with pytest.raises(ValueError, match="indices"):
                launcher(
                    q, k_codes, v_codes, indices, torch.full((1, 2), indices.shape[2]), 0.125, None, bs,
                    k_scale=k_scale, v_scale=v_scale,
                )  # fmt: skip


def _launchers():
    """Each launcher taking a store and its scales, over one small case (B=1, Hkv=2, cap=64, D=64). The scales are
    checked there, once (`scales.scale_rows`), before the compiled bindings (`cpu.*`) lay out their pointers."""
    q = torch.randn(1, 4, 1, 64)
    q3 = q[:, :, 0].contiguous()
    indices, lengths = torch.arange(8).expand(1, 2, 8).contiguous(), torch.full((1, 2), 8)
    ranked = torch.arange(4).expand(1, 2, 4).contiguous()

    def buffers(query):
        return torch.empty(query.shape), torch.empty(query.shape[:-1])

    return {
        "ops.sparse_attention_lse": lambda k, v, ks, vs: ops.sparse_attention_lse(
            q, k, v, indices, lengths, 0.125, k_scale=ks, v_scale=vs
        ),
        "ops.ranked_block_attention": lambda k, v, ks, vs: ops.ranked_block_attention(
            q, k, v, ranked, 0, 4, 0.125, 16, k_scale=ks, v_scale=vs
        ),
        "ops.ranked_attention_call": lambda k, v, ks, vs: ops.ranked_attention_call(
            q3, k, v, ranked, 0.125, 16, *buffers(q3), k_scale=ks, v_scale=vs
        ),
        "ops.prepared_attention_call": lambda k, v, ks, vs: ops.prepared_attention_call(
            q3, k, v, indices, lengths, 0.125, *buffers(q3), k_scale=ks, v_scale=vs
        ),
    }


def _bad_scales():
    """(name, (k_store, v_store, k_scale, v_scale), the argument the refusal must name)."""
    gen = torch.Generator().manual_seed(0)
    (k, v, ks, vs), (kf, vf) = make_store("int8", 1, 2, 64, 64, torch.ones(1, 64, dtype=torch.bool), gen)
    kb, vb = kf.bfloat16(), vf.bfloat16()
    strided = torch.empty(1, 2, 8)[..., ::2]  # [1, 2, 4], last dim stride 2
    return [
        ("missing k_scale", (k, v, None, vs), "k_scale"),
        ("missing v_scale", (k, v, ks, None), "v_scale"),
        ("missing both (fp8)", (k.float().to(torch.float8_e4m3fn),) * 2 + (None, None), "k_scale"),
        ("k_scale for a bf16 store", (kb, vb, ks, vs), "k_scale"),
        ("v_scale for a bf16 store", (kb, vb, None, vs), "v_scale"),
        ("k_scale batch mismatch", (k, v, ks.expand(2, 2, 4), vs.expand(2, 2, 4)), "k_scale"),
        ("k_scale 2-D", (k, v, ks[:, 0], vs[:, 0]), "k_scale"),
        ("v_scale shape differs", (k, v, ks, vs[..., :2]), "v_scale"),
        ("G does not divide cap", (k, v, torch.ones(1, 2, 5), torch.ones(1, 2, 5)), "k_scale"),
        ("more scales than rows", (k, v, torch.ones(1, 2, 128), torch.ones(1, 2, 128)), "k_scale"),
        ("no scales per head", (k, v, torch.ones(1, 2, 0), torch.ones(1, 2, 0)), "k_scale"),
        ("k_scale float64", (k, v, ks.double(), vs), "k_scale"),
        ("v_scale float16", (k, v, ks, vs.half()), "v_scale"),
        ("k_scale not a tensor", (k, v, 0.5, vs), "k_scale"),
        ("k_scale last dim strided", (k, v, strided, vs), "k_scale"),
    ]


@needs_native
@pytest.mark.parametrize("path", ["native", "reference"])
@pytest.mark.parametrize("launcher", list(_launchers()))
def test_bad_scales_name_the_argument(launcher, path, monkeypatch):
    if (
        path == "reference"
    ):  # the same refusals without the compiled kernels (the prepared calls: before None)
        monkeypatch.setattr(ops, "native_cpu_available", lambda: False)
    call = _launchers()[launcher]
    for what, args, name in _bad_scales():
        with pytest.raises(ValueError, match=rf"\b{name}\b") as err:
            call(*args)
        assert name in str(err.value), f"{launcher}, {what}: {err.value}"


@needs_native
def test_codes_only_for_kv_stores():
    gen = torch.Generator().manual_seed(0)
    (k, v, ks, vs), _ = make_store("int8", 1, 2, 64, 64, torch.ones(1, 64, dtype=torch.bool), gen)
    indices, lengths = torch.arange(8).expand(1, 2, 8).contiguous(), torch.full((1, 2), 8)
    q8 = torch.ones(1, 4, 1, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"q\.dtype"):
        ops.sparse_attention_lse(q8, k, v, indices, lengths, 0.125, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"q\.dtype"):
        ops.ranked_block_attention(q8, k, v, indices, 0, 4, 0.125, 16, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"k\.dtype must be float32, float16 or bfloat16"):
        ops.attention_lse(torch.randn(1, 4, 1, 64), k, v, 0.125)  # dense attention reads no scales
    with pytest.raises(ValueError, match=r"key_min\.dtype must be float32, float16 or bfloat16"):
        ops.block_scores(torch.randn(1, 4, 1, 64), k, v)  # digests stay in the model's dtype


@needs_native
@pytest.mark.parametrize("code", [3, 4])  # the C++ kI8 / kF8
def test_kernel_entry_points_refuse_8bit_digests_and_queries(code):
    # the 8-bit dtypes have attention workers only: the raw entry points refuse them before reading anything
    lib = _library.library()
    isa = _library.isa_code()
    assert lib.tandem_score_topk(isa, code, ctypes.byref(_library.ScoreArgs()), None, 1, None, None, 1) == -1
    args = _library.AttendArgs()
    assert (
        lib.tandem_ranked_attention(isa, 1, ctypes.byref(args), code, *(None, 0, 0, 0), *(None,) * 6, 1) == -1
    )
