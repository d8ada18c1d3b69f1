"""8B-shape prefill through TandemRunner (quest, 2K chunks) with the host tier's writes as `copy_to_host` makes them
and as plain strided copies, alternating; beside it the model's forward with no cache at all (chunks into
DynamicCache-free SDPA is not the same work; this is only the matmul floor of one 2K chunk, times the chunks)."""
import sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.cache import host as host_module
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model
fixed = host_module.copy_to_host
def plain(dst, src, non_blocking):
    dst.copy_(src, non_blocking=non_blocking)
out = open(sys.argv[1], "w")
def w(s):
    print(s); out.write(s + "\n"); out.flush()
T = int(sys.argv[2])
w(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
big = build_random_model("llama-3.1-8b", torch.device("cuda"), torch.bfloat16)
config = TandemConfig(policy="quest")
with torch.inference_mode():
    ids = torch.randint(0, 1000, (1, T)).cuda()
    times = {"copy_to_host": [], "plain": []}
    for i in range(3):
        for name, fn in (("copy_to_host", fixed), ("plain", plain)):
            host_module.copy_to_host = fn
            r = TandemRunner(big, TandemCache.for_model(big, config), use_graphs=False)
            torch.cuda.synchronize(); t = time.perf_counter()
            r.prefill(ids, chunk_tokens=2048, max_new_tokens=16)
            torch.cuda.synchronize(); times[name].append((time.perf_counter() - t) * 1000)
            del r
    w(f"llama-3.1-8b shape, quest, {T // 1024}K prefill in 2K chunks (ms, each run; the first pair builds kernels): "
      + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in times.items()))
