"""A/B in one process: the pooled CPU rows step (default policy, B requests of 512 tokens) with the certified
all-rows step counting its live blocks incrementally (new) against a recount at every step (old)."""
import statistics, sys, time, torch
from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.policies import certified as C
from tandem.shapes import build_random_model
n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
model = build_random_model("smollm2-135m", "cpu", torch.float32)
config = TandemConfig()
runner = RowsRunner(model, slots=n, config=config)
caches = []
with torch.inference_mode():
    for i in range(n):
        c = TandemCache.for_model(model, config); runner.attach(c)
        ids = torch.randint(1000, 40000, (1, 512), generator=torch.Generator().manual_seed(i))
        for s in (0, 256):
            runner.prefill_chunk(c, ids[:, s:s + 256], s, last=s == 256)
        caches.append(c)
new_attend_all = C.Certifier.attend_all
def old_attend_all(self, layer, q):
    host = layer.host
    if host is None or host.rows == 0:
        self.step = None
        return
    host.wait()
    live = host.valid[:, : host.rows].view(host.batch, -1, host.block_size).any(-1).sum(-1, keepdim=True)
    self.step = C.AllStep(int(live.sum()))  # the old step's tensor work, then the same count
tokens = [1] * n
times = {"old": [], "new": []}
with torch.inference_mode():
    for _ in range(3):
        runner.step(caches, tokens, [c.get_seq_length() for c in caches])
    for rep in range(8):
        for name, fn in (("old", old_attend_all), ("new", new_attend_all)) if rep % 2 == 0 else (("new", new_attend_all), ("old", old_attend_all)):
            C.Certifier.attend_all = fn
            for _ in range(4):
                t = time.perf_counter()
                runner.step(caches, tokens, [c.get_seq_length() for c in caches])
                times[name].append(time.perf_counter() - t)
for name, ts in times.items():
    print(name, f"median {statistics.median(ts) * 1e3:.1f} ms  mean {statistics.mean(ts) * 1e3:.1f} ms  n={len(ts)}")
print(f"new / old (medians): {statistics.median(times['new']) / statistics.median(times['old']):.3f}")
