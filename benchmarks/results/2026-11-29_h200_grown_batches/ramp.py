"""The serve load's ramp on the runner alone: each turn prefills one new request, then steps every decoding one.
Per turn: the step's wall time, recordings / rebinds, and the step's parts; then a cProfile of the ramp's steps."""
import cProfile, pstats, io, sys, time, gc
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import rows as rows_mod, step as step_mod, slots as slots_mod
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model

out = open(sys.argv[1], "w")
B = int(sys.argv[2]) if len(sys.argv) > 2 else 64
profile_from = int(sys.argv[3]) if len(sys.argv) > 3 else 40
acc = {}
def wrap(owner, name, key):
    fn = getattr(owner, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
    setattr(owner, name, staticmethod(timed) if isinstance(owner.__dict__[name], staticmethod) else timed)
for owner, name in ((step_mod.DecodeStep, "prepare"), (step_mod.DecodeStep, "replay"), (step_mod.DecodeStep, "capture"),
                    (slots_mod.SlotPool, "stage_evictions"), (RowsRunner, "_serve"), (RowsRunner, "_rebindable"),
                    (RowsRunner, "_body"), (RowsRunner, "_layout"), (RowsRunner, "_new_batch")):
    wrap(owner, name, name)
dev = torch.device("cuda")
model = build_random_model("smollm2-135m", dev, torch.bfloat16)
config = TandemConfig(policy="quest")
runner = RowsRunner(model, slots=B, config=config)
step_mod.freeze_heap()
pr = cProfile.Profile()
with torch.inference_mode():
    caches, tokens = [], []
    for turn in range(B + 20):
        if turn < B:
            c = TandemCache.for_model(model, config); runner.attach(c)
            for kv in c.tandem_layers(): kv.capacity_hint = 2048 + 128
            ids = torch.randint(0, 1000, (1, 2048), generator=torch.Generator().manual_seed(turn)).to(dev)
            torch.cuda.synchronize(); t = time.perf_counter()
            runner.prefill_chunk(c, ids, 0, last=True)
            torch.cuda.synchronize(); pre = (time.perf_counter() - t) * 1000
            caches.append(c)
        else:
            pre = 0.0
        acc.clear(); r0, b0 = runner.recordings, runner.rebinds
        if turn >= profile_from: pr.enable()
        t = time.perf_counter()
        runner.step(caches, [1] * len(caches), [c.get_seq_length() for c in caches])
        dt = (time.perf_counter() - t) * 1000
        if turn >= profile_from: pr.disable()
        parts = " ".join(f"{k}={v*1000:.1f}" for k, v in sorted(acc.items(), key=lambda kv: -kv[1]) if v > 0.0005)
        out.write(f"turn {turn} batch {len(caches)} prefill {pre:.0f} step {dt:.1f} ms rec+{runner.recordings - r0} rebind+{runner.rebinds - b0} | {parts}\n")
        out.flush()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(45); out.write(s.getvalue())
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); out.write(s.getvalue())
out.close()
