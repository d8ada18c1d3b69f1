"""The certified selection's Triton kernels (`kernels.gpu.certify`): the histogram against
`reference.certify_histogram`, the sketch bounds against the torch version, both inside the selection. On CUDA, or
on CPU tensors under Triton's interpreter."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tandem.kernels import gpu, reference  # noqa: E402
from tandem.kernels.gpu import certify as gpu_certify  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    not gpu.triton_available(DEVICE),
    reason=f"Triton kernels cannot run on {DEVICE} (TRITON_INTERPRET unset?)",
)


def inputs(rows: int, n: int, seed: int):
    """Bounds spread over ~30 nats (past the last bin's 24), random holes, one row with nothing free."""
    gen = torch.Generator().manual_seed(seed)
    mass = torch.randn(rows, n, generator=gen) * 8
    lower = mass - torch.rand(rows, n, generator=gen) * 2
    free = torch.rand(rows, n, generator=gen) > 0.3
    free[-1] = False
    mass = mass.masked_fill(torch.rand(rows, n, generator=gen) > 0.9, -math.inf)  # dead units are never free
    free &= torch.isfinite(mass)
    top = mass.masked_fill(~free, -math.inf).amax(-1).double()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return tuple(t.to(DEVICE) for t in (mass, lower, free, top))


@pytest.mark.parametrize("rows, n", [(3, 27), (5, 113), (2, gpu_certify.HISTOGRAM_TILE + 61)])
@pytest.mark.parametrize("with_lower", [True, False])
def test_histogram_matches_the_reference(rows, n, with_lower):
    mass, lower, free, top = inputs(rows, n, seed=rows * n)
    lower = lower if with_lower else None
    tail, count, gained = gpu_certify.certify_histogram(mass, lower, free, top)
    want_tail, want_count, want_gained = reference.certify_histogram(mass, lower, free, top)
    assert torch.equal(count, want_count)
    assert int(count.sum()) == int(free.sum())  # every free unit in one bin, the others in none
    torch.testing.assert_close(tail, want_tail, rtol=1e-12, atol=0)
    if with_lower:
        torch.testing.assert_close(gained, want_gained, rtol=1e-12, atol=0)
    else:
        assert gained is None


def test_histogram_refuses_bad_inputs():
    mass, lower, free, top = inputs(2, 40, seed=0)
    with pytest.raises(ValueError, match="free"):
        gpu_certify.certify_histogram(mass, lower, free.int(), top)
    with pytest.raises(ValueError, match="top"):
        gpu_certify.certify_histogram(mass, lower, free, top.float())
    with pytest.raises(ValueError, match="lower"):
        gpu_certify.certify_histogram(mass, lower[:, :10], free, top)


@pytest.mark.parametrize("forced", [False, True])
def test_the_certified_selection_is_the_same_through_the_kernel(monkeypatch, forced):
    """`certify.certified_blocks` with the histogram from the kernel (as on CUDA) and from the reference."""
    from tandem.kernels import ops
    from tandem.policies import certify

    batch, num_kv_heads, group, n = 2, 2, 3, 300
    mass, lower, _, _ = inputs(batch * num_kv_heads * group, n, seed=5)
    mass, lower = (t.view(batch, num_kv_heads * group, n) for t in (mass, lower))
    known = (
        torch.randn(batch, num_kv_heads * group, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 4
    )
    keep = None
    if forced:
        keep = (
            torch.rand(batch, num_kv_heads, n, generator=torch.Generator().manual_seed(2)).to(DEVICE) > 0.95
        )
    args = (mass, known, 0.05, 40, num_kv_heads, lower, keep)
    monkeypatch.setattr(ops, "_triton_on", lambda device: False)
    want = certify.certified_blocks(*args)
    monkeypatch.setattr(ops, "_triton_on", lambda device: True)
    got = certify.certified_blocks(*args)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert 0 < int(want[0].sum()) < want[0].numel()  # a selection, neither empty nor everything


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, n", [(4, 1, 27), (8, 2, 113), (6, 6, 200)])
def test_sketch_bounds_match_the_torch_version(monkeypatch, dtype, num_q_heads, num_kv_heads, n):
    """The kernel against `certify.sketch_logit_bounds` in torch, over a view of a wider store (the device
    mirror is capacity-wide) with padding rows; within fp32 rounding, which the bounds' slack covers."""
    from tandem.kernels import ops
    from tandem.policies import certify

    gen = torch.Generator().manual_seed(n)
    batch, dim, capacity = 2, 64, n + 37
    keys = torch.randn(batch, num_kv_heads, capacity, dim, generator=gen)
    live = torch.rand(batch, capacity, generator=gen) > 0.2
    codes, row_scale, error = (t.to(DEVICE) for t in certify.key_sketch(keys, live))
    q = torch.randn(batch, num_q_heads, dim, generator=gen).to(DEVICE, dtype)
    args = (q, codes[:, :, :n], row_scale[:, :, :n], error[:, :, :n], live[:, :n].to(DEVICE), dim**-0.5)
    monkeypatch.setattr(ops, "_triton_on", lambda device: False)
    want = certify.sketch_logit_bounds(*args)
    monkeypatch.setattr(ops, "_triton_on", lambda device: True)
    got = certify.sketch_logit_bounds(*args)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == (batch, num_q_heads, n)
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sketch_bounds_refuse_bad_inputs():
    from tandem.kernels.gpu import certify as launch

    q = torch.randn(1, 4, 16).to(DEVICE)
    codes = torch.zeros(1, 2, 10, 16, dtype=torch.int8).to(DEVICE)
    side = torch.zeros(1, 2, 10).to(DEVICE)
    valid = torch.ones(1, 10, dtype=torch.bool).to(DEVICE)
    with pytest.raises(ValueError, match="codes"):
        launch.sketch_bounds(q, codes.float(), side, side, valid, 0.25)
    with pytest.raises(ValueError, match="row_valid"):
        launch.sketch_bounds(q, codes, side, side, valid[:, :5], 0.25)
    with pytest.raises(ValueError, match="scale"):
        launch.sketch_bounds(q, codes, side, side, valid, -1.0)


def test_a_kernel_that_fails_to_build_leaves_the_torch_version_in_its_place(monkeypatch):
    """A Triton build failure on some GPU must not take the default policy down: warned once, then the torch
    version for the rest of the process. Input errors still raise."""
    from tandem.kernels import gpu, ops

    monkeypatch.setattr(ops, "_CERTIFY_FALLBACK", {})
    monkeypatch.setattr(ops, "_triton_on", lambda device: True)
    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(gpu, "certify_histogram", broken)
    mass, lower, free, top = inputs(3, 50, seed=3)
    want = reference.certify_histogram(mass, lower, free, top)
    with pytest.warns(RuntimeWarning, match="certify_histogram failed"):
        got = ops.certify_histogram(mass, lower, free, top)
    again = ops.certify_histogram(mass, lower, free, top)  # no second try, no second warning
    assert calls == [1]
    for a, b, c in zip(got, want, again, strict=True):
        assert torch.equal(a, b) and torch.equal(c, b)
    with pytest.raises(ValueError, match="top"):
        monkeypatch.setattr(ops, "_CERTIFY_FALLBACK", {})
        monkeypatch.setattr(gpu, "certify_histogram", gpu_certify.certify_histogram)
        ops.certify_histogram(mass, lower, free, top.float())
