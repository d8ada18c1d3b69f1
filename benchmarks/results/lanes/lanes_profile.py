"""b16 x 32K quest: step time and the host's time in CPU parts, lanes 1 and 2 (separate graphs)."""

import os
import statistics
import sys

import torch

os.environ.setdefault("TANDEM_LANE_GRAPHS", "separate")
from tandem import TandemConfig
from tandem.bench.baselines import release_memory
from tandem.bench.shapes import build_random_model
from tandem.bench.tandem_side import fill_tandem_synthetic
from tandem.engine import TandemRunner
from tandem.engine.runner import lane_sizes
from tandem.integrations.hf import TandemCache

batch, context = int(sys.argv[1]), int(sys.argv[2])
shares = [float(x) for x in sys.argv[3].split(",")]
model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 200000
for share in shares:
    for lanes in [int(x) for x in sys.argv[4].split(",")]:
        cfg = TandemConfig(policy="quest", gpu_share=share)
        sizes = lane_sizes(batch, lanes)
        caches = [TandemCache.for_model(model, cfg) for _ in sizes]
        runner = TandemRunner(model, caches)
        first = 0
        for cache, size in zip(caches, sizes):
            for layer in cache.tandem_layers():
                layer.capacity_hint = context + 20
            fill_tandem_synthetic(cache, model, batch, context, 0, slice(first, first + size))
            first += size
        runner.set_positions(torch.full((batch,), context))
        tokens, seconds = runner.decode(torch.zeros(batch, dtype=torch.long), 14)
        step = statistics.median(seconds[4:]) * 1e3
        host = statistics.median(runner.host_seconds[4:]) * 1e3
        print(
            f"share {share} lanes {lanes}: step {step:.2f} ms, CPU parts {host:.2f} ms ({host / step:.0%} of the step)",
            flush=True,
        )
        caches = runner = cache = None
        release_memory(torch.device("cuda"))
