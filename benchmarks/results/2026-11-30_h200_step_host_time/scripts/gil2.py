"""A/B of the step's host side: each compiled hand-off served by its own call ("per hand-off", as before) against
runs served by one call ("runs"), for steady replayed steps of 8 requests: alone, beside a thread spinning in
Python, beside a thread prefilling chunks, and beside a thread keeping the GPU busy with almost no Python
(replays of a recorded matmul loop). Per phase: the step (runner.step), the replay (launch + hand-offs + join),
the rest of _run (bookkeeping before the launch, the synchronize after). Random weights. Runs on 3950119, whose
`HostFlags.serve` takes a list of parts and whose `run_host_side` is "runs"."""
import contextlib, os, statistics, sys, threading, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine import handoff
from tandem.engine import step as step_module
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
T, C, N, S = int(os.environ.get("T", 8192)), int(os.environ.get("C", 2048)), int(os.environ.get("N", 8)), 40
if DEV == "cuda":
    memory.enable_host_pool()
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
V = model.config.vocab_size
runs = handoff.run_host_side


def per_hand_off(flags, actions, launcher=None, compiled=True):
    """The host side as before: every compiled part laid out, served and finished on its own."""
    failed = launcher.failed if launcher is not None else None
    try:
        for i, action in enumerate(actions):
            part = handoff._native_part(action, compiled)
            if part is None:
                flags.wait_ready(i, failed); action(); flags.set_done(i)
            else:
                flags.serve(i, [part], launcher); part.finish()
    except BaseException:
        flags.set_all_done()
        if launcher is not None:
            with contextlib.suppress(BaseException):
                launcher.join()
        raise
    if launcher is not None:
        launcher.join()


phase = {"replay": [], "run": []}
_replay, _run = step_module.DecodeStep.replay, RowsRunner._run
def timed_replay(self):
    t = time.perf_counter(); _replay(self); phase["replay"].append(time.perf_counter() - t)
def timed_run(self, *a, **k):
    t = time.perf_counter(); _run(self, *a, **k); phase["run"].append(time.perf_counter() - t)
step_module.DecodeStep.replay, RowsRunner._run = timed_replay, timed_run


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
    phase["replay"].clear(); phase["run"].clear()
    for _ in range(n):
        t = time.perf_counter()
        logits = runner.step([r[0] for r in rows], [r[3] for r in rows], [r[0].get_seq_length() for r in rows])
        toks = logits.argmax(-1).tolist()
        ts.append((time.perf_counter() - t) * 1e3)
        for r, tok in zip(rows, toks):
            r[3] = tok
    med = lambda xs: statistics.median(xs) * 1e3 if xs else 0.0
    rep, run = med(phase["replay"]), med(phase["run"])
    kinds = runner.last_step
    return (f"step {statistics.median(ts):5.1f} ms (p90 {sorted(ts)[int(0.9 * len(ts))]:5.1f}) | replay {rep:5.1f} | "
            f"rest of _run {run - rep:4.1f} | outside _run {statistics.median(ts) - run:4.1f} [{kinds}]")

stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        x += 1
def prefill():
    s = torch.cuda.Stream() if DEV == "cuda" else None
    with torch.inference_mode(), torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
        while not stop.is_set():
            r = new()
            while not stop.is_set() and not chunk(r):
                pass
            runner.detach(r[0])
def gpu_only():
    s = torch.cuda.Stream()
    a = torch.randn(2048, 4096, device=DEV, dtype=torch.bfloat16); w = torch.randn(4096, 14336, device=DEV, dtype=torch.bfloat16)
    with torch.cuda.stream(s):
        for _ in range(3):
            a @ w
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            for _ in range(200):
                a @ w
        while not stop.is_set():
            graph.replay(); s.synchronize()

with torch.inference_mode():
    rows = []
    for i in range(N):
        r = new()
        while not chunk(r):
            pass
        rows.append(r)
    steps(rows, 8)
    print(f"{SHAPE} {N} x {T}, quest, switch interval 0.2 ms", flush=True)
    for rnd in range(2):
        for name, fn in (("per hand-off", per_hand_off), ("runs", runs)):
            handoff.run_host_side = fn
            steps(rows, 4)
            print(f"[{name}] alone        {steps(rows, S)}", flush=True)
            for label, target in (("spinner", spin), ("prefill", prefill), ("gpu-only", gpu_only)):
                if DEV != "cuda" and target is gpu_only:
                    continue
                stop.clear()
                th = threading.Thread(target=target); th.start()
                time.sleep(0.3)
                print(f"[{name}] {label:12s} {steps(rows, S)}", flush=True)
                stop.set(); th.join()
    handoff.run_host_side = runs
