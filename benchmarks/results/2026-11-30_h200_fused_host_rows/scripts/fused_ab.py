"""A 32K prompt's chunked prefill (2K chunks, 8B shape, quest, random weights) with the host rows through cuDNN's
fused attention (`hybrid._fused_rows`) against the Triton kernel only, alternating in one process."""
import gc, os, statistics, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.kernels import ops
from tandem.shapes import build_random_model

model = build_random_model(os.environ.get("SHAPE", "llama-3.1-8b"), "cuda", torch.bfloat16)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
T, C = int(os.environ.get("T", 32768)), int(os.environ.get("C", 2048))
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
memory.enable_host_pool()
ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).tolist()
runs = ops.fused_attention_runs

def prefill(fused: bool):
    ops.fused_attention_runs = runs if fused else (lambda device, dtype: False)
    gc.collect()
    cache = TandemCache.for_model(model, config, pool=pool)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = T + 256
    s, ts = 0, []
    torch.cuda.synchronize(); t0 = time.perf_counter()
    while s < T:
        e = chunk_end(s, T, C)
        t = time.perf_counter()
        logits = runner.prefill_chunk(cache, ids[s:e], s, last=e == T)
        torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        s = e
    total = time.perf_counter() - t0
    runner.detach(cache)
    del cache
    return total, ts, logits.float().cpu()

with torch.inference_mode():
    prefill(True); prefill(False)  # kernel builds, cuDNN plans
    results = {True: [], False: []}
    last = {}
    for rnd in range(int(os.environ.get("ROUNDS", 3))):
        for fused in (True, False):
            total, ts, logits = prefill(fused)
            results[fused].append(total); last[fused] = logits
            print(f"{'fused' if fused else 'triton':6s} {total:6.3f} s  chunks median {statistics.median(ts)*1e3:6.1f} ms  "
                  f"first {ts[0]*1e3:6.1f} last {ts[-1]*1e3:6.1f}", flush=True)
            if os.environ.get("SERIES"):
                print("   " + " ".join(f"{t*1e3:.0f}" for t in ts), flush=True)
    d = (last[True] - last[False]).abs()
    print(f"fused / triton: {statistics.median(results[True]) / statistics.median(results[False]):.3f}; "
          f"logits max diff {d.max():.4f}, argmax equal {bool(last[True].argmax() == last[False].argmax())}, "
          f"cosine {torch.nn.functional.cosine_similarity(last[True].flatten(), last[False].flatten(), dim=0):.6f}")
