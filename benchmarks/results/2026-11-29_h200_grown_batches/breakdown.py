"""Per-part wall time of replayed B-request steps (no profiler): prepare, staging, waits, set_step, replay."""
import sys, time, gc, json
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import rows as rows_mod, step as step_mod, slots as slots_mod
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model

out = open(sys.argv[1], "w")
B = int(sys.argv[2]) if len(sys.argv) > 2 else 64
policy = sys.argv[3] if len(sys.argv) > 3 else "quest"
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
wrap(step_mod.DecodeStep, "prepare", "prepare")
wrap(step_mod.DecodeStep, "replay", "replay")
wrap(step_mod.DecodeStep, "wait_for_copies", "wait_for_copies")
wrap(slots_mod.SlotPool, "stage_evictions", "stage_evictions")
wrap(slots_mod.SlotPool, "set_step", "set_step")
wrap(RowsRunner, "_generations", "generations")
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
model = build_random_model("smollm2-135m", dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
config = TandemConfig(policy=policy)
runner = RowsRunner(model, slots=B, config=config)
step_mod.freeze_heap()
with torch.inference_mode():
    caches = []
    pre = []
    for b in range(B):
        c = TandemCache.for_model(model, config); runner.attach(c)
        ids = torch.randint(0, 1000, (1, int(sys.argv[4]) if len(sys.argv) > 4 else 2048), generator=torch.Generator().manual_seed(b)).to(dev)
        sync(); t = time.perf_counter()
        runner.prefill_chunk(c, ids, 0, last=True)
        sync(); pre.append((time.perf_counter() - t) * 1000)
        caches.append(c)
    out.write(f"prefill 2K ms: first {pre[0]:.1f}, median of rest {sorted(pre[1:])[len(pre)//2]:.1f}\n")
    for _ in range(4):
        runner.step(caches, [1] * B, [c.get_seq_length() for c in caches])
    acc.clear()
    n = 32
    sync(); t = time.perf_counter()
    for _ in range(n):
        runner.step(caches, [1] * B, [c.get_seq_length() for c in caches])
    total = (time.perf_counter() - t) * 1000 / n
    out.write(f"B={B} {policy} replayed step: {total:.1f} ms; recordings {runner.recordings}\n")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        out.write(f"  {k}: {v * 1000 / n:.2f} ms/step\n")
out.close()
