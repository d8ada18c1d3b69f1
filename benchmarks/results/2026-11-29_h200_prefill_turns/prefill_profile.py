import cProfile, io, pstats, sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine.rows import RowsRunner
from tandem.shapes import build_random_model
out = open(sys.argv[1], "w")
def w(s): out.write(s + "\n"); out.flush()
model = build_random_model("smollm2-135m", torch.device("cuda"), torch.bfloat16)
T = 2048
for policy in ("quest", "streaming"):
    config = TandemConfig(policy=policy)
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
        w(f"{policy} prefill 2K ms: {[round(one(i),1) for i in range(6)]}")
        pr = cProfile.Profile(); pr.enable(); one(9); torch.cuda.synchronize(); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(70); w(s.getvalue())
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); w(s.getvalue())
