"""Interleaved A/B of recall copy programs per SM, on filled caches reused across runners (lanes 1 then 2)."""

import statistics
import sys

import torch

from tandem import TandemConfig
from tandem.bench.baselines import release_memory
from tandem.bench.shapes import build_random_model
from tandem.bench.tandem_side import fill_tandem_synthetic
from tandem.engine import TandemRunner
from tandem.engine.runner import lane_sizes
from tandem.integrations.hf import TandemCache
from tandem.kernels.gpu import attention

batch, context = int(sys.argv[1]), int(sys.argv[2])
settings = sys.argv[3].split(",")
lane_counts = [int(x) for x in sys.argv[4].split(",")]
rounds = int(sys.argv[5])
model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 400000
for lanes in lane_counts:
    cfg = TandemConfig(policy="quest")
    sizes = lane_sizes(batch, lanes)
    caches = [TandemCache.for_model(model, cfg) for _ in sizes]
    first = 0
    for cache, size in zip(caches, sizes):
        for layer in cache.tandem_layers():
            layer.capacity_hint = context + 400
        fill_tandem_synthetic(cache, model, batch, context, 0, slice(first, first + size))
        first += size
    positions = torch.full((batch,), context)
    results = {s: [] for s in settings}
    for _ in range(rounds):
        for per_sm in settings:
            attention.RECALL_PROGRAMS_PER_SM = None if per_sm == "all" else float(per_sm)
            runner = TandemRunner(model, caches)
            runner.set_positions(positions)
            tokens, seconds = runner.decode(torch.zeros(batch, dtype=torch.long), 12)
            positions = runner.next_position.cpu()
            step = statistics.median(seconds[4:]) * 1e3
            host = statistics.median(runner.host_seconds[4:]) * 1e3
            results[per_sm].append(step)
            print(
                f"b{batch} {context} lanes {lanes} programs/SM {per_sm}: step {step:.2f} ms, CPU parts {host:.2f} ms",
                flush=True,
            )
            runner = None
    for s, v in results.items():
        print(
            f"SUMMARY b{batch} lanes {lanes} programs/SM {s}: " + " / ".join(f"{x:.2f}" for x in v),
            flush=True,
        )
    caches = cache = None
    release_memory(torch.device("cuda"))
