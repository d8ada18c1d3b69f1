"""The compressed host tier in the Triton kernels: int8 / float8_e4m3fn KV stores with one float32 scale per
(request, KV head, G rows), decoded in registers by `gpu.host_block_attention` and `gpu.recall_blocks`, against
the references on the decoded store (`reference.dequantize`, rounded to the dtype the kernel computes in).
Without CUDA they run on CPU tensors under Triton's interpreter (tests/conftest.py turns it on); with CUDA the
store and its scales sit in pinned host memory, read zero-copy."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tolerances import assert_close

pytest.importorskip("triton")

from tandem.kernels import gpu, ops, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KINDS = list(reference.QUANT_DTYPES)
pytestmark = pytest.mark.skipif(
    not gpu.triton_available(DEVICE),
    reason=f"Triton kernels cannot run on {DEVICE} (TRITON_INTERPRET unset?)",
)


def host(t: torch.Tensor) -> torch.Tensor:
    """Where the host tier lives: pinned host memory next to a GPU, plain CPU memory under the interpreter."""
    return t.cpu().pin_memory() if DEVICE.type == "cuda" else t.cpu()


def quantized_store(batch, num_kv_heads, num_rows, head_dim, rows_per_scale, kind, gen):
    """(keys, values, k_scale, v_scale, valid): 8-bit codes of rows whose magnitudes vary by 16x between scale
    groups, padding rows (left padding in request 0) that store 0."""
    valid = torch.rand(batch, num_rows, generator=gen) > 0.15
    valid[0, :3] = False
    stores = []
    for _ in range(2):
        x = torch.randn(batch, num_kv_heads, num_rows, head_dim, generator=gen)
        x *= torch.logspace(-0.6, 0.6, num_rows)[torch.randperm(num_rows, generator=gen)][:, None]
        stores.append(reference.quantize_blocks(x, valid, rows_per_scale, kind))
    (keys, k_scale), (values, v_scale) = stores
    return keys, values, k_scale, v_scale, valid


def selection(batch, num_kv_heads, num_blocks, gen):
    """Block ids [B, Hkv, W] with ragged lengths (one empty, one full) whose live entries include ids past the
    store and -1 (skipped), and garbage past the lengths (never read)."""
    width = max(2, num_blocks // 2)
    picks = torch.stack(
        [torch.randperm(num_blocks + 2, generator=gen)[:width] for _ in range(batch * num_kv_heads)]
    ).view(batch, num_kv_heads, width)
    picks[0, -1, 0] = -1
    lengths = torch.randint(1, width + 1, (batch, num_kv_heads), generator=gen)
    lengths[0, 0] = 0
    lengths[-1, -1] = width
    past = torch.arange(width) >= lengths[..., None]
    return torch.where(past, torch.full_like(picks, 10**6), picks), lengths


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "batch, num_kv_heads, group, num_rows, head_dim, block_size, rows_per_scale, dtype",
    [
        (2, 2, 4, 61, 64, 1, 1, torch.bfloat16),
        (1, 2, 1, 40, 128, 1, 4, torch.float16),
        (2, 1, 8, 53, 80, 16, 1, torch.float32),
        (2, 2, 4, 60, 64, 16, 4, torch.bfloat16),
        (1, 1, 4, 48, 128, 16, 4, torch.float32),
    ],
)
def test_host_block_attention_decodes_8bit_stores(
    kind, batch, num_kv_heads, group, num_rows, head_dim, block_size, rows_per_scale, dtype
):
    gen = torch.Generator().manual_seed(num_rows + head_dim)
    keys, values, k_scale, v_scale, valid = quantized_store(
        batch, num_kv_heads, num_rows, head_dim, rows_per_scale, kind, gen
    )
    block_ids, lengths = selection(batch, num_kv_heads, -(-num_rows // block_size), gen)
    q = torch.randn(batch, num_kv_heads * group, head_dim, generator=gen).to(DEVICE, dtype)
    scale = 1 / math.sqrt(head_dim)
    out, lse = gpu.host_block_attention(
        q, host(keys), host(values), block_ids.to(DEVICE), lengths.to(DEVICE), block_size, host(valid), scale,
        k_scale=host(k_scale), v_scale=host(v_scale),
    )  # fmt: skip
    # the kernel decodes in fp32 and rounds to q's dtype for the tensor-core dots
    decoded = [reference.dequantize(c, s).to(dtype) for c, s in ((keys, k_scale), (values, v_scale))]
    ref_out, ref_lse = reference.host_block_attention(
        q.cpu(), *decoded, block_ids, lengths, block_size, valid, scale
    )
    assert_close(lse.cpu(), ref_lse, dtype, "lse")
    assert_close(out.cpu(), ref_out, dtype, "out")
    assert torch.all(lse[0, :group] == float("-inf")) and torch.all(out[0, :group] == 0)  # empty selection
    # the launcher's CPU path (the reference on the fp32 decoding) agrees at the same tolerance
    cpu_out, cpu_lse = ops.host_block_attention(
        q.cpu(), keys, values, block_ids, lengths, block_size, valid, scale, k_scale=k_scale, v_scale=v_scale
    )
    assert_close(lse.cpu(), cpu_lse, dtype, "ops lse")
    assert_close(out.cpu(), cpu_out, dtype, "ops out")


def test_host_block_attention_splits_merge_an_8bit_store():
    gen = torch.Generator().manual_seed(7)
    keys, values, k_scale, v_scale, valid = quantized_store(2, 2, 160, 64, 4, "fp8", gen)
    block_ids, lengths = selection(2, 2, 10, gen)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    args = (q, host(keys), host(values), block_ids.to(DEVICE), lengths.to(DEVICE), 16, host(valid), 0.125)
    one = gpu.host_block_attention(*args, num_splits=1, k_scale=host(k_scale), v_scale=host(v_scale))
    three = gpu.host_block_attention(*args, num_splits=3, k_scale=host(k_scale), v_scale=host(v_scale))
    for got, want in zip(three, one):
        assert_close(got.cpu(), want.cpu(), torch.float32)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "block_size, rows_per_scale, dtype",
    [(1, 1, torch.float32), (1, 4, torch.bfloat16), (16, 1, torch.float16), (16, 4, torch.bfloat16)],
)
def test_recall_blocks_decodes_an_8bit_source(kind, block_size, rows_per_scale, dtype):
    """Blocks copied into their slots decoded to the cache's dtype, exactly as the reference rounds them; the
    store's last block partial (rows past it not valid), other slots untouched."""
    gen = torch.Generator().manual_seed(block_size + rows_per_scale)
    batch, heads, dim, slots, width = 2, 3, 72, 7, 5
    num_blocks = 12
    num_rows = num_blocks * block_size - (4 if block_size > 1 else 0)  # a partial last block
    src_k, src_v, k_scale, v_scale, src_valid = quantized_store(
        batch, heads, num_rows, dim, rows_per_scale, kind, gen
    )
    cache_rows = heads * slots * block_size
    cache = [torch.randn(batch, cache_rows, dim, generator=gen).to(dtype) for _ in range(2)]
    cache.append(torch.rand(batch, cache_rows, generator=gen) > 0.5)
    src_ids = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch * heads)])
    dst_ids = torch.stack([torch.randperm(slots, generator=gen)[:width] for _ in range(batch * heads)])
    src_ids, dst_ids = src_ids.view(batch, heads, width), dst_ids.view(batch, heads, width)
    counts = torch.tensor([[0, 2, width], [1, width, 3]])
    expected = [t.clone() for t in cache]
    reference.recall_blocks(
        src_k, src_v, src_valid, *expected, src_ids, dst_ids, counts, block_size, slots,
        src_k_scale=k_scale, src_v_scale=v_scale,
    )  # fmt: skip
    # the reference against the decoded store copied as it is
    decoded = [reference.dequantize(c, s) for c, s in ((src_k, k_scale), (src_v, v_scale))]
    plain = [t.clone() for t in cache]
    reference.recall_blocks(*decoded, src_valid, *plain, src_ids, dst_ids, counts, block_size, slots)
    assert all(torch.equal(a, b) for a, b in zip(plain, expected))
    actual = [t.clone().to(DEVICE) for t in cache]
    gpu.recall_blocks(
        host(src_k), host(src_v), host(src_valid), *actual,
        src_ids.to(DEVICE), dst_ids.to(DEVICE), counts.to(DEVICE), block_size, slots,
        src_k_scale=host(k_scale), src_v_scale=host(v_scale),
    )  # fmt: skip
    live = expected[2]  # rows past the store hold whatever was written: only valid rows are ever read
    assert torch.equal(actual[2].cpu(), live)
    assert torch.equal(actual[0].cpu()[live], expected[0][live])
    assert torch.equal(actual[1].cpu()[live], expected[1][live])
    copied = torch.zeros_like(live)
    for b, h in zip(*torch.nonzero(counts, as_tuple=True)):
        for slot in dst_ids[b, h, : counts[b, h]]:
            start = (h * slots + slot) * block_size
            copied[b, start : start + block_size] = True
    assert torch.equal(actual[0].cpu()[~copied], cache[0][~copied])


def test_recall_decodes_every_float8_code_exactly():
    """All 254 finite e4m3fn codes (subnormals, -0 and +-448 included) through the kernel's integer decoding."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # 0x7F / 0xFF are NaN, never stored
    src = codes.view(1, 1, 254, 1).expand(1, 1, 254, 16).contiguous()
    src_scale = torch.ones(1, 1, 254)
    cache = torch.zeros(1, 254, 16, device=DEVICE)
    valid = torch.zeros(1, 254, dtype=torch.bool, device=DEVICE)
    ids = torch.zeros(1, 1, 1, dtype=torch.long, device=DEVICE)
    counts = torch.ones(1, 1, dtype=torch.long, device=DEVICE)
    src_valid = torch.ones(1, 254, dtype=torch.bool)
    gpu.recall_blocks(
        host(src), host(src), host(src_valid), cache, cache.clone(), valid, ids, ids, counts, 254, 1,
        src_k_scale=host(src_scale), src_v_scale=host(src_scale),
    )  # fmt: skip
    want = src.float()[0, 0]
    assert torch.equal(cache[0].cpu(), want)
    assert torch.equal(torch.signbit(cache[0].cpu()), torch.signbit(want))


def _block_args():
    gen = torch.Generator().manual_seed(11)
    keys, values, k_scale, v_scale, valid = quantized_store(1, 2, 32, 64, 4, "int8", gen)
    block_ids, lengths = selection(1, 2, 2, gen)
    return dict(
        q=torch.randn(1, 8, 64, generator=gen).to(DEVICE),
        keys=host(keys),
        values=host(values),
        block_ids=block_ids.to(DEVICE),
        lengths=lengths.to(DEVICE),
        block_size=16,
        valid=host(valid),
        scale=0.125,
        k_scale=host(k_scale),
        v_scale=host(v_scale),
    )


def _recall_args():
    keys = torch.zeros(1, 2, 32, 8, dtype=torch.int8)
    scales = torch.ones(1, 2, 8)
    ids = torch.zeros(1, 2, 2, dtype=torch.long, device=DEVICE)
    return dict(
        src_keys=host(keys),
        src_values=host(keys),
        src_valid=host(torch.ones(1, 32, dtype=torch.bool)),
        keys=torch.zeros(1, 2 * 3 * 4, 8, device=DEVICE),
        values=torch.zeros(1, 2 * 3 * 4, 8, device=DEVICE),
        valid=torch.ones(1, 24, dtype=torch.bool, device=DEVICE),
        src_ids=ids,
        dst_ids=ids,
        counts=torch.zeros(1, 2, dtype=torch.long, device=DEVICE),
        block_size=4,
        slots=3,
        src_k_scale=host(scales),
        src_v_scale=host(scales),
    )


BAD_CALLS = {
    "missing k_scale": (
        _block_args,
        lambda a: {"k_scale": None},
        "k_scale is required for a store of int8 codes",
    ),
    "missing v_scale": (_block_args, lambda a: {"v_scale": None}, "v_scale is required"),
    "scales of a float store": (
        _block_args,
        lambda a: {
            "keys": host(a["keys"].bfloat16()),
            "values": host(a["values"].bfloat16()),
            "q": a["q"].bfloat16(),
        },
        "k_scale must be None for a bfloat16 store",
    ),
    "k_scale heads": (
        _block_args,
        lambda a: {"k_scale": a["k_scale"][:, :1]},
        r"k_scale must have shape \[B, Hkv, T // G\] = \[1, 2, \?\]",
    ),
    "v_scale shape": (_block_args, lambda a: {"v_scale": a["v_scale"][..., :4]}, "v_scale must have shape"),
    "k_scale dtype": (
        _block_args,
        lambda a: {"k_scale": a["k_scale"].half(), "v_scale": a["v_scale"].half()},
        "k_scale.dtype must be float32",
    ),
    "G not dividing T": (
        _block_args,
        lambda a: {"k_scale": host(torch.ones(1, 2, 5)), "v_scale": host(torch.ones(1, 2, 5))},
        r"k_scale.shape\[2\] must divide the store's T = 32 rows",
    ),
    "k_scale strided": (
        _block_args,
        lambda a: {"k_scale": host(torch.ones(1, 2, 16))[..., ::2]},
        "k_scale must be contiguous in its last dimension",
    ),
    "mixed 8-bit stores": (
        _block_args,
        lambda a: {"values": a["values"].view(torch.float8_e4m3fn)},
        "values.dtype must be int8",
    ),
    "recall missing scales": (
        _recall_args,
        lambda a: {"src_k_scale": None, "src_v_scale": None},
        "src_k_scale is required",
    ),
    "recall scales of a float source": (
        _recall_args,
        lambda a: {"src_keys": host(a["src_keys"].float()), "src_values": host(a["src_values"].float())},
        "src_k_scale must be None for a float32 store",
    ),
    "recall G not dividing T": (
        _recall_args,
        lambda a: {"src_k_scale": host(torch.ones(1, 2, 3)), "src_v_scale": host(torch.ones(1, 2, 3))},
        r"src_k_scale.shape\[2\] must divide",
    ),
    "recall 8-bit cache": (
        _recall_args,
        lambda a: {"keys": a["keys"].to(torch.int8)},
        "keys.dtype must be float32 or float16 or bfloat16",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_launchers_refuse_bad_scales(case):
    make_args, change, message = BAD_CALLS[case]
    args = make_args()
    args.update(change(args))
    launcher = gpu.recall_blocks if "src_keys" in args else gpu.host_block_attention
    with pytest.raises(ValueError, match=message):
        launcher(**args)


def test_reference_path_refuses_bad_scales():
    """The launchers' CPU path (`ops`, the reference there) checks the scales too, with `ops._check_kv_scales`."""
    args = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in _block_args().items()}
    with pytest.raises(ValueError, match="k_scale is required"):
        ops.host_block_attention(**{**args, "k_scale": None})
    with pytest.raises(ValueError, match="must divide the store's T = 32 rows"):
        ops.host_block_attention(**{**args, "k_scale": torch.ones(1, 2, 5), "v_scale": torch.ones(1, 2, 5)})
    args = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in _recall_args().items()}
    with pytest.raises(ValueError, match="src_v_scale is required"):
        ops.recall_blocks(**{**args, "src_v_scale": None})
