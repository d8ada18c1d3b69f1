"""`ops.fused_attention_lse` (cuDNN's fused attention with its LSE: a prefill chunk's attention over host rows
streamed to the GPU, `attention.hybrid._fused_rows`) against the plain-torch reference at the dtype-keyed
tolerances, and where it declines (the caller's Triton kernel then runs)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import ops
from tests.tolerances import assert_close

CUDA = torch.cuda.is_available()


def case(num_q_heads, num_kv_heads, q_len, num_keys, head_dim, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, num_q_heads, q_len, head_dim, generator=gen).to(device, dtype)
    keys = torch.randn(1, num_kv_heads, num_keys, head_dim, generator=gen).to(device, dtype)
    values = torch.randn(1, num_kv_heads, num_keys, head_dim, generator=gen).to(device, dtype)
    return q, keys, values


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,q_len,num_keys,head_dim",
    [
        (32, 8, 1024, 2048, 128),
        (9, 3, 512, 2048, 64),
        (4, 4, 512, 4096, 64),
    ],  # 8B's heads; the default model's
)
def test_fused_attention_matches_reference(dtype, num_q_heads, num_kv_heads, q_len, num_keys, head_dim):
    q, keys, values = case(num_q_heads, num_kv_heads, q_len, num_keys, head_dim, dtype, "cuda")
    fused = ops.fused_attention_lse(q, keys, values, 0.1)
    if fused is None:
        pytest.skip("this torch's cuDNN declines the layout: the Triton kernel runs instead")
    out, lse = fused
    assert ops.fused_attention_ran(q.device, q.dtype)
    ref_out, ref_lse = ops.attention_lse(q.float(), keys.float(), values.float(), 0.1)
    assert (
        out.shape == q.shape
        and out.dtype == dtype
        and lse.shape == q.shape[:3]
        and lse.dtype == torch.float32
    )
    assert_close(out.float(), ref_out, dtype)
    assert_close(lse, ref_lse, dtype)


def test_fused_attention_declines_cpu_tensors_and_float32():
    q, keys, values = case(4, 2, 5, 16, 8, torch.bfloat16, "cpu")
    assert not ops.fused_attention_runs(q.device, q.dtype)
    assert ops.fused_attention_lse(q, keys, values, 0.3) is None
    if CUDA:
        q, keys, values = case(4, 2, 5, 16, 8, torch.float32, "cuda")
        assert ops.fused_attention_lse(q, keys, values, 0.3) is None


def test_a_refused_call_is_remembered(monkeypatch):
    """Where cuDNN refuses a call, the caller is told (None) and the dtype and device are not asked again. CPU
    tensors stand in for a refusing build: the op has no CPU kernel, so it raises as a refusal does."""
    refused = set()
    monkeypatch.setattr(ops, "_FUSED_REFUSED", refused)
    monkeypatch.setattr(ops, "fused_attention_runs", lambda device, dtype: (dtype, device) not in refused)
    q, keys, values = case(4, 2, 5, 16, 8, torch.bfloat16, "cpu")
    assert ops.fused_attention_lse(q, keys, values, 0.3) is None
    assert refused == {(torch.bfloat16, torch.device("cpu"))}


def test_fused_attention_refuses_bad_input():
    q, keys, values = case(4, 2, 5, 16, 8, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="scale"):
        ops.fused_attention_lse(q, keys, values, float("nan"))
    with pytest.raises(ValueError, match="head_dim"):
        ops.fused_attention_lse(q, keys[:, :, :, :4], values[:, :, :, :4], 0.3)
    with pytest.raises(ValueError, match="heads"):
        ops.fused_attention_lse(q[:, :3], keys, values, 0.3)
