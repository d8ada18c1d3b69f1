"""Capture breakdown and variants: gc.collect, recording, instantiate; warmup_steps 1 vs 2; frozen heap."""

import gc
import json
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner, freeze_heap
from tandem.engine import step as step_mod
from tandem.shapes import build_random_model

dev = torch.device("cuda")
model = build_random_model("smollm2-135m", dtype=torch.bfloat16, device=dev)
T = {}


def acc(k, v):
    T[k] = T.get(k, 0.0) + v


o_collect = gc.collect


def collect(*a):
    t = time.perf_counter()
    r = o_collect(*a)
    acc("gc", time.perf_counter() - t)
    return r


step_mod.gc.collect = collect
o_begin, o_end, o_cap = step_mod.DecodeStep._begin, step_mod.DecodeStep._end, step_mod.DecodeStep._capture


def end(self, after):
    t = time.perf_counter()
    o_end(self, after)
    acc("capture_end", time.perf_counter() - t)


def cap(self, body):
    t = time.perf_counter()
    o_cap(self, body)
    acc("_capture", time.perf_counter() - t)


step_mod.DecodeStep._end = end
step_mod.DecodeStep._capture = cap
o_replay = step_mod.DecodeStep.replay


def replay(self):
    t = time.perf_counter()
    o_replay(self)
    torch.cuda.synchronize()
    T.setdefault("replays", []).append(round((time.perf_counter() - t) * 1e3, 2))


step_mod.DecodeStep.replay = replay
g = torch.Generator().manual_seed(0)


def run(policy, warmup, label):
    T.clear()
    cache = TandemCache.for_model(model, TandemConfig(policy=policy))
    runner = TandemRunner(model, cache, warmup_steps=warmup)
    ids = torch.randint(0, 49152, (1, 3500), generator=g)
    logits = runner.prefill(ids, max_new_tokens=96)
    secs = []
    t1 = time.perf_counter()
    for _ in runner.stream(logits.argmax(-1), 95, secs):
        pass
    dt = time.perf_counter() - t1
    row = dict(
        label=label,
        policy=policy,
        warmup=warmup,
        rate=round(95 / dt, 1),
        steady_rate=round(1 / sorted(secs)[len(secs) // 2], 1),
        first_ms=[round(s * 1e3, 1) for s in secs[:5]],
        gc_ms=round(T.get("gc", 0) * 1e3, 1),
        capture_ms=round(T.get("_capture", 0) * 1e3, 1),
        capture_end_ms=round(T.get("capture_end", 0) * 1e3, 1),
        replays_ms=T.get("replays", [])[:4],
    )
    print(json.dumps(row), flush=True)


for p in ("streaming", "quest", "certified"):
    run(p, 2, "cold-process" if p == "streaming" else "warm")
for p in ("streaming", "quest"):
    run(p, 2, "warm")
    run(p, 1, "warm")
freeze_heap()
for p in ("streaming", "quest", "certified"):
    run(p, 2, "frozen")
    run(p, 1, "frozen")
