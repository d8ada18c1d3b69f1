"""CPU decode speed of the default model (SmolLM2-135M-Instruct) by dtype, side by side in one run: Hugging Face
`generate` with DynamicCache, the same with Tandem's cache (`full`, and `hgca` at its defaults), and llama.cpp on the
GGUF file itself where `llama-cpp-python` is installed (its Q4_1 weights: the speed a llama.cpp-class runtime
reaches on this CPU). Prints and saves cpu_decode.json / .md and a manifest.

    python benchmarks/bench_cpu_decode.py --dtypes float32,bfloat16 --tokens 64 --out results/cpu_decode
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time

import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, generate_cache_kwargs, load_model, manifest
from tandem.models import cpu_has_bf16, default_model_path

PROMPT = [
    {
        "role": "user",
        "content": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }
]


def _hf_rows(dtype: str, tokens: int) -> list[dict]:
    model, tok = load_model(device="cpu", dtype=dtype)
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    systems = {
        "hf-dynamic": DynamicCache,
        "tandem-full": lambda: TandemCache.for_model(model, TandemConfig(policy="full")),
        "tandem-hgca": lambda: TandemCache.for_model(model, TandemConfig(policy="hgca")),
        "tandem-certified": lambda: TandemCache.for_model(model, TandemConfig()),
    }
    rows = []
    for name, make in systems.items():
        for n in (4, tokens):  # the first call pays one-time costs
            kwargs = generate_cache_kwargs(model, make())
            start = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                **kwargs,
            )  # fmt: skip
            seconds = time.perf_counter() - start
        text = tok.decode(out[0, ids.shape[1] :])
        rows.append({"system": name, "dtype": dtype, "tokens": n, "seconds": seconds, "tokens_per_s": n / seconds,
                     "text": text[:120]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _llama_cpp_row(tokens: int, threads: int) -> dict | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    llm = Llama(model_path=str(default_model_path()), n_ctx=2048, n_threads=threads, verbose=False)
    llm.create_chat_completion(messages=PROMPT, max_tokens=4, temperature=0)
    start = time.perf_counter()
    out = llm.create_chat_completion(messages=PROMPT, max_tokens=tokens, temperature=0)
    seconds = time.perf_counter() - start
    n = out["usage"]["completion_tokens"]
    row = {"system": "llama.cpp (Q4_1 GGUF)", "dtype": "q4_1", "tokens": n, "seconds": seconds,
           "tokens_per_s": n / seconds, "text": out["choices"][0]["message"]["content"][:120]}  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--tokens", type=int, default=64, help="new tokens per timed generation (prompt: 36 tokens)"
    )
    p.add_argument("--out", default=None, help="directory for cpu_decode.json / .md and the manifest")
    args = p.parse_args()
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "native_bf16": cpu_has_bf16(), "torch": torch.__version__}  # fmt: skip
    print(json.dumps(machine), flush=True)
    rows = [row for dtype in args.dtypes.split(",") for row in _hf_rows(dtype, args.tokens)]
    llama = _llama_cpp_row(args.tokens, torch.get_num_threads())
    if llama is not None:
        rows.append(llama)
    base = next(
        (r["tokens_per_s"] for r in rows if r["system"] == "hf-dynamic" and r["dtype"] == "float32"), None
    )
    lines = [
        f"# CPU decode of SmolLM2-135M-Instruct, {machine['cpu']}, {machine['cores']} cores "
        f"(native bf16: {machine['native_bf16']})",
        "",
        "Prompt 36 tokens (chat template), greedy, time of one generate() call including its prefill.",
        "",
        "| system | dtype | tokens/s | vs HF DynamicCache float32 |",
        "|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['system']} | {r['dtype']} | {r['tokens_per_s']:.1f} | {ratio} |")
    print("\n".join(lines))
    if args.out:
        manifest.save_results(
            args.out, "cpu_decode", {"machine": machine, "rows": rows}, "\n".join(lines) + "\n"
        )


if __name__ == "__main__":
    main()
