"""Decode speed of the default configuration on the CPU alone, against Hugging Face's DynamicCache: the default
model in float32, one process, greedy, prompts of real prose (Python's documentation) cut to each length, decode
time only (the prefill is timed apart). Every system decodes the same prompt in the same run, in turn, after one
untimed warm-up generation; each cell is the median of `--repeats` runs.

Tandem has nothing to save at these lengths on a CPU (its hot tier is on the same CPU), so the question is what it
costs: the default must never be much slower than DynamicCache where it saves nothing.

    python benchmarks/bench_cpu_default.py --lengths 42,2048,4096 --tokens 32 \
        --out benchmarks/results/<date>_cpu_default_decode

Prints and saves cpu_default.json / cpu_default.md and a manifest naming the commit and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import DynamicCache

from tandem import TandemCache, TandemConfig, load_model, manifest
from tandem.integrations.hf import generate_cache_kwargs
from tandem.tools.evaluation.haystack import load_haystack

SYSTEMS = {
    "hf-dynamic": None,
    "certified (default)": TandemConfig,
    "quest 5%": lambda: TandemConfig(policy="quest"),
    "hgca": lambda: TandemConfig(policy="hgca"),
}


def _prompt(tokenizer, length: int) -> torch.Tensor:
    ids = tokenizer(load_haystack().text, add_special_tokens=False).input_ids
    return torch.tensor([ids[:length]])


def _decode(model, ids: torch.Tensor, make, steps: int) -> tuple[float, float, dict | None]:
    """(prefill seconds, decode seconds for `steps` tokens, the cache's stats or None)."""
    cache = DynamicCache() if make is None else TandemCache.for_model(model, make())
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(ids, **generate_cache_kwargs(model, cache), use_cache=True)
        prefill = time.perf_counter() - start
        token = out.logits[:, -1:].argmax(-1)
        position = ids.shape[1]
        start = time.perf_counter()
        for _ in range(steps):
            out = model(
                token, **generate_cache_kwargs(model, cache), use_cache=True, position_ids=torch.tensor([[position]]),
                cache_position=torch.tensor([position]),
            )  # fmt: skip
            token = out.logits[:, -1:].argmax(-1)
            position += 1
        decode = time.perf_counter() - start
    stats = None if make is None else cache.stats()
    return prefill, decode, stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="42,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for cpu_default.json / .md and the manifest")
    args = p.parse_args()
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch_threads": torch.get_num_threads(), "torch": torch.__version__}  # fmt: skip
    print(json.dumps(machine), flush=True)
    model, tokenizer = load_model(device="cpu", dtype="float32")
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = _prompt(tokenizer, length)
        for name, make in SYSTEMS.items():
            _decode(model, ids, make, 4)  # warm-up: kernels built, allocations made
            runs = [_decode(model, ids, make, args.tokens) for _ in range(args.repeats)]
            decode = statistics.median(r[1] for r in runs)
            stats = runs[-1][2] or {}
            rows.append({
                "system": name, "prompt_tokens": length, "tokens": args.tokens,
                "prefill_s": statistics.median(r[0] for r in runs), "decode_s": decode,
                "tokens_per_s": args.tokens / decode, "decode_runs_s": [r[1] for r in runs],
                "fraction_attended": stats.get("mean_fraction_attended"),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"# Decode on the CPU alone: default model, float32, {machine['cpu']}, {machine['cores']} cores",
        "",
        f"Decode time only, {args.tokens} greedy tokens after a prompt of prose; median of {args.repeats} runs. "
        "Ratio: tokens/s against HF DynamicCache's at the same prompt length.",
        "",
        "| prompt tokens | system | tokens/s | vs DynamicCache | host entries attended |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(
            b for b in rows if b["system"] == "hf-dynamic" and b["prompt_tokens"] == r["prompt_tokens"]
        )
        share = "-" if r["fraction_attended"] is None else f"{r['fraction_attended']:.1%}"
        lines.append(
            f"| {r['prompt_tokens']} | {r['system']} | {r['tokens_per_s']:.2f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {share} |"
        )
    print("\n".join(lines))
    if args.out:
        manifest.save_results(
            args.out, "cpu_default", {"machine": machine, "rows": rows}, "\n".join(lines) + "\n"
        )


if __name__ == "__main__":
    main()
