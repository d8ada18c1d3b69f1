import time, torch
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.engine.step import read_layout, freeze_heap
from tandem.shapes import build_random_model
dev = torch.device("cuda")
model = build_random_model("smollm2-135m", dev, torch.bfloat16)
freeze_heap()
for policy in ("streaming", "quest", "certified"):
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy=policy)))
    runner.warm_up(2828, 96)
    ids = torch.randint(0, 40000, (1, 2828), generator=torch.Generator().manual_seed(1)).to(dev)
    runner.prefill(ids, max_new_tokens=96)
    layers = runner.cache.tandem_layers()
    t = time.perf_counter(); lay = read_layout(layers, dev); t1 = time.perf_counter()
    with torch.inference_mode():
        runner._step.prepare(layers)
    t2 = time.perf_counter()
    print(f"{policy}: read_layout {1e3*(t1-t)*1:.1f} ms ({len(lay)} entries), first prepare {1e3*(t2-t1):.1f} ms", flush=True)
