"""The staged rows' host copies made before the launch (as before 61b4d6e) against during the replay (61b4d6e,
e7e2229), in alternating rounds of one process: alone (all alone rounds first), beside a spinning thread and beside a
prefilling thread. 8 x 8K quest, 8B shape, random weights. ALONE=1: alone only; ROUNDS (default 3)."""
import cProfile, io, os, pstats, statistics, sys, threading, time, torch
from collections import defaultdict
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine import step as step_module, rows as rows_module, slots as slots_module
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.shapes import build_random_model

sys.setswitchinterval(0.0002)
SHAPE = os.environ.get("SHAPE", "llama-3.1-8b"); DEV = os.environ.get("DEV", "cuda")
model = build_random_model(SHAPE, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
g = torch.Generator().manual_seed(0)
T, C, N = int(os.environ.get("T", 8192)), int(os.environ.get("C", 2048)), int(os.environ.get("N", 8))
if DEV == "cuda":
    memory.enable_host_pool()
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
V = model.config.vocab_size
acc = defaultdict(list)

def wrap(owner, name, label):
    fn = getattr(owner, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label].append(time.perf_counter() - t)
    setattr(owner, name, staticmethod(timed) if isinstance(owner.__dict__.get(name), staticmethod) else timed)

wrap(step_module.DecodeStep, "replay", "replay")
wrap(step_module.DecodeStep, "prepare", "prepare (per cache)")
wrap(step_module.DecodeStep, "wait_for_copies", "wait_for_copies (per cache)")
wrap(slots_module.SlotPool, "stage_evictions", "stage_evictions")
wrap(slots_module.SlotPool, "set_step", "set_step")
wrap(RowsRunner, "_generations", "_generations")
wrap(RowsRunner, "_run", "_run")
wrap(RowsRunner, "_one_step", "_one_step")
wrap(RowsRunner, "_layout", "_layout")
wrap(RowsRunner, "_same_batch", "_same_batch")

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
    acc.clear()
    for _ in range(n):
        t = time.perf_counter()
        logits = runner.step([r[0] for r in rows], [r[3] for r in rows], [r[0].get_seq_length() for r in rows])
        toks = logits.argmax(-1).tolist()
        ts.append(time.perf_counter() - t)
        for r, tok in zip(rows, toks):
            r[3] = tok
    acc["step (caller)"] = ts
    return "; ".join(f"{k} {sum(v) / n * 1e3:.2f}" for k, v in acc.items())

stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        x += 1

def prefill():
    import contextlib
    s = torch.cuda.Stream() if DEV == "cuda" else None
    with torch.inference_mode(), torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
        while not stop.is_set():
            r = new()
            while not stop.is_set() and not chunk(r):
                pass
            runner.detach(r[0])

def separate(pairs):
    for dst, src in pairs:
        dst.copy_(src)

KEEP = ("prepare (per cache)", "stage_evictions", "set_step", "replay", "step (caller)")
def show(rows, n):
    steps(rows, n)
    return "; ".join(f"{k} {sum(acc[k]) / n * 1e3:.2f}" for k in KEEP)

with torch.inference_mode():
    rows = []
    for i in range(N):
        r = new()
        while not chunk(r):
            pass
        rows.append(r)
    steps(rows, 12)
    print(f"{SHAPE} {N} x {T}: ms per step, summed over calls", flush=True)
    if os.environ.get("PROFILE"):
        print("alone:   ", steps(rows, 40), flush=True)
        th = threading.Thread(target=spin); th.start()
        print("spinner: ", steps(rows, 40), flush=True)
        stop.set(); th.join()
        print("alone:   ", steps(rows, 40), flush=True)
        prof = cProfile.Profile()
        prof.enable()
        steps(rows, 30)
        prof.disable()
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(36)
            print("\n".join(line[:150] for line in out.getvalue().splitlines()[6:50]))
    else:
        replay = step_module.DecodeStep.replay
        def before_launch(self, idle=()):  # as on main: wait for the staging buffers, copy, then launch
            if idle:
                torch.cuda.current_stream().synchronize()
            for work in idle:
                work()
            return replay(self)
        modes = (("before the launch", before_launch), ("during the replay", replay))
        # the alone rounds first: after a prefilling thread the host pool's worker zeroes the stores its requests
        # left, beside the next steps, for a while
        for rnd in range(int(os.environ.get("ROUNDS", 3))):
            for name, fn in modes:
                step_module.DecodeStep.replay = fn
                steps(rows, 4)
                print(f"[{name}] alone   ", show(rows, 48), flush=True)
        for label, target in (() if os.environ.get("ALONE") else (("spinner", spin), ("prefill", prefill))):
            for rnd in range(2):
                for name, fn in modes:
                    step_module.DecodeStep.replay = fn
                    stop.clear()
                    th = threading.Thread(target=target); th.start()
                    time.sleep(0.3)
                    print(f"[{name}] {label}", show(rows, 48), flush=True)
                    stop.set(); th.join()
