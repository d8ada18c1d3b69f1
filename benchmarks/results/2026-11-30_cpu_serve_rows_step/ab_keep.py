"""A/B in one process: prompts prefilled through the server's path with their prefixes kept (new) against not
(old), 512-token prompts in 256-token chunks, the default model's shape, random weights."""
import statistics, sys, time, torch
from tandem import TandemCache, TandemConfig
from tandem.cache.prefix import PrefixCache
from tandem.engine.prefill import keep_prefix
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
model = build_random_model("smollm2-135m", "cpu", torch.float32)
config = TandemConfig()
runner = RowsRunner(model, slots=n, config=config)
store = PrefixCache()
times = {"keep": [], "none": [], "keep_only": []}
seed = 0
with torch.inference_mode():
    for rep in range(n):
        for name in (("keep", "none") if rep % 2 == 0 else ("none", "keep")):
            seed += 1
            c = TandemCache.for_model(model, config); runner.attach(c)
            ids = torch.randint(1000, 40000, (1, 512), generator=torch.Generator().manual_seed(seed))
            t = time.perf_counter(); k = 0.0
            for s in (0, 256):
                runner.prefill_chunk(c, ids[:, s:s + 256], s, last=s == 256)
                if name == "keep":
                    a = time.perf_counter()
                    keep_prefix(store, c, ids[0].tolist(), s + 256, 256)
                    k += time.perf_counter() - a
            times[name].append(time.perf_counter() - t)
            if name == "keep":
                times["keep_only"].append(k)
            runner.detach(c)
for name, ts in times.items():
    print(name, f"median {statistics.median(ts) * 1e3:.1f} ms  mean {statistics.mean(ts) * 1e3:.1f} ms  n={len(ts)}")
print("entries", store.stats()["entries"])
