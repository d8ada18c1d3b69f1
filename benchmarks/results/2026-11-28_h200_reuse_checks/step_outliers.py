"""Where decode-step outliers come from: per step the wall time, `DecodeStep.prepare`'s time, whether the step
evicted a ring block, and every garbage collection with the step it ran in.

    python step_outliers.py CONTEXT STEPS OUT.json VARIANTS [SHAPE]

VARIANTS: a comma list of names; a name holding "freeze" freezes the heap after the prefill, one holding "t12"
runs the CPU parts on 12 threads. SHAPE: a named shape with random weights (default llama-3.1-8b), quest."""

import gc
import json
import statistics
import sys
import time

import torch

from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner, step
from tandem.shapes import build_random_model


def run(model, ids, steps: int, variant: str) -> dict:
    cache = TandemCache.for_model(
        model, TandemConfig(policy="quest", cpu_threads=12 if "t12" in variant else None)
    )
    runner = TandemRunner(model, cache)
    first = runner.prefill(ids, chunk_tokens=8192, max_new_tokens=steps + 8).argmax(-1)
    host = cache.tandem_layers()[0].host
    prepares, collections, current, started = [], [], [0], [0.0]
    original = step.DecodeStep.prepare

    def timed(self, layers):
        rows, start = host.rows, time.perf_counter()
        slot = original(self, layers)
        prepares.append(((time.perf_counter() - start) * 1e3, host.rows != rows))
        current[0] = len(prepares) - 1
        return slot

    def on_collection(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((current[0], info["generation"], (time.perf_counter() - started[0]) * 1e3))

    step.DecodeStep.prepare = timed
    gc.callbacks.append(on_collection)
    if "freeze" in variant:
        gc.collect()
        gc.freeze()
    try:
        _, seconds = runner.decode(first, steps)
    finally:
        step.DecodeStep.prepare = original
        gc.callbacks.remove(on_collection)
        gc.unfreeze()
    ms = [s * 1e3 for s in seconds]
    median = statistics.median(ms)
    ordered = sorted(ms)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    print(f"{variant}: median {median:.2f} ms, p99 {p99:.2f} ({p99 / median:.2f}x), max {ordered[-1]:.2f}")
    print("  steps past 1.2x the median (step, ms, prepare ms, evicting):", [
        (i, round(t, 1), round(prepares[i][0], 2), prepares[i][1]) for i, t in enumerate(ms) if t > 1.2 * median
    ])  # fmt: skip
    print("  collections past generation 0 or 0.5 ms (step, generation, ms):", [
        c for c in collections if c[1] >= 1 or c[2] > 0.5
    ])  # fmt: skip
    return {"ms": ms, "prepares": prepares, "gcs": collections}


def main() -> None:
    context, steps, out, variants = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random_model(sys.argv[5] if len(sys.argv) > 5 else "llama-3.1-8b", device, dtype)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    results = {}
    for variant in variants:
        results[variant] = run(model, ids, steps, variant)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
