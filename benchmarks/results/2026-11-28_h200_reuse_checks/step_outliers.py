"""Where do decode-step outliers come from? Per step: wall time, prepare time, evicting or not, GC events."""
import gc, json, statistics, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner, step
from tandem.shapes import build_random_model

context = int(sys.argv[1]); steps = int(sys.argv[2]); out = sys.argv[3]
variants = sys.argv[4].split(",")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = build_random_model(sys.argv[5] if len(sys.argv) > 5 else "llama-3.1-8b", dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
model.generation_config.eos_token_id = None
ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
results = {}
for variant in variants:
    threads = 12 if "t12" in variant else None
    cache = TandemCache.for_model(model, TandemConfig(policy="quest", cpu_threads=threads))
    runner = TandemRunner(model, cache)
    first = runner.prefill(ids, chunk_tokens=8192, max_new_tokens=steps + 8).argmax(-1)
    host = cache.tandem_layers()[0].host
    prepares, gcs = [], []
    current = [0]
    original = step.DecodeStep.prepare
    def timed(self, layers):
        rows, t = host.rows, time.perf_counter()
        slot = original(self, layers)
        prepares.append(((time.perf_counter() - t) * 1e3, host.rows != rows, self.host_seconds))
        current[0] = len(prepares) - 1
        return slot
    gc_start = {}
    def cb(phase, info):
        if phase == "start":
            gc_start["t"] = time.perf_counter()
        else:
            gcs.append((current[0], info["generation"], (time.perf_counter() - gc_start["t"]) * 1e3))
    step.DecodeStep.prepare = timed
    gc.callbacks.append(cb)
    if "freeze" in variant:
        gc.collect(); gc.freeze()
    try:
        _, seconds = runner.decode(first, steps)
    finally:
        step.DecodeStep.prepare = original
        gc.callbacks.remove(cb)
        gc.unfreeze()
    ms = [s * 1e3 for s in seconds]
    med = statistics.median(ms)
    o = sorted(ms)
    p99 = o[int(0.99 * (len(o) - 1))]
    big = [(i, round(x, 1), round(prepares[i][0], 2), prepares[i][1]) for i, x in enumerate(ms) if x > 1.2 * med]
    g2 = [g for g in gcs if g[1] >= 1 or g[2] > 0.5]
    print(f"{variant}: median {med:.2f} p99 {p99:.2f} ({p99/med:.2f}x) max {o[-1]:.2f}; gcs {len(gcs)}, gen1+/slow {g2[:20]}")
    print("  outliers (step, ms, prepare ms, evicting):", big[:60])
    results[variant] = {"ms": ms, "prepares": prepares, "gcs": gcs}
    del runner, cache
    gc.collect(); torch.cuda.empty_cache()
json.dump(results, open(out, "w"))
