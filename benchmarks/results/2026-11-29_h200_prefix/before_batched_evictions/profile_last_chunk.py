"""Where the last chunk of a warm request goes (8B shape, quest, 32K document + 256 question)."""
import gc, time, torch
from torch.profiler import profile, ProfilerActivity
from tandem import TandemCache, TandemConfig
from tandem.cache.prefix import PrefixCache
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model

model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 1 << 20
g = torch.Generator().manual_seed(0)
doc = torch.randint(0, 128000, (32768,), generator=g).tolist()
qs = [torch.randint(0, 128000, (256,), generator=g).tolist() for _ in range(4)]
store = PrefixCache()
with torch.inference_mode():
    for policy in ("quest", "certified"):
        config = TandemConfig(policy=policy)
        for i, q in enumerate(qs):
            r = TandemRunner(model, TandemCache.for_model(model, config))
            ids = torch.tensor([doc + q], device="cuda")
            torch.cuda.synchronize(); t = time.perf_counter()
            if i == 3:
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    r.prefill(ids, chunk_tokens=2048, max_new_tokens=8, prefix_cache=store)
                    torch.cuda.synchronize()
            else:
                r.prefill(ids, chunk_tokens=2048, max_new_tokens=8, prefix_cache=store)
                torch.cuda.synchronize()
            print(policy, i, f"{time.perf_counter() - t:.3f}s reused {r.reused_tokens}", flush=True)
            if i == 3:
                print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
            host = r.cache.tandem_layers()[0].host
            print("pinned", host.keys.is_pinned(), host.keys.shape, flush=True)
            del r; gc.collect()
