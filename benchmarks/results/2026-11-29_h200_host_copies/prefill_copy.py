"""2K prefill into a pooled cache (the server's path) and an 8B-shape 16K prefill (TandemRunner), with the host
tier's writes as `copy_to_host` makes them and as plain strided copies (torch's pageable temporary), alternating."""
import statistics, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.cache import host as host_module
from tandem.engine import TandemRunner
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model

fixed = host_module.copy_to_host
def plain(dst, src, non_blocking):
    dst.copy_(src, non_blocking=non_blocking)
out = open(sys.argv[1], "w")
def w(s):
    print(s); out.write(s + "\n"); out.flush()
w(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
model = build_random_model("smollm2-135m", torch.device("cuda"), torch.bfloat16)
T = 2048
for policy in ("quest", "certified", "streaming"):
    config = TandemConfig(policy=policy)
    runner = RowsRunner(model, slots=8, config=config)
    def one(seed):
        c = TandemCache.for_model(model, config); runner.attach(c)
        for kv in c.tandem_layers(): kv.capacity_hint = T + 128
        ids = torch.randint(0, 1000, (1, T), generator=torch.Generator().manual_seed(seed)).cuda()
        torch.cuda.synchronize(); t = time.perf_counter()
        runner.prefill_chunk(c, ids, 0, last=True)
        torch.cuda.synchronize(); dt = (time.perf_counter() - t) * 1000
        runner.detach(c)
        return dt
    with torch.inference_mode():
        one(0); one(1)
        times = {"copy_to_host": [], "plain": []}
        for i in range(8):
            for name, fn in (("copy_to_host", fixed), ("plain", plain)):
                host_module.copy_to_host = fn
                times[name].append(one(10 + i))
        host_module.copy_to_host = fixed
        w(f"smollm2-135m shape, {policy}, 2K prefill (ms, median of 8): "
          + ", ".join(f"{k} {statistics.median(v):.1f} [{min(v):.1f}-{max(v):.1f}]" for k, v in times.items()))
del model, runner
torch.cuda.empty_cache()
big = build_random_model("llama-3.1-8b", torch.device("cuda"), torch.bfloat16)
config = TandemConfig(policy="quest")
T = 16384
with torch.inference_mode():
    ids = torch.randint(0, 1000, (1, T)).cuda()
    times = {"copy_to_host": [], "plain": []}
    for i in range(3):
        for name, fn in (("copy_to_host", fixed), ("plain", plain)):
            host_module.copy_to_host = fn
            r = TandemRunner(big, TandemCache.for_model(big, config), use_graphs=False)
            torch.cuda.synchronize(); t = time.perf_counter()
            r.prefill(ids, chunk_tokens=2048, max_new_tokens=16)
            torch.cuda.synchronize(); times[name].append((time.perf_counter() - t) * 1000)
            del r
    w("llama-3.1-8b shape, quest, 16K prefill in 2K chunks (ms, each run; the first pair builds kernels): "
      + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in times.items()))
