"""`request_bytes`, the bytes admission reserves for a request, against what a real cache allocates on the default
model when built as the scheduler builds it: an upper bound, and a tight one."""

import pytest
import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs
from tandem.config import CertifiedConfig, HostConfig, QuestConfig
from tandem.models import attention_shape
from tandem.serve.sizing import HOST_MIN_BLOCKS, CacheShape, host_stores, request_bytes

SMOLLM = CacheShape(num_layers=30, num_q_heads=9, num_kv_heads=3, head_dim=64, dtype=torch.float32)
CONFIGS = {
    "full": TandemConfig(policy="full", sink_tokens=4, window_tokens=16),
    "hgca": TandemConfig(policy="hgca", sink_tokens=4, window_tokens=16),
    "quest": TandemConfig(policy="quest", sink_tokens=4, window_tokens=16, quest=QuestConfig(budget=0.5)),
    "quest-certified": TandemConfig(
        policy="quest", sink_tokens=4, window_tokens=16, certified=CertifiedConfig(epsilon=0.05)
    ),
    "quest-certified-digest": TandemConfig(
        policy="quest",
        sink_tokens=4,
        window_tokens=16,
        certified=CertifiedConfig(epsilon=0.05, bound="digest"),
    ),
    "full-int8": TandemConfig(policy="full", sink_tokens=4, window_tokens=16, host=HostConfig(dtype="int8")),
    "hgca-int8-fraction": TandemConfig(
        policy="hgca", sink_tokens=4, window_tokens=0.25, host=HostConfig(dtype="int8")
    ),
}


@pytest.mark.model
@pytest.mark.parametrize(  # 6 new tokens stay under the host tier's smallest reservation, 1100 go over it
    "name, max_tokens", [(name, 1100) for name in CONFIGS] + [("full", 6), ("hgca-int8-fraction", 6)]
)
def test_estimate_bounds_a_real_cache_tightly(smollm, prose, name, max_tokens):
    model, tok = smollm
    config = CONFIGS[name]
    shape = CacheShape(*attention_shape(model.config), next(model.parameters()).dtype)
    assert shape == SMOLLM
    ids = tok(prose, return_tensors="pt").input_ids[:, :61]
    cache = TandemCache.for_model(model, config)
    for kv in cache.tandem_layers():  # as Scheduler._new_cache does
        kv.capacity_hint = ids.shape[1] + max_tokens
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache))
        for step in range(2):  # decode appends, evicts to the host tier, and must not grow it
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            position = torch.tensor([[ids.shape[1] + step]])
            out = model(input_ids=token, position_ids=position, **generate_cache_kwargs(model, cache))
    stats = cache.stats()
    assert stats["host_rows"] > 0
    estimate = request_bytes(shape, config, ids.shape[1], max_tokens, "cpu")
    assert 0.9 * estimate.host <= stats["host_bytes"] <= estimate.host
    assert 0.9 * estimate.device <= stats["hot_bytes"] <= estimate.device


def test_on_a_cpu_everything_is_host_memory():
    config = CONFIGS["quest"]
    cpu = request_bytes(SMOLLM, config, 100, 100, "cpu")
    cuda = request_bytes(SMOLLM, config, 100, 100, "cuda")
    assert cpu.on_device == 0 and cpu.on_host == cpu.host + cpu.device
    assert cuda.on_host == cuda.host and cuda.on_device == cuda.device
    assert cuda.device > cpu.device  # quest's digests are mirrored on a CUDA device


def test_estimate_grows_with_the_request_and_shrinks_with_int8():
    small = HOST_MIN_BLOCKS * 16 - 100  # prompt + max_tokens within the smallest reservation
    full = CONFIGS["full"]
    assert request_bytes(SMOLLM, full, 50, 10, "cpu") == request_bytes(SMOLLM, full, 50, small, "cpu")
    host = {
        (c, m): request_bytes(SMOLLM, CONFIGS[c], 50, m, "cpu").host
        for c in ("full", "full-int8")
        for m in (2000, 4000)
    }
    assert host["full", 4000] > host["full", 2000] and host["full-int8", 4000] < host["full", 4000] / 3


def test_sliding_layers_count_their_window_alone():
    """Gemma 3's mix: the global layer's tiers as for any model, each sliding layer window - 1 tokens on the
    device and no host tier; the estimate bounds a real cache's bytes."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tandem.integrations.hf import layer_windows

    torch.manual_seed(0)
    text = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    model = Gemma3ForCausalLM(text).eval()
    sliding = tuple(w for w in layer_windows(text) if w is not None)
    shape = CacheShape(*attention_shape(text), torch.float32, sliding)
    config = TandemConfig(policy="full", sink_tokens=4, window_tokens=16)
    prompt, max_tokens = 40, 100
    cache = TandemCache.for_model(model, config)
    for kv in cache.tandem_layers():
        kv.capacity_hint = prompt + max_tokens
    with torch.inference_mode():
        model(
            input_ids=torch.randint(0, 128, (1, prompt)),
            use_cache=True,
            **generate_cache_kwargs(model, cache),
        )
    stats = cache.stats()
    estimate = request_bytes(shape, config, prompt, max_tokens, "cuda")
    one_global = request_bytes(CacheShape(1, 4, 2, 16, torch.float32), config, prompt, max_tokens, "cuda")
    assert estimate.host == one_global.host  # one global layer's host tier, none for the three sliding ones
    assert stats["host_bytes"] <= estimate.host
    assert stats["hot_bytes"] + stats["sliding_bytes"] <= estimate.device
    assert stats["sliding_bytes"] == 3 * 7 * (
        2 * 2 * 16 * 4 + 1
    )  # 3 layers x 7 tokens: K, V float32 and valid


@pytest.mark.parametrize("name", ["full", "hgca", "quest", "quest-certified", "full-int8"])
def test_host_stores_are_the_stores_a_real_host_tier_makes(name):
    """`host_stores`, the sizes the server has made ahead of a request (`cache.memory.HostPool.reserve`), are
    those of the buffers each layer's host tier allocates for the scheduler's capacity hint, one for one."""
    from tests.tiny import tiny_model

    model = tiny_model("Llama", eos_token_id=None)
    config = CONFIGS[name]
    shape = CacheShape(*attention_shape(model.config), torch.float32)
    prompt, max_tokens = 90, 1500
    cache = TandemCache.for_model(model, config)
    for kv in cache.tandem_layers():  # as Scheduler._new_cache does
        kv.capacity_hint = prompt + max_tokens
    with torch.inference_mode():
        model(
            input_ids=torch.randint(0, 128, (1, prompt)),
            use_cache=True,
            **generate_cache_kwargs(model, cache),
        )
    planned = sorted(host_stores(shape, config, prompt, max_tokens))
    for kv in cache.tandem_layers():
        host = kv.host
        made = [getattr(host, n).nbytes for n in host.kept_buffers() if not n.endswith("_dev")]
        assert sorted(made) == planned
