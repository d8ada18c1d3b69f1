"""The fused RMSNorm / RoPE kernels (tandem.kernels.gpu.layers) against their references, and the swap of the
model's own layers for them (tandem.engine.fused). Without CUDA the kernels run under Triton's interpreter."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from tests.tolerances import assert_close

pytest.importorskip("triton")

from tandem import TandemCache, TandemConfig, generate_cache_kwargs  # noqa: E402
from tandem.engine import TandemRunner  # noqa: E402
from tandem.engine.fused import FusedLayers  # noqa: E402
from tandem.kernels import gpu, reference  # noqa: E402
from tandem.kernels.gpu import layers  # noqa: E402
from tests.tiny import tiny_model  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
pytestmark = pytest.mark.skipif(not gpu.triton_available(DEVICE), reason=f"no Triton kernels on {DEVICE}")


def check(actual, expected, dtype, msg=""):
    """The tolerance table's check; under the interpreter, bfloat16 results get 2 ulps, since the interpreter
    converts fp32 to bfloat16 by truncation where CUDA and torch round to nearest (a 1-ulp bias per rounding,
    and RoPE rounds two products before their sum, which may cancel: hence an absolute term at the largest
    value's scale)."""
    if gpu.interpreted() and dtype == torch.bfloat16:
        assert not torch.isnan(actual).any(), msg
        atol = 2**-6 * float(expected.float().abs().amax()) if expected.numel() else 0.0
        torch.testing.assert_close(actual, expected, atol=atol, rtol=2**-6, msg=msg)
    else:
        assert_close(actual, expected, dtype, msg)


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 27), (5, 576), (2, 3, 113), (0, 64)])
def test_rms_norm_matches_reference(dtype, shape):
    x = randn(*shape, dtype=dtype) * 3
    weight = randn(shape[-1], dtype=dtype, seed=1)
    out = layers.rms_norm(x, weight, 1e-5)
    expected = reference.rms_norm(x, weight, 1e-5)
    assert out.shape == expected.shape and out.dtype == expected.dtype == dtype
    check(out, expected, dtype)


def test_rms_norm_strided_rows_and_promoted_weight():
    x = randn(4, 2 * 61, dtype=torch.bfloat16)[:, ::2]  # rows strided in the last dim: copied
    weight = randn(61, seed=2)  # fp32 weight: the product is fp32, as torch promotes it
    out = layers.rms_norm(x, weight, 1e-6)
    expected = reference.rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype == torch.float32
    check(out, expected, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch,num_q_heads,num_kv_heads,length,head_dim", [(2, 6, 2, 5, 10), (1, 32, 8, 1, 128)]
)
def test_rotary_matches_reference_on_transposed_views(
    dtype, batch, num_q_heads, num_kv_heads, length, head_dim
):
    # the projections' output viewed as [B, L, H, D] and transposed, as the model's attention passes it
    q = randn(batch, length, num_q_heads, head_dim, dtype=dtype).transpose(1, 2)
    k = randn(batch, length, num_kv_heads, head_dim, dtype=dtype, seed=1).transpose(1, 2)
    cos, sin = (
        randn(batch, length, head_dim, dtype=dtype, seed=2),
        randn(batch, length, head_dim, dtype=dtype, seed=3),
    )
    q_out, k_out = layers.rotary(q, k, cos, sin)
    q_ref, k_ref = reference.rotary(q, k, cos, sin)
    assert q_out.dtype == q_ref.dtype and k_out.shape == k_ref.shape
    check(q_out, q_ref, dtype, "q")
    check(k_out, k_ref, dtype, "k")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 27), (5, 576), (2, 3, 113), (0, 64)])
def test_add_rms_norm_matches_reference(dtype, shape):
    x, residual = randn(*shape, dtype=dtype) * 3, randn(*shape, dtype=dtype, seed=4) * 2
    weight = randn(shape[-1], dtype=dtype, seed=1)
    h, out = layers.add_rms_norm(x, residual, weight, 1e-5)
    h_ref, out_ref = reference.add_rms_norm(x, residual, weight, 1e-5)
    assert h.dtype == h_ref.dtype == dtype and out.dtype == out_ref.dtype == dtype
    if gpu.interpreted() and dtype == torch.bfloat16:
        check(h, h_ref, dtype)  # the interpreter truncates to bfloat16 (see `check`)
    else:
        assert torch.equal(h, h_ref)  # one rounded add: exact
    check(out, out_ref, dtype)


def test_add_rms_norm_refuses_mismatched_residual():
    x = randn(2, 16)
    with pytest.raises(ValueError, match="residual"):
        layers.add_rms_norm(x, randn(2, 8), randn(16), 1e-5)
    with pytest.raises(ValueError, match="residual.dtype"):
        layers.add_rms_norm(x, randn(2, 16, dtype=torch.bfloat16), randn(16), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 48), (3, 2 * 1500), (0, 8)])
def test_silu_mul_matches_reference(dtype, shape):
    gate_up = randn(*shape, dtype=dtype) * 4
    out = layers.silu_mul(gate_up)
    expected = reference.silu_mul(gate_up)
    assert out.shape == expected.shape and out.dtype == dtype
    check(out, expected, dtype)


def test_silu_mul_refuses_odd_width():
    with pytest.raises(ValueError, match="gate_up"):
        layers.silu_mul(randn(2, 7))


def test_rotary_promotes_like_torch():
    q, k = randn(1, 2, 3, 8, dtype=torch.bfloat16), randn(1, 1, 3, 8, dtype=torch.bfloat16, seed=1)
    cos, sin = randn(1, 3, 8, seed=2), randn(1, 3, 8, seed=3)
    q_out, _ = layers.rotary(q, k, cos, sin)
    q_ref, _ = reference.rotary(q, k, cos, sin)
    assert q_out.dtype == q_ref.dtype == torch.float32
    check(q_out, q_ref, torch.bfloat16)


def test_fused_layers_refuse_bad_input():
    x = randn(2, 8)
    with pytest.raises(ValueError, match="weight must have shape"):
        layers.rms_norm(x, randn(7), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        layers.rms_norm(x, randn(8), -1.0)
    q, k, cos = randn(1, 2, 3, 7), randn(1, 1, 3, 7), randn(1, 3, 7)
    with pytest.raises(ValueError, match="even"):
        layers.rotary(q, k, cos, cos)
    q, k = randn(1, 2, 3, 8), randn(1, 1, 3, 8)
    with pytest.raises(ValueError, match=r"cos must have shape \[B, L, D\]"):
        layers.rotary(q, k, randn(1, 4, 8), randn(1, 4, 8))
    with pytest.raises(ValueError, match="k.dtype"):
        layers.rotary(q, k.half(), randn(1, 3, 8), randn(1, 3, 8))


def _logits(model, ids):
    return model(ids).logits


def test_fused_layers_swap_in_reproduce_the_model_and_restore():
    model = tiny_model("Llama").to(DEVICE)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original_rope = modeling.apply_rotary_pos_emb
    fused = FusedLayers(model, DEVICE)
    assert len(fused.norms) == 2 * 2 + 1 and len(fused.rope_modules) == 1 and not fused.skipped
    with torch.no_grad():
        expected = _logits(model, ids)
        with fused:
            assert modeling.apply_rotary_pos_emb is not original_rope
            assert "forward" in model.model.norm.__dict__
            ours = _logits(model, ids)
    check(ours, expected, torch.float32)
    assert modeling.apply_rotary_pos_emb is original_rope
    assert "forward" not in model.model.norm.__dict__


def test_fused_layers_entered_by_two_threads_stay_until_the_last_leaves():
    """A server's decode steps and its prefill thread enter the swap each around their passes: one leaving while
    the other is inside must not put the model's own layers back under it."""
    import threading

    model = tiny_model("Llama").to(DEVICE)
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    original_rope = modeling.apply_rotary_pos_emb
    fused = FusedLayers(model, DEVICE)
    inside, leave = threading.Event(), threading.Event()

    def other():
        with fused:
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    assert inside.wait(30)
    with fused:
        pass  # this thread's pass ends while the other's goes on
    assert modeling.apply_rotary_pos_emb is not original_rope and "forward" in model.model.norm.__dict__
    leave.set()
    thread.join(30)
    assert modeling.apply_rotary_pos_emb is original_rope and "forward" not in model.model.norm.__dict__


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's variant: scales by (1 + weight); the fused kernel does not reproduce it."""

    def __init__(self, size):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return reference.rms_norm(x, 1 + self.weight, self.variance_epsilon)


def test_a_norm_the_kernel_does_not_reproduce_is_kept():
    model = torch.nn.Sequential(OffsetRMSNorm(16)).to(DEVICE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = FusedLayers(model, DEVICE)
    assert fused.norms == [] and fused.skipped == ["OffsetRMSNorm"]
    assert any("OffsetRMSNorm" in str(w.message) for w in caught)


def test_runner_with_fused_layers_matches_dynamic_cache():
    from transformers import DynamicCache

    model = tiny_model("Llama").to(DEVICE)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=8, block_size=4)
    runner = TandemRunner(model, TandemCache.for_model(model, config), fused=True)
    assert runner.fused_layers is not None and runner.fused_layers.active
    first = runner.prefill(ids, chunk_tokens=16, max_new_tokens=8).argmax(-1)
    tokens, _ = runner.decode(first, 6)
    ours = torch.cat([first.cpu()[:, None], tokens], dim=1)
    out = model.generate(
        ids, max_new_tokens=7, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, DynamicCache())
    )
    assert torch.equal(out[:, ids.shape[1] :].cpu(), ours)
    with pytest.raises(ValueError, match="fused must be True, False or 'auto'"):
        TandemRunner(model, runner.cache, fused="yes")
