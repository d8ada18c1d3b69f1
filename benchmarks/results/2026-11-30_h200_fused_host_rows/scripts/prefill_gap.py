"""Why a 2K prefill chunk of a 32K prompt takes ~121 ms in the engine and 170-258 ms in the server (8B shape, quest,
random weights). One process, the same RowsRunner the server uses; per-chunk wall times (synchronized):
  alone       - one prompt's 16 chunks back to back
  prefix      - the same, keeping its prefixes in a PrefixCache at the kept boundaries (as the server does)
  turns       - 8 requests of 8K decoding, one decode step between chunks (the server's turns)
  turns+pool  - turns, with the host pool (memory.enable_host_pool) as the server runs it
"""
import os, statistics, sys, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.cache.prefix import PrefixCache
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end, keep_prefix
from tandem.shapes import build_random_model

SHAPE = os.environ.get("SHAPE", "llama-3.1-8b")
DEV = os.environ.get("DEV", "cuda")
model = build_random_model(SHAPE, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
g = torch.Generator().manual_seed(0)
T, C = int(os.environ.get("T", 32768)), 2048
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
V = model.config.vocab_size
if os.environ.get("POOL_FIRST"):
    memory.enable_host_pool()

def new(n):
    cache = TandemCache.for_model(model, config, pool=pool)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = n + 256
    return cache

def prefill(n, between=None, store=None, label=""):
    cache = new(n)
    ids = torch.randint(0, V, (n,), generator=g).tolist()
    s, ts, kept = 0, [], 0
    while s < n:
        e = chunk_end(s, n, C)
        sync(); t = time.perf_counter()
        logits = runner.prefill_chunk(cache, ids[s:e], s, last=e == n)
        logits[0].cpu()
        if store is not None:
            keep_prefix(store, cache, ids, e, C)
        sync(); ts.append(time.perf_counter() - t)
        s = e
        if between is not None and s < n:
            between()
    kept = sum(kv.prompt_rows is not None for kv in cache.tandem_layers())
    if label:
        q = sorted(ts)
        print(f"{label:12s} chunks {len(ts)} mean {statistics.mean(ts)*1e3:6.1f} median {q[len(q)//2]*1e3:6.1f} "
              f"first {ts[0]*1e3:6.1f} last {ts[-1]*1e3:6.1f} max {q[-1]*1e3:6.1f} ms", flush=True)
    return cache, int(logits[0].argmax())

with torch.inference_mode():
    c, _ = prefill(8192)  # kernel builds
    runner.detach(c)
    for rnd in range(2):
        c, _ = prefill(T, label="alone"); runner.detach(c)
    store = PrefixCache(max_bytes=64 << 30)
    for rnd in range(2):
        c, _ = prefill(T, store=store, label="prefix"); runner.detach(c)
    rows = [list(prefill(8192)) for _ in range(8)]
    steps = []
    def step():
        sync(); t = time.perf_counter()
        lg = runner.step([r[0] for r in rows], [r[1] for r in rows], [r[0].get_seq_length() for r in rows])
        for r, tok in zip(rows, lg.argmax(-1).tolist()):
            r[1] = tok
        steps.append(time.perf_counter() - t)
    for _ in range(24):
        step()
    steps.clear()
    for rnd in range(2):
        c, _ = prefill(T, between=step, label="turns"); runner.detach(c)
        print(f"   its steps: mean {statistics.mean(steps)*1e3:.1f} ms over {len(steps)}", flush=True); steps.clear()
    c, _ = prefill(T, between=step, store=store, label="turns+prefix"); runner.detach(c)
    if not os.environ.get("POOL_FIRST"):
        memory.enable_host_pool()
        for rnd in range(3):
            c, _ = prefill(T, between=step, store=store, label="pool+turns+prefix"); runner.detach(c)
        for rnd in range(2):
            c, _ = prefill(T, label="pool alone"); runner.detach(c)
