"""cProfile of a 96-token answer's first two decode steps (eager, recorded) through TandemRunner after its
warm-up, per policy: where the one-time cost of a request's decode goes."""
import cProfile, io, pstats, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.engine.step import freeze_heap
from tandem.shapes import build_random_model
dev = torch.device("cuda")
model = build_random_model("smollm2-135m", dev, torch.bfloat16)
freeze_heap()
ids = torch.randint(0, 40000, (1, 2828), generator=torch.Generator().manual_seed(1)).to(dev)
for policy in sys.argv[1:]:
    cache = TandemCache.for_model(model, TandemConfig(policy=policy))
    runner = TandemRunner(model, cache)
    runner.warm_up(2828)
    with torch.inference_mode():
        first = runner.prefill(ids, max_new_tokens=96).argmax(-1)
        torch.cuda.synchronize()
        seconds = []
        gen = runner.stream(first, 95, seconds)
        for i in range(2):
            prof = cProfile.Profile()
            prof.enable(); next(gen).cpu(); prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
            print(f"=== {policy} step {i}: {1e3*seconds[-1]:.1f} ms\n" + "\n".join(s.getvalue().splitlines()[6:24]), flush=True)
        for _ in gen:
            pass
