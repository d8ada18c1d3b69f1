"""The runner's replayed, shrinking and joining steps of 64 pooled quest requests (random weights of the default
model's shape, 2,048-token prompts), timed and profiled: `python3 profile_rebind.py OUT.txt 64` on a CUDA machine.
Writes the timings and cProfile's tables to OUT.txt."""

import cProfile
import gc
import io
import pstats
import sys
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model

model = build_random_model("smollm2-135m", torch.device("cuda"), torch.bfloat16)
out = open(sys.argv[1], "w")
B = int(sys.argv[2]) if len(sys.argv) > 2 else 64
config = TandemConfig(policy="quest")
runner = RowsRunner(model, slots=B, config=config)


def timed(caches, n, profile=None):
    ts = []
    for _s in range(n):
        t = time.perf_counter()
        if profile:
            profile.enable()
        runner.step(caches, [1] * len(caches), [c.get_seq_length() for c in caches])
        if profile:
            profile.disable()
        ts.append((time.perf_counter() - t) * 1000)
    return ts


def dump(title, pr):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    out.write(f"== {title}\n" + s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(40)
    out.write(s.getvalue())


with torch.inference_mode():
    caches = []
    t = time.perf_counter()
    for b in range(B):
        c = TandemCache.for_model(model, config)
        runner.attach(c)
        for kv in c.tandem_layers():
            kv.capacity_hint = 2048 + 200
        ids = torch.randint(0, 1000, (1, 2048), generator=torch.Generator().manual_seed(b)).cuda()
        runner.prefill_chunk(c, ids, 0, last=True)
        caches.append(c)
    torch.cuda.synchronize()
    out.write(f"prefill {B} x 2K: {(time.perf_counter() - t) * 1000 / B:.1f} ms each\n")
    first = timed(caches, 5)
    out.write(f"B={B} first steps (eager, record, replays) ms: {[round(x, 1) for x in first]}\n")
    pr = cProfile.Profile()
    rep = timed(caches, 10, pr)
    out.write(
        f"B={B} replay ms: {[round(x, 1) for x in rep]} rebinds {runner.rebinds} recordings {runner.recordings}\n"
    )
    dump(f"replay B={B}", pr)
    pr = cProfile.Profile()
    shrink = []
    for _ in range(10):
        c = caches.pop(0)
        runner.detach(c)
        del c
        gc.collect()
        shrink += timed(caches, 1, pr)
    out.write(
        f"shrink ms: {[round(x, 1) for x in shrink]} rebinds {runner.rebinds} recordings {runner.recordings}\n"
    )
    dump("shrinking (rebind each step)", pr)
    pr = cProfile.Profile()
    join = []
    for s in range(10):
        c = TandemCache.for_model(model, config)
        runner.attach(c)
        for kv in c.tandem_layers():
            kv.capacity_hint = 2048 + 200
        ids = torch.randint(0, 1000, (1, 2048), generator=torch.Generator().manual_seed(100 + s)).cuda()
        runner.prefill_chunk(c, ids, 0, last=True)
        caches.append(c)
        join += timed(caches, 1, pr)
    out.write(
        f"join ms: {[round(x, 1) for x in join]} rebinds {runner.rebinds} recordings {runner.recordings}\n"
    )
    dump("joining (rebind each step)", pr)
    caches = caches[-3:]
    few = timed(caches, 6)
    out.write(
        f"3 requests left (rows {[runner.pool.row(c) for c in caches]}) ms: {[round(x, 1) for x in few]} recordings {runner.recordings}\n"
    )
out.close()
