import sys, time, io, cProfile, pstats
import torch
from torch.profiler import profile, ProfilerActivity
from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model
out = open(sys.argv[1], "w")
def w(s): out.write(s + "\n"); out.flush()
model = build_random_model("smollm2-135m", torch.device("cuda"), torch.bfloat16)
T = 2048
config = TandemConfig(policy="quest")
runner = RowsRunner(model, slots=8, config=config)
def one(seed=0):
    c = TandemCache.for_model(model, config); runner.attach(c)
    for kv in c.tandem_layers(): kv.capacity_hint = T + 128
    ids = torch.randint(0, 1000, (1, T), generator=torch.Generator().manual_seed(seed)).cuda()
    torch.cuda.synchronize(); t = time.perf_counter()
    runner.prefill_chunk(c, ids, 0, last=True)
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) * 1000
    runner.detach(c)
    return dt
with torch.inference_mode():
    w(f"prefill 2K ms: {[round(one(i),1) for i in range(6)]}")
    ids = torch.randint(0, 1000, (1, T)).cuda()
    for _ in range(2): model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(5): model(input_ids=ids, use_cache=False, logits_to_keep=1)
    torch.cuda.synchronize(); w(f"model forward 2K no cache: {(time.perf_counter()-t)*200:.1f} ms")
    pr = cProfile.Profile(); pr.enable(); one(9); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(60); w(s.getvalue())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one(10)
    w(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
