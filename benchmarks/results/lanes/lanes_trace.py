"""GPU trace of replayed b16 x 32K quest steps, one batch against two lanes (apply lanes_separate_graphs.patch)."""

import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from tandem import TandemConfig
from tandem.bench.baselines import release_memory
from tandem.bench.shapes import build_random_model
from tandem.bench.tandem_side import fill_tandem_synthetic
from tandem.engine import TandemRunner
from tandem.engine.runner import lane_sizes
from tandem.integrations.hf import TandemCache

batch, context = 16, 32768
out = os.environ.get("OUT", "/tmp")
model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 200000
for lanes in (1, 2):
    sizes = lane_sizes(batch, lanes)
    caches = [TandemCache.for_model(model, TandemConfig(policy="quest")) for _ in sizes]
    first = 0
    for cache, size in zip(caches, sizes):
        for layer in cache.tandem_layers():
            layer.capacity_hint = context + 64
        fill_tandem_synthetic(cache, model, batch, context, 0, slice(first, first + size))
        first += size
    runner = TandemRunner(model, caches)
    runner.set_positions(torch.full((batch,), context))
    tokens, seconds = runner.decode(torch.zeros(batch, dtype=torch.long), 8)
    print(f"lanes {lanes}: untraced steps " + " ".join(f"{s * 1e3:.1f}" for s in seconds[4:]), flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tokens, seconds = runner.decode(tokens[:, -1], 6)
    print(f"lanes {lanes}: traced steps " + " ".join(f"{s * 1e3:.1f}" for s in seconds), flush=True)
    path = f"{out}/trace_lanes{lanes}.json"
    prof.export_chrome_trace(path)
    # keep only GPU events of the last 2 steps' window, compactly
    trace = json.load(open(path))
    events = [
        e
        for e in trace["traceEvents"]
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation") and "dur" in e
    ]
    events.sort(key=lambda e: e["ts"])
    end = events[-1]["ts"] + events[-1]["dur"]
    span = sum(seconds[-2:]) * 1e6
    keep = [
        {
            "n": e["name"][:60],
            "ts": e["ts"],
            "d": e["dur"],
            "s": e.get("args", {}).get("stream", e.get("tid")),
        }
        for e in events
        if e["ts"] >= end - span
    ]
    json.dump(
        {"lanes": lanes, "steps_ms": [s * 1e3 for s in seconds], "events": keep},
        open(f"{out}/gpu_lanes{lanes}.json", "w"),
    )
    os.remove(path)
    caches = runner = cache = None
    release_memory(torch.device("cuda"))
