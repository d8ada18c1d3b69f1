"""8B-shape prefill through TandemRunner (quest, 2K chunks): later chunks attending the host rows from the layers'
device copy (`LayerKV.keep_prompt_rows`) against streaming them back over PCIe (the copy switched off through
`prefill.prompt_rows_budget`), alternating; the peak device memory of each."""
import sys, time
import torch
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.engine import prefill as prefill_module
from tandem.shapes import build_random_model
budget = prefill_module.prompt_rows_budget
out = open(sys.argv[1], "w")
def w(s):
    print(s); out.write(s + "\n"); out.flush()
w(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
big = build_random_model("llama-3.1-8b", torch.device("cuda"), torch.bfloat16)
config = TandemConfig(policy="quest")
with torch.inference_mode():
    for T in [int(t) for t in sys.argv[2].split(",")]:
        ids = torch.randint(0, 1000, (1, T)).cuda()
        times = {"device copy": [], "streamed": []}
        peaks = {"device copy": [], "streamed": []}
        logits = {}
        for i in range(3):
            for name in times:
                prefill_module.prompt_rows_budget = budget if name == "device copy" else (lambda d, n: 0)
                r = TandemRunner(big, TandemCache.for_model(big, config), use_graphs=False)
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                logits[name] = r.prefill(ids, chunk_tokens=2048, max_new_tokens=16)
                torch.cuda.synchronize(); times[name].append((time.perf_counter() - t) * 1000)
                peaks[name].append(torch.cuda.max_memory_allocated() / 2**30)
                del r
        same = torch.equal(logits["device copy"], logits["streamed"])
        w(f"llama-3.1-8b shape, quest, {T // 1024}K prefill in 2K chunks (ms each run; the first pair builds kernels): "
          + ", ".join(f"{k} {[round(x) for x in v]}" for k, v in times.items())
          + "; peak GiB " + ", ".join(f"{k} {max(v):.1f}" for k, v in peaks.items()) + f"; logits equal: {same}")
