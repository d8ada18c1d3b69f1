"""Where the server's decode step goes on the CPU: 32 Tandem caches of 512-token prompts (the default model and
configuration), one `RowsCache` step over the first B of them, timed inside `RowsLayer.attention` (every row's
attention, one row after another) and outside it; beside it `model.forward` with DynamicCache (SDPA) at the same
shapes. Prints one line per batch size."""

import time

import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, load_model
from tandem.engine import freeze_heap
from tandem.integrations import rows as rows_module
from tandem.integrations.hf import generate_cache_kwargs

PROMPT, VOCAB, STEPS = 512, 49152, 10

model, _ = load_model()
freeze_heap()
cache_arg = next(iter(generate_cache_kwargs(model, None)))
gen = torch.Generator().manual_seed(0)
inside = [0.0]
attention = rows_module.RowsLayer.attention


def timed(self, *args, **kwargs):
    start = time.perf_counter()
    out = attention(self, *args, **kwargs)
    inside[0] += time.perf_counter() - start
    return out


rows_module.RowsLayer.attention = timed
with torch.inference_mode():
    caches = []
    for _ in range(32):
        cache = TandemCache.for_model(model, TandemConfig())
        for kv in cache.tandem_layers():
            kv.capacity_hint = PROMPT + 64
        model(input_ids=torch.randint(0, VOCAB, (1, PROMPT), generator=gen), use_cache=True, logits_to_keep=1,
              **{cache_arg: cache})  # fmt: skip
        caches.append(cache)
    for batch in (1, 8, 32):
        totals, inner = [], []
        for _ in range(STEPS):
            rows = caches[:batch]
            positions = torch.tensor([[c.get_seq_length()] for c in rows])
            inside[0] = 0.0
            start = time.perf_counter()
            model(input_ids=torch.randint(0, VOCAB, (batch, 1), generator=gen), position_ids=positions,
                  use_cache=True, **{cache_arg: rows_module.RowsCache(rows)})  # fmt: skip
            totals.append(time.perf_counter() - start)
            inner.append(inside[0])
        i = sorted(range(2, STEPS), key=lambda j: totals[j])[(STEPS - 2) // 2]  # the median step past two
        print(f"tandem rows B={batch}: step {totals[i] * 1e3:.1f} ms, rows' attention {inner[i] * 1e3:.1f} ms "
              f"({inner[i] / totals[i]:.0%}), per row and layer {inner[i] / batch / 30 * 1e6:.0f} us", flush=True)  # fmt: skip
    model.set_attn_implementation("sdpa")
    for batch in (1, 8, 32):
        dynamic = DynamicCache()
        ids = torch.randint(0, VOCAB, (batch, PROMPT), generator=gen)
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_arg: dynamic})
        totals = []
        for _ in range(STEPS):
            start = time.perf_counter()
            model(input_ids=torch.randint(0, VOCAB, (batch, 1), generator=gen), use_cache=True,
                  **{cache_arg: dynamic})  # fmt: skip
            totals.append(time.perf_counter() - start)
        print(f"DynamicCache B={batch}: step {sorted(totals[2:])[(STEPS - 2) // 2] * 1e3:.1f} ms", flush=True)
