"""Prefill chunks on this thread while the host pool's worker makes 8 requests' stores (8B, 32K each): how the
way a new store is made (registered as mapped / pre-faulted by memset / MADV_POPULATE_WRITE) delays the chunks."""
import ctypes, mmap, statistics, time, torch
from tandem import TandemCache, TandemConfig
from tandem.attention import TaskPool
from tandem.cache import memory
from tandem.engine.rows import RowsRunner
from tandem.engine.prefill import chunk_end
from tandem.models import attention_shape
from tandem.serve.sizing import CacheShape, host_stores
from tandem.shapes import build_random_model

model = build_random_model("llama-3.1-8b", "cuda", torch.bfloat16)
model.config.max_position_embeddings = 1 << 20
config = TandemConfig(policy="quest")
text = model.config.get_text_config(decoder=True)
shape = CacheShape(*attention_shape(text), torch.bfloat16, ())
T, C = 32768, 2048
sizes = host_stores(shape, config, T, 256) * shape.global_layers
# 1.3x: the worker's stores and the prompts' own never serve each other (the pool's fit is 1.25x)
big = [int(n * 1.3) for n in sizes]
print(f"{len(sizes)} stores, {sum(sizes) / 2**30:.2f} GiB a request", flush=True)
pool_obj = memory.enable_host_pool()
tasks = TaskPool(config.host.threads)
runner = RowsRunner(model, slots=16, config=config)
g = torch.Generator().manual_seed(0)
libc = ctypes.CDLL(None)
original = memory._new_mapping

def touched(fill):
    def make(nbytes, pin):
        mapping = memory._Mapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        fill(address, nbytes)
        if pin:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(address, nbytes, 3)
            assert int(err) == 0, err
            mapping._cudart, mapping._address = cudart, address
        return mapping
    return make

def memset(address, nbytes):
    ctypes.memset(address, 0, nbytes)

def populate(address, nbytes):
    if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), 23) != 0:
        raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE")

def prompt_chunks():
    cache = TandemCache.for_model(model, config, pool=tasks)
    runner.attach(cache)
    for kv in cache.tandem_layers():
        kv.capacity_hint = T + 256
    ids = torch.randint(0, 128000, (T,), generator=g).tolist()
    s, times = 0, []
    while s < T:
        e = chunk_end(s, T, C)
        torch.cuda.synchronize(); t = time.perf_counter()
        runner.prefill_chunk(cache, ids[s:e], s, last=e == T)[0].cpu()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        s = e
    runner.detach(cache)
    return times

with torch.inference_mode():
    prompt_chunks()  # warm
    for name, make in (("none", None), ("register", original), ("memset", touched(memset)),
                       ("populate", touched(populate)), ("none again", None)):
        memory._new_mapping = make or original
        start = time.perf_counter()
        reservations = [pool_obj.reserve(big, pinned=True) for _ in range(8)] if make else []
        times = []
        while True:
            times += prompt_chunks()
            if all(r.done.is_set() for r in reservations):
                break
        theirs = set()
        for r in reservations:
            r.done.wait()
        made = time.perf_counter() - start
        for r in reservations:
            theirs |= {id(m) for m in r.mappings}
            if r.error:
                print(name, "error", r.error)
            r.release()
        with pool_obj._lock:
            dropped = [m for m in pool_obj._free if id(m) in theirs]
            pool_obj._free = [m for m in pool_obj._free if id(m) not in theirs]
        del dropped
        print(f"{name:>10}: {len(times)} chunks, median {statistics.median(times)*1e3:.0f} ms, mean "
              f"{statistics.mean(times)*1e3:.0f} ms, max {max(times)*1e3:.0f} ms, sum {sum(times):.2f} s; "
              f"stores made within {made:.1f} s", flush=True)
    memory._new_mapping = original
