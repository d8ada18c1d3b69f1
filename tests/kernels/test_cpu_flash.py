"""`ops.attention_lse` with many queries on the CPU runs torch's flash attention for the CPU: against the plain-torch
reference at the dtype-keyed tolerances, with key masks of both shapes, queries that have no key to attend,
grouped-query heads and 16-bit inputs."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import ops, reference
from tests.tolerances import assert_close

pytestmark = pytest.mark.skipif(ops._CPU_FLASH is None, reason="no flash attention for the CPU in this torch")


def case(batch, num_q_heads, num_kv_heads, q_len, num_keys, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_q_heads, q_len, head_dim, generator=gen).to(dtype)
    keys = torch.randn(batch, num_kv_heads, num_keys, head_dim, generator=gen).to(dtype)
    values = torch.randn(batch, num_kv_heads, num_keys, head_dim, generator=gen).to(dtype)
    return q, keys, values


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("mask", ("none", "keys", "per query"))
def test_cpu_flash_matches_reference(dtype, mask):
    q, keys, values = case(2, 6, 2, 40, 70, 16, dtype)
    gen = torch.Generator().manual_seed(1)
    key_mask = None
    if mask == "keys":
        key_mask = torch.rand(2, 70, generator=gen) > 0.3
        key_mask[1] = False  # a request with no key to attend
    elif mask == "per query":
        key_mask = torch.rand(2, 40, 70, generator=gen) > 0.5
        key_mask[0, :5] = False  # queries with no key to attend
    calls = []
    flash = ops._CPU_FLASH

    def counted(*args, **kwargs):
        calls.append(1)
        return flash(*args, **kwargs)

    ops._CPU_FLASH = counted
    try:
        out, lse = ops.attention_lse(q, keys, values, 0.25, key_mask)
    finally:
        ops._CPU_FLASH = flash
    assert calls, "many queries on the CPU run the flash kernel"
    ref_out, ref_lse = reference.attention_lse(q, keys, values, 0.25, key_mask)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)  # -inf where no key is attended, as the reference


def test_few_queries_and_no_keys_keep_the_reference(monkeypatch):
    monkeypatch.setattr(ops, "_CPU_FLASH", None)  # the reference answers alone, as for decode
    q, keys, values = case(1, 4, 2, ops.CPU_FLASH_MIN_QUERIES - 1, 30, 8, torch.float32)
    assert not ops._cpu_flash_runs(q, keys)
    out, lse = ops.attention_lse(q, keys, values, 0.3)
    ref_out, ref_lse = reference.attention_lse(q, keys, values, 0.3)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    q, keys, values = case(1, 4, 2, 32, 0, 8, torch.float32)
    out, lse = ops.attention_lse(q, keys, values, 0.3)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize("q_len", (1, 40))  # under and over CPU_FLASH_MIN_QUERIES
def test_causal_attention_matches_reference(dtype, q_len):
    q, keys, values = case(2, 6, 2, q_len, q_len, 16, dtype)
    out, lse = ops.causal_attention_lse(q, keys, values, 0.25)
    tril = torch.ones(q_len, q_len, dtype=torch.bool).tril().expand(2, -1, -1)
    ref_out, ref_lse = reference.attention_lse(q, keys, values, 0.25, tril)
    assert out.dtype == lse.dtype == torch.float32
    assert_close(out, ref_out, dtype)
    assert_close(lse, ref_lse, dtype)
    with pytest.raises(ValueError, match="one length"):
        ops.causal_attention_lse(q, keys[:, :, :-1], values[:, :, :-1], 0.25)
