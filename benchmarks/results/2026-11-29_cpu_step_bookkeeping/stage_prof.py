"""CPU: cProfile of the pool's staging (`SlotPool.stage_evictions`) and of `DecodeStep.prepare` over replayed-
shape steps of B pooled requests (random weights of the default model's shape)."""
import cProfile, io, pstats, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import slots as slots_mod, step as step_mod
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model
B, L, policy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model = build_random_model("smollm2-135m", "cpu", torch.float32)
config = TandemConfig(policy=policy)
runner = RowsRunner(model, slots=B, config=config)
caches = []
t0 = time.perf_counter()
with torch.inference_mode():
    for b in range(B):
        c = TandemCache.for_model(model, config); runner.attach(c)
        ids = torch.randint(0, 1000, (1, L), generator=torch.Generator().manual_seed(b))
        runner.prefill_chunk(c, ids, 0, last=True)
        caches.append(c)
print(f"prefill {B} x {L}: {time.perf_counter() - t0:.1f} s", flush=True)
step_mod.freeze_heap()
prof = cProfile.Profile()
orig_stage, orig_prep = slots_mod.SlotPool.stage_evictions, step_mod.DecodeStep.prepare
acc = {"stage": 0.0, "prepare": 0.0}
def stage(self, *a, **k):
    t = time.perf_counter(); prof.enable()
    try: return orig_stage(self, *a, **k)
    finally: prof.disable(); acc["stage"] += time.perf_counter() - t
def prep(self, *a, **k):
    t = time.perf_counter(); prof.enable()
    try: return orig_prep(self, *a, **k)
    finally: prof.disable(); acc["prepare"] += time.perf_counter() - t
with torch.inference_mode():
    for _ in range(2):
        runner.step(caches, [1] * B, [c.get_seq_length() for c in caches])
    slots_mod.SlotPool.stage_evictions, step_mod.DecodeStep.prepare = stage, prep
    n = 16
    t = time.perf_counter()
    for _ in range(n):
        runner.step(caches, [1] * B, [c.get_seq_length() for c in caches])
    total = time.perf_counter() - t
print(f"B={B} {policy}: step {1e3 * total / n:.1f} ms; staging {1e3 * acc['stage'] / n:.2f} ms, prepare {1e3 * acc['prepare'] / n:.2f} ms per step (profiled)")
s = io.StringIO()
pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
print(s.getvalue())
