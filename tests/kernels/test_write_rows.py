"""The host tier's row writes (`gpu.write_rows`: K / V / valid into host memory with the block digests and their
device mirror, one launch) against the plain-torch reference. Without CUDA under Triton's interpreter; on CUDA
into pinned host memory, as the host tier writes them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels import gpu, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not gpu.triton_available(DEVICE),
    reason=f"Triton kernels cannot run on {DEVICE} (TRITON_INTERPRET unset?)",
)


def _case(dtype, batch=2, heads=3, blocks=3, block_size=4, dim=24, seed=0):
    """Rows as a ring's block views (strided), with holes, one all-padding block and one full block."""
    gen = torch.Generator().manual_seed(seed)
    n = blocks * block_size
    ring_k = torch.randn(batch, heads, n + 8, dim, generator=gen).to(DEVICE, dtype)
    ring_v = torch.randn(batch, heads, n + 8, dim, generator=gen).to(DEVICE, dtype)
    valid = torch.rand(batch, n, generator=gen) > 0.4
    valid[0, :block_size] = False  # a block of padding only
    valid[1, block_size : 2 * block_size] = True
    return ring_k[:, :, 4 : 4 + n], ring_v[:, :, 4 : 4 + n], valid.to(DEVICE), block_size


def _outputs(keys, block_size, pin):
    """Zeroed host-tier slices (views into larger stores, as the tier's rows are) and device mirrors."""
    batch, heads, n, dim = keys.shape
    host = dict(device="cpu", pin_memory=pin) if DEVICE.type == "cuda" else dict(device=DEVICE)
    store_k = torch.zeros(batch, heads, n + 16, dim, dtype=keys.dtype, **host)
    store_v = torch.zeros_like(store_k)
    store_valid = torch.zeros(batch, n + 16, dtype=torch.bool, **host)
    digest = torch.zeros(batch, heads, n // block_size + 2, dim, dtype=keys.dtype, **host)
    digests = (digest[:, :, 1:-1], digest.clone()[:, :, 1:-1])
    mirror_store = torch.zeros(batch, heads, n // block_size + 2, dim, dtype=keys.dtype, device=DEVICE)
    mirror = (mirror_store[:, :, 1:-1], mirror_store.clone()[:, :, 1:-1], torch.zeros(
        batch, n // block_size, dtype=torch.bool, device=DEVICE))  # fmt: skip
    rows = (store_k[:, :, 8 : 8 + n], store_v[:, :, 8 : 8 + n], store_valid[:, 8 : 8 + n])
    return rows, digests, mirror


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_digests", [False, True])
def test_write_rows_matches_the_reference(dtype, with_digests):
    keys, values, valid, bs = _case(dtype)
    pin = DEVICE.type == "cuda"
    got_rows, got_digests, got_mirror = _outputs(keys, bs, pin)
    ref_rows, ref_digests, ref_mirror = _outputs(keys, bs, pin)
    digests = (got_digests, ref_digests) if with_digests else (None, None)
    mirror = (got_mirror, ref_mirror) if with_digests else (None, None)
    gpu.write_rows(keys, values, valid, *got_rows, bs, digests=digests[0], mirror=mirror[0])
    reference.write_rows(keys, values, valid, *ref_rows, bs, digests=digests[1], mirror=mirror[1])
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for got, ref in zip(got_rows, ref_rows, strict=True):
        assert torch.equal(got, ref)  # copies: exact
    assert got_rows[0].abs().sum() > 0
    if with_digests:
        for got, ref in zip((*got_digests, *got_mirror), (*ref_digests, *ref_mirror), strict=True):
            assert torch.equal(got, ref)  # a min / max of stored values: exact
        assert torch.isposinf(got_digests[0][0, :, 0]).all() and (got_mirror[0][0, :, 0] == 0).all()
        assert got_mirror[2].tolist() == ref_mirror[2].tolist() and not got_mirror[2][0, 0]


def test_write_rows_refuses_bad_arguments():
    keys, values, valid, bs = _case(torch.float32)
    rows, digests, mirror = _outputs(keys, bs, DEVICE.type == "cuda")
    with pytest.raises(ValueError, match="power of two"):
        gpu.write_rows(keys, values, valid, *rows, 3)
    with pytest.raises(ValueError, match="values must have shape"):
        gpu.write_rows(keys, values[:, :1], valid, *rows, bs)
    with pytest.raises(ValueError, match="mirror needs digests"):
        gpu.write_rows(keys, values, valid, *rows, bs, mirror=mirror)
    with pytest.raises(ValueError, match="dst_valid.dtype"):
        gpu.write_rows(keys, values, valid, rows[0], rows[1], rows[2].float(), bs)
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="pageable"):
            gpu.write_rows(keys, values, valid, rows[0].clone(), rows[1], rows[2], bs)
