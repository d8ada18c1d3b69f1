"""Where a warm request's time goes (8B shape, quest, 32K document + 256 question)."""
import time, torch
from tandem import TandemCache, TandemConfig
from tandem.cache import snapshot
from tandem.cache.prefix import PrefixCache
from tandem.cache.host import HostTier
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model

model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 1 << 20
g = torch.Generator().manual_seed(0)
doc = torch.randint(0, 128000, (32768,), generator=g).tolist()
q1 = torch.randint(0, 128000, (256,), generator=g).tolist()
q2 = torch.randint(0, 128000, (256,), generator=g).tolist()
config = TandemConfig(policy="quest")
T = {}
def timed(name, fn):
    def wrap(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize(); T[name] = T.get(name, 0) + time.perf_counter() - t
        return out
    return wrap
snapshot._restore_layer = timed("restore_layer", snapshot._restore_layer)
snapshot.take = timed("take", snapshot.take)
HostTier.reserve = timed("host_reserve", HostTier.reserve)
from tandem.cache import layer as layer_mod
layer_mod.LayerKV.make_tiers = timed("make_tiers", layer_mod.LayerKV.make_tiers)
from tandem.engine import runner as runner_mod
runner_mod.run_chunk = timed("run_chunk", runner_mod.run_chunk)
PrefixCache.lookup = timed("lookup", PrefixCache.lookup)
PrefixCache.insert = timed("insert", PrefixCache.insert)
HostTier.adopt = timed("adopt", HostTier.adopt)
import gc
store = PrefixCache()
with torch.inference_mode():
    for rep in range(2):
        for name, ids, st in (("source", doc + q1, store), ("warm", doc + q2, store), ("cold", doc + q2, None)):
            T.clear()
            r = TandemRunner(model, TandemCache.for_model(model, config))
            torch.cuda.synchronize(); t = time.perf_counter()
            logits = r.prefill(torch.tensor([ids], device="cuda"), chunk_tokens=2048, max_new_tokens=8, prefix_cache=st)
            torch.cuda.synchronize(); total = time.perf_counter() - t
            print(rep, name, f"prefill {total:.3f}s reused {r.reused_tokens}", {k: round(v, 3) for k, v in T.items()}, flush=True)
            del r, logits
            gc.collect()
