"""Greedy tokens of Tandem with every entry kept (`policy="full"`) against transformers' DynamicCache.

For each prompt length: DynamicCache's `model.generate`, then Tandem through the HF drop-in (`model.generate`
with a `TandemCache`) and through its engine (`TandemRunner.generate`), each from the same prompt (the start of
the Python documentation haystack). Prints and saves, per length and path, whether the tokens are equal, the first
position that differs, the host rows of the global layers and the wall time (prefill and decode together).

    python benchmarks/exact_generation.py --model gemma3-270m --lengths 2048,16384 --new 64 --out results/exact
    python benchmarks/exact_generation.py --model /tmp/g.gguf --lengths 32704 --device cuda --dtype float32

Writes exact.json and exact.md (with the machine and the command) into --out.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="gemma3-270m", help="a packaged model's name, a .gguf or an HF directory"
    )
    p.add_argument("--lengths", default="2048", help="prompt lengths in tokens, comma list")
    p.add_argument("--new", type=int, default=64, help="tokens generated greedily (default 64)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if available)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--paths", default="dropin,engine", help="Tandem paths to compare: dropin, engine")
    p.add_argument("--out", default="exact_generation")
    return p.parse_args(argv)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))
    )


def main(argv=None) -> int:
    from transformers import DynamicCache

    from tandem import TandemCache, TandemConfig, generate_cache_kwargs, load_model, manifest
    from tandem.engine import TandemRunner
    from tandem.tools.evaluation.haystack import load_haystack

    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    paths = [x for x in args.paths.split(",") if x]
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    device = next(model.parameters()).device
    text = load_haystack().text
    ids_all = tokenizer(text, return_tensors="pt").input_ids
    machine = manifest.machine()
    where = f"{', '.join(machine['gpus']) or 'no GPU'}; {machine['cpu']} ({machine['cores']} cores)"
    print(f"machine: {where}; {model.dtype}", flush=True)
    rows = []
    with torch.inference_mode():
        for length in lengths:
            if ids_all.shape[1] < length:
                reps = length // ids_all.shape[1] + 1
                ids_all = ids_all.repeat(1, reps)
            ids = ids_all[:, :length].to(device)

            def greedy(cache, ids=ids, length=length) -> list[int]:
                """model.generate's greedy tokens after the prompt, with `cache`."""
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, do_sample=False,
                    **generate_cache_kwargs(model, cache),
                )  # fmt: skip
                return out[0, length:].tolist()

            start = time.perf_counter()
            ref = greedy(DynamicCache(config=model.config))
            rows.append(
                {"length": length, "path": "dynamic", "seconds": round(time.perf_counter() - start, 2)}
            )
            print(f"{length}: dynamic {rows[-1]['seconds']} s", flush=True)
            for path in paths:
                cache = TandemCache.for_model(model, TandemConfig(policy="full"))
                start = time.perf_counter()
                if path == "engine":
                    out = TandemRunner(model, cache).generate(ids, args.new).tolist()
                else:
                    out = greedy(cache)
                stats = cache.stats()
                row = {
                    "length": length,
                    "path": path,
                    "seconds": round(time.perf_counter() - start, 2),
                    "equal": out == ref,
                    "first_difference": first_difference(out, ref),
                    "host_rows": stats["host_rows"],
                    "layers": stats["layers"],
                    "text": tokenizer.decode(out[:40]),
                }
                rows.append(row)
                print(
                    f"{length}: {path} equal={row['equal']} first difference={row['first_difference']} "
                    f"host rows {row['host_rows']} {row['seconds']} s",
                    flush=True,
                )
                del cache
    command = "python benchmarks/exact_generation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "machine": machine,
        "model": args.model,
        "dtype": str(model.dtype),
        "new_tokens": args.new,
        "command": command,
        "rows": rows,
    }
    lines = [
        '# Greedy tokens: Tandem (`policy="full"`) against DynamicCache',
        "",
        f"Model {args.model} ({model.dtype}); {where}; {args.new} new tokens.",
        "",
        "```",
        command,
        "```",
        "",
        "| prompt tokens | path | equal | first difference | host rows | seconds |",
        "|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']:,} | {r['path']} | {'yes' if r.get('equal') else ('—' if 'equal' not in r else 'no')} "
            f"| {r.get('first_difference') if r.get('first_difference') is not None else '—'} "
            f"| {r.get('host_rows', '—')} | {r['seconds']} |"
        )
    manifest.save_results(args.out, "exact", result, "\n".join(lines) + "\n")
    print(f"wrote {Path(args.out) / 'exact.json'}, {Path(args.out) / 'exact.md'}")
    return 0 if all(r.get("equal", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
