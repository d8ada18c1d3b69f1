"""CPU: chunked prefill of the default model's shape (random float32 weights) with a prompt chunk's attention over
its own tokens, the hot tier and the host rows through torch's flash attention for the CPU (`ops._CPU_FLASH`)
against the reference kernel (materialised logits), and HF's chunked prefill into a DynamicCache, alternating in
one process. Prints and saves JSON + markdown."""
import json, os, platform, statistics, sys, time, torch
from transformers import DynamicCache
from tandem import TandemCache, TandemConfig
from tandem.engine import TandemRunner
from tandem.kernels import ops
from tandem.shapes import build_random_model

torch.manual_seed(0)
model = build_random_model("smollm2-135m", "cpu", torch.float32)
model.config.max_position_embeddings = 1 << 16
CONTEXTS = [int(x) for x in os.environ.get("CONTEXTS", "4096,8192").split(",")]
CHUNK, ROUNDS = int(os.environ.get("CHUNK", 2048)), int(os.environ.get("ROUNDS", 2))
OUT = os.environ.get("OUT", ".")
flash = ops._CPU_FLASH
machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
print(machine, flush=True)

def tandem(ids, fast: bool):
    ops._CPU_FLASH = flash if fast else None
    try:
        r = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="quest")))
        t = time.perf_counter(); logits = r.prefill(ids, chunk_tokens=CHUNK); return time.perf_counter() - t, logits
    finally:
        ops._CPU_FLASH = flash

def hf(ids):
    cache = DynamicCache()
    t = time.perf_counter()
    for s in range(0, ids.shape[1], CHUNK):
        out = model(input_ids=ids[:, s:s + CHUNK], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t, out.logits[:, -1]

rows = []
with torch.inference_mode():
    tandem(torch.randint(0, 1000, (1, 2 * CHUNK)), True)  # warm-up
    for n in CONTEXTS:
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
        times = {"flash": [], "reference": [], "hf": []}
        for _ in range(ROUNDS):
            tf, lf = tandem(ids, True); times["flash"].append(tf)
            tr, lr = tandem(ids, False); times["reference"].append(tr)
            th, lh = hf(ids); times["hf"].append(th)
            print(f"{n}: flash {tf:.2f} s, reference {tr:.2f} s, HF DynamicCache {th:.2f} s", flush=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        diff = (lf.float() - lr.float()).abs().max().item()
        diff_hf = (lf.float() - lh.float()).abs().max().item()
        rows.append({"context": n, "chunk": CHUNK, "seconds": times, "median": med,
                     "flash_over_reference": med["flash"] / med["reference"], "flash_over_hf": med["flash"] / med["hf"],
                     "logits_max_diff_reference": diff, "logits_max_diff_hf": diff_hf})
md = [f"# CPU chunked prefill, {CHUNK}-token chunks, smollm2-135m shape (random float32 weights)", "", f"Machine: {machine}", "",
      "| context | Tandem, CPU flash | Tandem, reference kernel | HF DynamicCache | flash / reference | flash / HF | logits diff vs reference, vs HF |",
      "|---:|---:|---:|---:|---:|---:|---|"]
for r in rows:
    m = r["median"]
    md.append(f"| {r['context']} | {m['flash']:.2f} s | {m['reference']:.2f} s | {m['hf']:.2f} s | {r['flash_over_reference']:.2f}x | "
              f"{r['flash_over_hf']:.2f}x | {r['logits_max_diff_reference']:.1e}, {r['logits_max_diff_hf']:.1e} |")
print("\n".join(md))
json.dump({"machine": machine, "rows": rows}, open(os.path.join(OUT, "cpu_prefill.json"), "w"), indent=1)
open(os.path.join(OUT, "cpu_prefill.md"), "w").write("\n".join(md) + "\n")
