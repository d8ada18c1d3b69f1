"""The first 2K chunk of a 32K prompt (8B shape, quest, random weights): cProfile, by how its host stores come:
new mappings (no pool), the pool's free mappings (zeroed by torch), a reservation made ahead (as the server)."""
import cProfile, gc, io, os, pstats, statistics, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.models import attention_shape
from tandem.serve.sizing import CacheShape, host_stores
from tandem.shapes import build_random_model

DEV = os.environ.get("DEV", "cuda")
SHAPE = os.environ.get("SHAPE", "llama-3.1-8b")
model = build_random_model(SHAPE, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32)
model.config.max_position_embeddings = 1 << 20
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
config = TandemConfig(policy="quest")
g = torch.Generator().manual_seed(0)
T, C = int(os.environ.get("T", 32768)), 2048
pool = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16)
V = model.config.vocab_size
shape = CacheShape(*attention_shape(model.config), torch.bfloat16 if DEV == "cuda" else torch.float32, ())

def new(n):
    cache = TandemCache.for_model(model, config, pool=pool)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = n + 256
    return cache

def first(label, reservation=None, profile=False):
    gc.collect()
    ids = torch.randint(0, V, (T,), generator=g).tolist()
    sync(); t = time.perf_counter()
    prof = cProfile.Profile() if profile else None
    if prof: prof.enable()
    cache = new(T)
    ctx = reservation.drawn() if reservation is not None else __import__("contextlib").nullcontext()
    with ctx:
        logits = runner.prefill_chunk(cache, ids[:C], 0, last=False)
    sync()
    if prof: prof.disable()
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    logits = runner.prefill_chunk(cache, ids[C:2 * C], C, last=False); sync()
    t2 = time.perf_counter() - t
    print(f"{label:24s} first chunk {t1*1e3:7.1f} ms, second {t2*1e3:6.1f} ms", flush=True)
    if prof:
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(14)
        st.sort_stats("cumulative").print_stats("tandem", 30)
        print("\n".join(l[:150] for l in out.getvalue().splitlines() if l.strip() and not l.startswith("   Ordered")), flush=True)
    runner.detach(cache)
    return cache

with torch.inference_mode():
    c = first("warm-up"); del c
    c = first("no pool"); del c
    c = first("no pool", profile=True); del c
    memory.enable_host_pool()
    c = first("pool, new"); del c
    c = first("pool, free (torch zero_)"); del c
    c = first("pool, free (torch zero_)", profile=True); del c
    hp = memory.host_pool()
    for rnd in range(2):
        res = hp.reserve(host_stores(shape, config, T, 256) * model.config.num_hidden_layers, pinned=DEV == "cuda")
        t = time.perf_counter(); res.done.wait(); print(f"reservation made in {(time.perf_counter() - t)*1e3:.0f} ms")
        c = first("reserved ahead", reservation=res, profile=rnd == 1); del c
