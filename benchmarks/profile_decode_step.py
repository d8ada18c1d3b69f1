"""Where a Tandem decode step's time goes, on a random-weight model of a real shape (GPU host).

For each context: the engine's step with the CPU part trivial (`streaming`: the GPU side, host-node
round trips and bookkeeping), the same with `quest` (plus the CPU attention), and `quest` without CUDA
graphs; with the seconds spent inside the CPU parts, which threads ran them, and the CPU part of one layer
timed on the main thread for comparison.

    python benchmarks/profile_decode_step.py --model llama-3.1-8b --contexts 16k,64k
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.attention import decode
from tandem.bench.baselines import release_memory
from tandem.bench.shapes import build_random_model
from tandem.bench.tandem_side import fill_tandem_synthetic
from tandem.engine import TandemRunner


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--contexts", default="16k,64k")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = build_random_model(args.model, "cuda", torch.bfloat16, num_layers=args.layers)
    model.config.max_position_embeddings = 1 << 20
    threads_seen: set[int] = set()
    original = decode.host_part

    def traced(*a, **k):
        threads_seen.add(threading.get_ident())
        return original(*a, **k)

    decode.host_part = traced
    results = []
    for text in args.contexts.split(","):
        context = int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)
        for policy, graphs in (("streaming", True), ("streaming", False), ("quest", True), ("quest", False)):
            threads_seen.clear()
            cache = TandemCache.for_model(model, TandemConfig(policy=policy))
            runner = TandemRunner(model, cache, use_graphs=graphs)
            fill_tandem_synthetic(cache, model, 1, context)
            runner.set_positions(torch.full((1,), context))
            _, seconds = runner.decode(torch.zeros(1, dtype=torch.long), 4 + args.steps)
            step_ms = statistics.median(seconds[4:]) * 1e3
            host_ms = statistics.median(runner.host_seconds[4:]) * 1e3
            layer = cache.tandem_layers()[0]
            bufs = layer.decode_buffers
            start = time.perf_counter()
            for _ in range(20):
                original(layer, bufs, layer.head_dim**-0.5, cache.pool, True)
            main_ms = (time.perf_counter() - start) / 20 * 1e3
            row = {
                "context": context,
                "policy": policy,
                "graphs": graphs,
                "step_ms": round(step_ms, 2),
                "cpu_parts_ms": round(host_ms, 2),
                "cpu_part_threads": len(threads_seen),
                "one_layer_cpu_part_on_main_thread_ms": round(main_ms, 3),
                "layers": len(cache.tandem_layers()),
            }
            print(json.dumps(row), flush=True)
            results.append(row)
            del cache, runner, bufs, layer
            release_memory(torch.device("cuda"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
