"""`gpu.prefill_attention` (many queries over keys, flash-attention style, returning LSE) against the plain-torch
reference at the dtype-keyed tolerances; causal offsets with the padding rule, key masks and in-place
accumulation. Without CUDA the kernel runs under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import assert_close

pytest.importorskip("triton")

from tandem.attention.hybrid import causal_mask  # noqa: E402
from tandem.kernels import gpu, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
pytestmark = pytest.mark.skipif(not gpu.triton_available(DEVICE), reason=f"no Triton kernels on {DEVICE}")


def case(batch, num_q_heads, num_kv_heads, q_len, num_keys, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    q = rand(batch, q_len, num_q_heads, head_dim).transpose(1, 2)  # the model's transposed view
    keys, values = (
        rand(batch, num_kv_heads, num_keys, head_dim),
        rand(batch, num_kv_heads, num_keys, head_dim),
    )
    valid = (torch.rand(batch, num_keys, generator=gen) > 0.3).to(DEVICE)
    if batch > 1:
        valid[-1] = False  # a request with nothing to attend
    return q, keys, values, valid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_q_heads,num_kv_heads,q_len,num_keys,head_dim",
    [(4, 2, 27, 113, 16), (8, 1, 70, 61, 40), (4, 4, 1, 130, 64), (2, 1, 70, 90, 256)],  # 256: Gemma 3
)
def test_masked_keys_match_reference(dtype, num_q_heads, num_kv_heads, q_len, num_keys, head_dim):
    q, keys, values, valid = case(2, num_q_heads, num_kv_heads, q_len, num_keys, head_dim, dtype)
    out, lse = gpu.prefill_attention(q, keys, values, 0.3, key_valid=valid)
    ref_out, ref_lse = reference.attention_lse(q, keys, values, 0.3, valid)
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")
    assert torch.equal(lse[-1], torch.full_like(lse[-1], float("-inf"))) and not out[-1].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset,q_len", [(0, 70), (45, 27), (130, 1)])
def test_causal_offset_with_padding_matches_the_engines_mask(dtype, offset, q_len):
    num_keys = offset + q_len
    q, keys, values, valid = case(2, 4, 2, q_len, num_keys, 32, dtype, seed=1)
    valid[1] = True
    valid[1, :9] = False  # left padding of the second request, as a ragged prefill has
    valid[1, offset] = False  # a padding query: attends itself only among its own position
    out, lse = gpu.prefill_attention(q, keys, values, 0.2, key_valid=valid, causal_offset=offset)
    mask = causal_mask(valid, offset, num_keys, 0, num_keys)
    ref_out, ref_lse = reference.attention_lse(q, keys, values, 0.2, mask)
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_merges_into_an_earlier_partial_result(dtype):
    q, keys, values, valid = case(2, 4, 2, 33, 90, 32, dtype, seed=2)
    first, second = slice(0, 50), slice(50, 90)
    out, lse = gpu.prefill_attention(
        q, keys[:, :, first], values[:, :, first], 0.25, key_valid=valid[:, first]
    )
    gpu.prefill_attention(
        q,
        keys[:, :, second],
        values[:, :, second],
        0.25,
        key_valid=valid[:, second],
        out=out,
        lse=lse,
        accumulate=True,
    )
    ref_out, ref_lse = reference.attention_lse(q, keys, values, 0.25, valid)
    assert_close(lse, ref_lse, dtype, "lse")
    assert_close(out, ref_out, dtype, "out")
    # merging nothing (all keys masked) leaves the earlier result as it was
    before = out.clone(), lse.clone()
    gpu.prefill_attention(
        q, keys, values, 0.25, key_valid=torch.zeros_like(valid), out=out, lse=lse, accumulate=True
    )
    assert torch.equal(out, before[0]) and torch.equal(lse, before[1])


def test_prefill_attention_refuses_bad_input():
    q, keys, values, valid = case(1, 4, 2, 5, 9, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple of keys heads"):
        gpu.prefill_attention(q, keys[:, :1].expand(1, 3, 9, 16), values[:, :1].expand(1, 3, 9, 16), 0.1)
    with pytest.raises(ValueError, match="key_valid must have shape"):
        gpu.prefill_attention(q, keys, values, 0.1, key_valid=valid[:, :4])
    with pytest.raises(ValueError, match="causal_offset"):
        gpu.prefill_attention(q, keys, values, 0.1, causal_offset=-1)
    with pytest.raises(ValueError, match="accumulate=True needs out and lse"):
        gpu.prefill_attention(q, keys, values, 0.1, accumulate=True)
    with pytest.raises(ValueError, match="keys.dtype"):
        gpu.prefill_attention(q, keys.half(), values.half(), 0.1)
