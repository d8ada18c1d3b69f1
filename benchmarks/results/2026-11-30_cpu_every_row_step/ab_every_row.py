"""A/B in one process: the pooled CPU rows step (default policy, B requests of 512 tokens) with the requests that
attend every host row taken past the per-request selection (new, `Policy.every_row_step`) against each through
its selection, buffers and CPU part (old: the hook patched to say no)."""
import statistics, sys, time, torch
from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.policies.quest import QuestPolicy
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
new = QuestPolicy.every_row_step
old = lambda self, layer, q: False
tokens = [1] * n
times = {"old": [], "new": []}
outs = {}
with torch.inference_mode():
    for _ in range(3):
        runner.step(caches, tokens, [c.get_seq_length() for c in caches])
    for rep in range(8):
        order = (("old", old), ("new", new)) if rep % 2 == 0 else (("new", new), ("old", old))
        for name, fn in order:
            QuestPolicy.every_row_step = fn
            for _ in range(4):
                t = time.perf_counter()
                runner.step(caches, tokens, [c.get_seq_length() for c in caches])
                times[name].append(time.perf_counter() - t)
for name, ts in times.items():
    print(name, f"median {statistics.median(ts) * 1e3:.1f} ms  mean {statistics.mean(ts) * 1e3:.1f} ms  n={len(ts)}")
print(f"new / old (medians): {statistics.median(times['new']) / statistics.median(times['old']):.3f}")
