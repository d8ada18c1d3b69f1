"""RSS of one process before and after two loads of 32 x 512-token prompts (RowsCache decode steps at every
batch size 1-32), with (`buckets`) and without (`none`) a decode step at every batch size first."""

import ctypes
import gc
import sys

import torch

from tandem import TandemCache, TandemConfig, load_model
from tandem.engine import freeze_heap
from tandem.integrations.hf import generate_cache_kwargs
from tandem.integrations.rows import RowsCache


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


trim = ctypes.CDLL(None).malloc_trim
model, tok = load_model()
freeze_heap()
arg = next(iter(generate_cache_kwargs(model, None)))
g = torch.Generator().manual_seed(0)


def run(n, prompt, steps, batches):
    caches = []
    for _ in range(n):
        c = TandemCache.for_model(model, TandemConfig())
        for kv in c.tandem_layers():
            kv.capacity_hint = prompt + steps + 8
        for s in range(0, prompt, 256):
            e = min(prompt, s + 256)
            model(
                input_ids=torch.randint(0, 49152, (1, e - s), generator=g),
                position_ids=torch.arange(s, e)[None],
                use_cache=True,
                logits_to_keep=1,
                **{arg: c},
            )
        caches.append(c)
    for B in batches:
        rows = caches[:B]
        for _ in range(steps):
            pos = torch.tensor([[c.get_seq_length()] for c in rows])
            model(
                input_ids=torch.randint(0, 49152, (B, 1), generator=g),
                position_ids=pos,
                use_cache=True,
                **{arg: RowsCache(rows)},
            )
    del caches, rows
    gc.collect()
    trim(0)


with torch.inference_mode():
    run(1, 16, 2, [1])
    print("after warm-up request", round(rss()), flush=True)
    if sys.argv[1] == "buckets":
        run(32, 16, 1, list(range(1, 33)))
        print("after batch-shape warm-up", round(rss()), flush=True)
    run(32, 512, 3, list(range(1, 33)))
    print("after load 1", round(rss()), flush=True)
    run(32, 512, 3, list(range(1, 33)))
    print("after load 2", round(rss()), flush=True)
