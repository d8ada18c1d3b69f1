"""Per-step times of a 96-token answer through TandemRunner, as `tandem generate` runs it (warm-up first), per
policy: the first steps (eager, recorded) against the median, and the mean rate against the median's."""
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
ref = {}
for arg in sys.argv[1:]:
    policy, eager = arg.split(':') if ':' in arg else (arg, '1')
    cache = TandemCache.for_model(model, TandemConfig(policy=policy))
    runner = TandemRunner(model, cache)
    runner.warmup_steps = int(eager)
    w = runner.warm_up(2828)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = runner.prefill(ids, max_new_tokens=96)
        first = logits.argmax(-1)
        torch.cuda.synchronize(); t1 = time.perf_counter()
        seconds = []
        toks = []
        for tok in runner.stream(first, 95, seconds):
            toks.append(tok.cpu())
        t2 = time.perf_counter()
    med = statistics.median(seconds)
    toks = torch.cat(toks).tolist()
    same = ref.setdefault(policy, toks) == toks
    print(f"{policy} eager steps {eager} same tokens {same}: warm-up {w:.2f} s, prefill {1e3*(t1-t0):.0f} ms; steps 0-4 ms {[round(1e3*s,1) for s in seconds[:5]]}; "
          f"median {1e3*med:.2f} ms; sum {1e3*sum(seconds):.0f} ms vs 95 x median {95e3*med:.0f} ms; wall {1e3*(t2-t1):.0f} ms; "
          f"mean rate {95/(t2-t1):.0f} tok/s vs median's {1/med:.0f}; steps > 2x median: {[(i, round(1e3*s,1)) for i, s in enumerate(seconds) if s > 2*med][:12]}", flush=True)
