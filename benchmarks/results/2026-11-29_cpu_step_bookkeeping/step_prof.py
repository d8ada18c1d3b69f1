"""cProfile of the server's decode step on this CPU: the default model, N requests of 512-token prompts."""
import cProfile, io, pstats, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.engine.step import freeze_heap
from tandem.models import load_model
n = int(sys.argv[1])
model, tok = load_model(None, device="cpu")
config = TandemConfig()
runner = RowsRunner(model, slots=n, config=config)
caches = []
t0 = time.perf_counter()
with torch.inference_mode():
    for i in range(n):
        c = TandemCache.for_model(model, config); runner.attach(c)
        ids = torch.randint(1000, 40000, (1, 512), generator=torch.Generator().manual_seed(i))
        for s in (0, 256):
            logits = runner.prefill_chunk(c, ids[:, s:s + 256], s, last=s == 256)
        caches.append(c)
print(f"policy {config.policy}; prefill {n} x 512: {time.perf_counter() - t0:.1f} s", flush=True)
freeze_heap()
tokens = [1] * n
def step():
    return runner.step(caches, tokens, [c.get_seq_length() for c in caches])
with torch.inference_mode():
    for _ in range(3):
        step()
    times = []
    for _ in range(4):
        a = time.perf_counter(); step(); times.append(time.perf_counter() - a)
    print("unprofiled steps ms", [round(1e3 * t) for t in times], flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(4):
        step()
    prof.disable()
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(40)
    print(s.getvalue())
