"""One row and layer of the CPU decode in a tight loop (SmolLM2's shape, 2 random-weight layers, bf16, a
512-token prompt, the default configuration): the CPU part's merge through the general launcher
(`ops.merge_lse_`) against the prepared compiled call (`DecodeBuffers.merge_cpu_result`), alternating blocks of
150 calls in one process. Prints the median and fastest block per variant, in microseconds per call."""

import time

import torch

import tandem.attention.decode as decode
from tandem import TandemCache, TandemConfig
from tandem.integrations.hf import generate_cache_kwargs
from tandem.shapes import build_random_model

model = build_random_model("smollm2-135m", device="cpu", dtype=torch.bfloat16, num_layers=2)
cache_arg = next(iter(generate_cache_kwargs(model, None)))
gen = torch.Generator().manual_seed(0)
cache = TandemCache.for_model(model, TandemConfig())
for kv in cache.tandem_layers():
    kv.capacity_hint = 4096
layer = cache.layers[0]
q = torch.randn(1, 9, 1, 64, dtype=torch.bfloat16)
k = torch.randn(1, 3, 1, 64, dtype=torch.bfloat16)
v = torch.randn_like(k)
prepared = decode.DecodeBuffers.merge_cpu_result


def general(self, out, lse):
    decode.ops.merge_lse_(out, lse, *self.cpu_result())


def call():
    layer.update(k, v)
    layer.attention(q, k, v, None, 0.125)


times = {"general": [], "prepared": []}
with torch.inference_mode():
    prompt = torch.randint(0, 49152, (1, 512), generator=gen)
    model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
    for _ in range(100):
        call()
    for _ in range(12):
        for name, merge in (("general", general), ("prepared", prepared)):
            decode.DecodeBuffers.merge_cpu_result = merge
            start = time.perf_counter()
            for _ in range(150):
                call()
            times[name].append((time.perf_counter() - start) / 150 * 1e6)
for name, values in times.items():
    values.sort()
    print(f"{name}: median {values[len(values) // 2]:.1f} us, fastest {values[0]:.1f} us per row and layer")
