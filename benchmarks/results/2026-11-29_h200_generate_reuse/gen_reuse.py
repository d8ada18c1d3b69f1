"""Per-step times of a 96-token answer through TandemRunner as `tandem generate` runs it (warm-up on the runner's
own cache, then the request), per policy; tokens against a runner without warm-up (no recording reused)."""
import statistics, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.engine.step import freeze_heap
from tandem.shapes import build_random_model
dev = torch.device("cuda")
model = build_random_model("smollm2-135m", dev, torch.bfloat16)
freeze_heap()
ids = torch.randint(0, 40000, (1, 2828), generator=torch.Generator().manual_seed(1)).to(dev)

def answer(runner):
    with torch.inference_mode():
        t0 = time.perf_counter()
        first = runner.prefill(ids, max_new_tokens=96).argmax(-1)
        torch.cuda.synchronize(); t1 = time.perf_counter()
        seconds, toks = [], []
        for tok in runner.stream(first, 95, seconds):
            toks.append(tok.cpu())
        t2 = time.perf_counter()
    return torch.cat(toks).tolist(), seconds, t1 - t0, t2 - t1

for policy in sys.argv[1:]:
    cold = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy=policy)))
    cold.warm_up(2828)  # (kernels built; this runner's request then starts as before: eager step, recording)
    cold.cache.reset(); cold.release()
    ref, cs, _, cw = answer(cold)
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy=policy)))
    w = runner.warm_up(2828, 96)
    rec = runner.recordings
    toks, seconds, pf, wall = answer(runner)
    med = statistics.median(seconds)
    print(f"{policy}: same tokens as without reuse {toks == ref}; recordings warm-up {rec}, after the answer {runner.recordings}; "
          f"warm-up {w:.2f} s, prefill {1e3*pf:.0f} ms; steps 0-4 ms {[round(1e3*s,1) for s in seconds[:5]]} "
          f"(without reuse {[round(1e3*s,1) for s in cs[:3]]}); median {1e3*med:.2f} ms; "
          f"rate {95/wall:.1f} tok/s (without reuse {95/cw:.1f}) vs median's {1/med:.1f}", flush=True)
