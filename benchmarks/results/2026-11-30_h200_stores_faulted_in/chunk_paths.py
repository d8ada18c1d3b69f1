"""Why the server's 2K chunk of a 32K prompt costs more than the engine's (8B shape, random weights, quest)."""
import statistics, sys, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine import TandemRunner
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.shapes import build_random_model

model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
g = torch.Generator().manual_seed(0)
T, C = 32768, 2048
memory.enable_host_pool()
pool = TaskPool(config.host.threads)

def prompt():
    return torch.randint(0, 128000, (T,), generator=g).tolist()

def sync():
    torch.cuda.synchronize()

def engine_prefill(tag):
    r = TandemRunner(model, TandemCache.for_model(model, config, pool=pool))
    ids = torch.tensor([prompt()], device="cuda")
    sync(); t = time.perf_counter()
    r.prefill(ids, chunk_tokens=C, max_new_tokens=256)
    sync()
    print(f"{tag}: engine prefill {time.perf_counter() - t:.3f} s ({(time.perf_counter() - t) / (T // C) * 1e3:.0f} ms a chunk)", flush=True)
    del r

def rows_prefill(runner, tag, decoding=(), profile=False):
    cache = TandemCache.for_model(model, config, pool=pool)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = T + 256
    ids = prompt()
    times, s = [], 0
    while s < T:
        e = chunk_end(s, T, C)
        if decoding:
            runner.step(list(decoding), [1] * len(decoding), [c.get_seq_length() for c in decoding])
        sync(); t = time.perf_counter()
        if profile and s == 8 * C:
            from torch.profiler import profile as prof, ProfilerActivity
            with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                runner.prefill_chunk(cache, ids[s:e], s, last=e == T)[0].cpu()
                sync()
            print(p.key_averages().table(sort_by="cpu_time_total", row_limit=30), flush=True)
        else:
            runner.prefill_chunk(cache, ids[s:e], s, last=e == T)[0].cpu()
        sync()
        times.append(time.perf_counter() - t)
        s = e
    mid = times[1:-1]
    print(f"{tag}: first {times[0]*1e3:.0f} ms, middle median {statistics.median(mid)*1e3:.0f} ms "
          f"(min {min(mid)*1e3:.0f}, max {max(mid)*1e3:.0f}), last {times[-1]*1e3:.0f} ms, total {sum(times):.3f} s",
          flush=True)
    return cache

with torch.inference_mode():
    engine_prefill("warm-up")
    engine_prefill("engine A")
    pooled = RowsRunner(model, slots=16, config=config)
    plain = RowsRunner(model, slots=0)
    c = rows_prefill(plain, "rows, own hot tier")
    del c
    c = rows_prefill(pooled, "rows, pooled hot tier"); pooled.detach(c); del c
    c = rows_prefill(pooled, "rows, pooled hot tier again"); pooled.detach(c); del c
    engine_prefill("engine B")
    # decoding requests beside the chunks, as in the server
    dec = [rows_prefill(pooled, f"decoder {i}") for i in range(4)]
    for _ in range(4):
        pooled.step(dec, [1] * 4, [c.get_seq_length() for c in dec])
    c = rows_prefill(pooled, "rows, pooled, a step of 4 before each chunk", decoding=dec)
    pooled.detach(c); del c
    c = rows_prefill(pooled, "rows, pooled, alone again", profile="-p" in sys.argv)
    pooled.detach(c); del c
    engine_prefill("engine C")
