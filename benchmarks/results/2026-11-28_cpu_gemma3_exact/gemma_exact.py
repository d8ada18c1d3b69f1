"""Gemma-3-270M (the packaged GGUF): greedy tokens of TandemCache(policy="full") against DynamicCache on the CPU.

python gemma_exact.py PROMPT_TOKENS NEW_TOKENS      # the prompt: the start of the Python docs haystack
"""

import sys
import time

import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs, load_model
from tandem.evaluation.haystack import load_haystack


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    start = time.perf_counter()
    model, tok = load_model("gemma3-270m", device="cpu")
    layers = model.config.get_text_config().layer_types.count("full_attention")
    print(
        "loaded",
        type(model).__name__,
        model.dtype,
        f"{time.perf_counter() - start:.1f}s",
        layers,
        "global layers",
    )
    ids = tok(load_haystack().text, return_tensors="pt").input_ids[:, :tokens]
    with torch.inference_mode():
        start = time.perf_counter()
        ref = model.generate(ids, max_new_tokens=new, do_sample=False)[0, tokens:]
        print("dynamic", f"{time.perf_counter() - start:.1f}s")
        cache = TandemCache.for_model(model, TandemConfig(policy="full"))
        start = time.perf_counter()
        kwargs = generate_cache_kwargs(model, cache)
        out = model.generate(ids, max_new_tokens=new, do_sample=False, **kwargs)[0, tokens:]
        stats = cache.stats()
        print(
            "tandem", f"{time.perf_counter() - start:.1f}s", stats["layers"], "host rows", stats["host_rows"]
        )
    differ = next((i for i, (a, b) in enumerate(zip(ref.tolist(), out.tolist())) if a != b), None)
    print("equal:", torch.equal(ref, out), "first difference:", differ)
    print(repr(tok.decode(out[:40])))


if __name__ == "__main__":
    main()
