"""Where the server's decode step at a part-full batch loses against the engine's static step (8B shape, random
weights, quest, 32K prompts): steady steps, steps between prefill chunks, and steps after a join or a leave."""
import os, statistics, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.shapes import build_random_model

DEV = os.environ.get("DEV", "cuda")
model = build_random_model(os.environ.get("SHAPE", "llama-3.1-8b"), DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
g = torch.Generator().manual_seed(0)
T, C, N = int(os.environ.get("T", 32768)), int(os.environ.get("C", 2048)), 8
if DEV == "cuda":
    memory.enable_host_pool()
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)

def new():
    cache = TandemCache.for_model(model, config, pool=pool)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = T + 256
    return [cache, torch.randint(1000 % model.config.vocab_size, min(40000, model.config.vocab_size), (T,), generator=g).tolist(), 0, 1]

def chunk(r):
    cache, ids, s, _ = r
    e = chunk_end(s, T, C)
    r[3] = int(runner.prefill_chunk(cache, ids[s:e], s, last=e == T)[0].argmax())
    r[2] = e
    return e == T

rec = []
def step(rows, tag):
    caches = [r[0] for r in rows]
    before = (runner.recordings, runner.rebinds)
    t = time.perf_counter()
    logits = runner.step(caches, [r[3] for r in rows], [r[0].get_seq_length() for r in rows])
    toks = logits.argmax(-1).tolist()
    dt = time.perf_counter() - t
    for r, tok in zip(rows, toks):
        r[3] = tok
    rec.append((tag, len(rows), dt, runner.recordings - before[0], runner.rebinds - before[1]))

def show(tag):
    xs = [x for x in rec if x[0] == tag]
    ts = [x[2] * 1e3 for x in xs]
    print(f"{tag}: n={len(xs)} batch={sorted(set(x[1] for x in xs))} median {statistics.median(ts):.1f} ms, "
          f"mean {statistics.mean(ts):.1f}, max {max(ts):.1f}; recordings {sum(x[3] for x in xs)}, rebinds {sum(x[4] for x in xs)}; "
          f"first 6: {[round(t, 1) for t in ts[:6]]}", flush=True)

with torch.inference_mode():
    rows = []
    t = time.perf_counter()
    for i in range(N):
        r = new()
        while not chunk(r):
            pass
        rows.append(r)
    print(f"prefilled {N} x {T} in {time.perf_counter() - t:.1f} s", flush=True)
    for _ in range(24):
        step(rows, "steady 8")
    show("steady 8")
    for _ in range(24):
        step(rows[:4], "steady 4")
    show("steady 4")
    for _ in range(24):
        step(rows, "steady 8 again")
    show("steady 8 again")
    extra = new()
    while True:
        done = chunk(extra)
        step(rows, "after a chunk")
        if done:
            break
    show("after a chunk")
    rows.append(extra)
    for _ in range(8):
        step(rows, "joined: 9")
    show("joined: 9")
    gone = rows.pop(0)
    runner.detach(gone[0]); del gone
    for _ in range(8):
        step(rows, "left: 8")
    show("left: 8")
    # turns: a join every 16 steps with a chunk between each step
    for k in range(3):
        extra = new()
        while True:
            done = chunk(extra)
            step(rows, "turns")
            if done:
                break
        rows.append(extra)
        gone = rows.pop(0)
        runner.detach(gone[0]); del gone
    show("turns")
    # with the torch profiler: 4 steady steps over 8 rows
    for _ in range(6):
        step(rows, "steady 8 last")
    show("steady 8 last")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])) as p:
        for _ in range(4):
            step(rows, "profiled")
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)
    if DEV == "cuda":
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
