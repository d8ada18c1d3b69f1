"""Whether a busy Python thread (the prefill thread, an event loop) slows the replayed decode step: steady steps of
8 requests alone, beside a thread spinning in Python, and beside a thread prefilling chunks (random weights)."""
import contextlib, os, statistics, sys, threading, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.shapes import build_random_model

sys.setswitchinterval(0.0002)  # as the server sets it
SHAPE = os.environ.get("SHAPE", "llama-3.1-8b")
DEV = os.environ.get("DEV", "cuda")
model = build_random_model(SHAPE, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
g = torch.Generator().manual_seed(0)
T, C, N = int(os.environ.get("T", 8192)), int(os.environ.get("C", 2048)), 8
if DEV == "cuda":
    memory.enable_host_pool()
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
V = model.config.vocab_size

def new():
    cache = TandemCache.for_model(model, config, pool=pool)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = T + 512
    return [cache, torch.randint(0, V, (T,), generator=g).tolist(), 0, 1]

def chunk(r):
    cache, ids, s, _ = r
    e = chunk_end(s, T, C)
    r[3] = int(runner.prefill_chunk(cache, ids[s:e], s, last=e == T)[0].argmax())
    r[2] = e
    return e == T

def steps(rows, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        logits = runner.step([r[0] for r in rows], [r[3] for r in rows], [r[0].get_seq_length() for r in rows])
        toks = logits.argmax(-1).tolist()
        ts.append((time.perf_counter() - t) * 1e3)
        for r, tok in zip(rows, toks):
            r[3] = tok
    return f"median {statistics.median(ts):.1f} ms, p90 {sorted(ts)[int(0.9 * len(ts))]:.1f}"

with torch.inference_mode():
    rows = []
    for i in range(N):
        r = new()
        while not chunk(r):
            pass
        rows.append(r)
    steps(rows, 8)
    print(f"{SHAPE} {N} x {T}: alone {steps(rows, 40)}", flush=True)
    stop = threading.Event()
    def spin():
        x = 0
        while not stop.is_set():
            x += 1
    th = threading.Thread(target=spin); th.start()
    print(f"beside a spinning Python thread: {steps(rows, 40)}", flush=True)
    stop.set(); th.join()
    print(f"alone again: {steps(rows, 40)}", flush=True)
    stop.clear()
    def prefill():
        s = torch.cuda.Stream() if DEV == "cuda" else None
        with torch.inference_mode(), torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            while not stop.is_set():
                r = new()
                while not stop.is_set() and not chunk(r):
                    pass
                runner.detach(r[0])
    th = threading.Thread(target=prefill); th.start()
    time.sleep(0.5)
    print(f"beside a prefill thread: {steps(rows, 40)}", flush=True)
    stop.set(); th.join()
    print(f"alone at the end: {steps(rows, 40)}", flush=True)
