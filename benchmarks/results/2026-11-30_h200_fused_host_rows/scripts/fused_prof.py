"""Profile one 2K chunk (the 11th of a 32K prompt) with the host rows fused (cuDNN) and Triton-only: CUDA runtime
calls by total time, GPU kernel time by name, the chunk's wall time and GPU busy time."""
import collections, gc, json, os, time, torch
from torch.profiler import profile, ProfilerActivity
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.kernels import ops
from tandem.shapes import build_random_model

model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
T, C, AT = 32768, 2048, 10
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
memory.enable_host_pool()
ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).tolist()
runs = ops.fused_attention_runs

def union(iv):
    tot, end = 0.0, -1.0
    for s, e in sorted(iv):
        if s > end: tot += e - s; end = e
        elif e > end: tot += e - end; end = e
    return tot

def one(fused, prof_it):
    ops.fused_attention_runs = runs if fused else (lambda d, t: False)
    gc.collect()
    cache = TandemCache.for_model(model, config, pool=pool); runner.attach(cache)
    for kv in cache.tandem_layers(): kv.capacity_hint = T + 256
    s = 0
    for i in range(AT):
        e = chunk_end(s, T, C); runner.prefill_chunk(cache, ids[s:e], s, last=False); s = e
    torch.cuda.synchronize()
    e = chunk_end(s, T, C)
    if not prof_it:
        t = time.perf_counter(); runner.prefill_chunk(cache, ids[s:e], s, last=False); torch.cuda.synchronize()
        print(("fused " if fused else "triton"), f"chunk {AT} {1e3*(time.perf_counter()-t):.1f} ms", flush=True)
    else:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter(); runner.prefill_chunk(cache, ids[s:e], s, last=False); torch.cuda.synchronize()
            wall = time.perf_counter() - t
        path = "/tmp/tr.json"; prof.export_chrome_trace(path); ev = json.load(open(path))["traceEvents"]
        k = [x for x in ev if x.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in x]
        rt = [x for x in ev if x.get("cat") == "cuda_runtime" and "dur" in x]
        byk = collections.defaultdict(float); byr = collections.defaultdict(float); nr = collections.Counter()
        for x in k: byk[x["name"][:70]] += x["dur"] / 1e3
        for x in rt: byr[x["name"]] += x["dur"] / 1e3; nr[x["name"]] += 1
        busy = union([(x["ts"], x["ts"] + x["dur"]) for x in k]) / 1e3
        print(("FUSED" if fused else "TRITON"), f"profiled chunk wall {wall*1e3:.1f} ms, GPU busy {busy:.1f} ms", flush=True)
        for n, v in sorted(byk.items(), key=lambda kv: -kv[1])[:10]: print(f"   gpu {v:7.2f} ms  {n}")
        for n, v in sorted(byr.items(), key=lambda kv: -kv[1])[:8]: print(f"   api {v:7.2f} ms x{nr[n]:5d}  {n}")
    runner.detach(cache); del cache

with torch.inference_mode():
    one(True, False); one(False, False)
    one(True, False); one(False, False)
    one(True, True); one(False, True)
