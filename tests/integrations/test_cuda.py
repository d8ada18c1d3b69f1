"""GPU checks (skipped without CUDA; run on the lent H100 through the device tool, results in
benchmarks/results/2026-11-26_h200_cuda_tests/cuda_tests.md): hot tier on the GPU, pinned host tier,
side-stream evictions."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tandem import TandemCache, TandemConfig, generate_cache_kwargs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]


def _llama_8b_shape(layers=2, dtype=torch.bfloat16):
    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


def test_llama_8b_shape_full_policy_matches_dynamic_cache_on_gpu():
    # teacher-forced: both caches see the same tokens, so per-step logits compare directly. fp32 weights: in bf16
    # the two paths round intermediate activations differently by a few ULP, which hides real errors
    model = _llama_8b_shape(dtype=torch.float32)
    gen = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(0, 128256, (2, 3000), device="cuda", generator=gen)
    steps = torch.randint(0, 128256, (2, 40), device="cuda", generator=gen)
    mask = torch.ones(2, 3040, dtype=torch.long, device="cuda")
    mask[1, :333] = 0
    caches = [DynamicCache(), TandemCache.for_model(model, TandemConfig(policy="full", window_tokens=256))]
    logits = [[], []]
    with torch.inference_mode():
        for which, cache in enumerate(caches):
            kw = generate_cache_kwargs(model, cache)
            out = model(ids, attention_mask=mask[:, :3000], use_cache=True, logits_to_keep=1, **kw)
            logits[which].append(out.logits[:, -1].float())
            for t in range(steps.shape[1]):
                out = model(steps[:, t : t + 1], attention_mask=mask[:, : 3001 + t], use_cache=True, **kw)
                logits[which].append(out.logits[:, -1].float())
    layer = caches[1].tandem_layers()[0]
    assert layer.hot.keys.is_cuda and layer.host.keys.is_pinned()
    assert layer.host.rows >= 3000 - 64 - 333 - 256 - 16
    for base, ours in zip(*logits):
        torch.testing.assert_close(ours, base, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("policy", ["hgca", "quest", "streaming"])
def test_sparse_policies_run_on_gpu(policy):
    model = _llama_8b_shape()
    ids = torch.randint(0, 128256, (1, 2000), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    cache = TandemCache.for_model(model, TandemConfig(policy=policy, window_tokens=128))
    out = model.generate(
        ids, max_new_tokens=20, do_sample=False, pad_token_id=0, **generate_cache_kwargs(model, cache)
    )
    assert out.shape[1] == 2020
    assert cache.stats()["host_rows"] > 0
