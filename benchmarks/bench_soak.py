"""Soak: many decode steps through the engine, watching memory and step time for leaks and drift.

The engine decodes `--steps` greedy tokens after a short prompt with a small window (so almost every token
moves to the host tier), sampling every `--sample-every` steps:

- the process's resident memory (RSS) and, on CUDA, the device memory allocated and reserved by torch;
- the bytes of KV the cache has written so far (every layer's K and V of every token).

It reports the resident-memory growth beyond the KV bytes written between the first and the last sample (the
tiers' pages become resident as KV is written into them; the target is <= 2% of those bytes) and the step-time drift: the median step of the last 10% of steps against the
first 10% (target within 5%; quest's selection grows with the context, so its drift is reported beside a
`streaming` run, whose per-step work does not grow).

    python benchmarks/bench_soak.py --steps 20000 --window 64 --out benchmarks/results/<date>_<machine>_soak
    python benchmarks/bench_soak.py --model llama-3.1-8b --steps 100000 --device cuda   # random 8B weights
    python benchmarks/bench_soak.py --model llama-3.1-8b --layers 4 --steps 100000 --device cuda  # 8B's layers, 4 of them

The default model was trained on 8,192 positions; past them its tokens mean nothing, which does not matter
here (the output says so). A named shape runs random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from tandem import HostConfig, TandemCache, TandemConfig, load_model, manifest
from tandem.engine import TandemRunner

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def kv_bytes_per_token(cache: TandemCache) -> int:
    layers = cache.tandem_layers()
    hot = layers[0].hot
    return sum(2 * layer.num_kv_heads * layer.head_dim for layer in layers) * hot.keys.element_size()


def soak(args, policy: str) -> dict:
    if args.model and not Path(args.model).exists():
        from tandem.shapes import build_random_model

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = build_random_model(args.model, device, torch.bfloat16, num_layers=args.layers)
        layers = f", {args.layers} of its layers" if args.layers else ""
        weights = f"random ({args.model} shape{layers})"
    else:
        model, _ = load_model(args.model, device=args.device)
        weights = "real"
    device = next(model.parameters()).device
    prompt = args.prompt_tokens
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, prompt + args.steps + 1)
    config = TandemConfig(
        policy=policy, sink_tokens=4, window_tokens=args.window, host=HostConfig(threads=args.threads)
    )
    cache = TandemCache.for_model(model, config)
    runner = TandemRunner(model, cache)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    first = runner.prefill(ids, max_new_tokens=args.steps + 1).argmax(-1)
    per_token = kv_bytes_per_token(cache)
    samples, seconds = [], []
    start = time.perf_counter()
    for i, _ in enumerate(runner.stream(first, args.steps, seconds)):
        if i % args.sample_every == 0 or i == args.steps - 1:
            sample = {"step": i, "rss": rss_bytes(), "kv_written": (prompt + i + 1) * per_token,
                      "seconds": time.perf_counter() - start}  # fmt: skip
            if device.type == "cuda":
                sample["cuda_allocated"] = torch.cuda.memory_allocated(device)
                sample["cuda_reserved"] = torch.cuda.memory_reserved(device)
            samples.append(sample)
            if args.progress:
                print(f"{policy} step {i}: rss {sample['rss'] / 1e6:.0f} MB", flush=True)
    # the first sample is taken after the first step: everything allocated up front (tiers, graphs) is in it
    first_s, last_s = samples[0], samples[-1]
    kv_delta = last_s["kv_written"] - first_s["kv_written"]
    rss_delta = last_s["rss"] - first_s["rss"]
    tenth = max(1, len(seconds) // 10)
    early, late = statistics.median(seconds[:tenth]), statistics.median(seconds[-tenth:])
    result = {
        "policy": policy,
        "weights": weights,
        "steps": args.steps,
        "window": args.window,
        "kv_bytes_per_token": per_token,
        "kv_written_delta": kv_delta,
        "rss_delta": rss_delta,
        "rss_growth_beyond_kv": (rss_delta - kv_delta) / kv_delta if kv_delta else None,
        "step_ms_first_tenth": early * 1e3,
        "step_ms_last_tenth": late * 1e3,
        "step_drift": late / early - 1.0,
        "host_rows": cache.tandem_layers()[0].host.rows,
        "host_tier_bytes": sum(
            layer.host.keys.nbytes + layer.host.values.nbytes for layer in cache.tandem_layers()
        ),
        "samples": samples,
    }
    if device.type == "cuda":
        result["cuda_allocated_delta"] = last_s["cuda_allocated"] - first_s["cuda_allocated"]
        result["cuda_reserved_delta"] = last_s["cuda_reserved"] - first_s["cuda_reserved"]
    return result


def markdown(results: list[dict], machine: str) -> str:
    lines = [
        "# Soak: memory and step time over a long decode",
        "",
        f"Machine: {machine}. Weights: {results[0]['weights']}; {results[0]['steps']} steps, window "
        f"{results[0]['window']} (positions past the model's trained context carry no meaning here).",
        "",
        "| policy | KV written (MB) | RSS growth (MB) | growth beyond the KV | step, first 10% | step, last 10% | drift |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        beyond = r.get(
            "rss_growth_beyond_kv", (r["rss_delta"] - r["kv_written_delta"]) / r["kv_written_delta"]
        )
        lines.append(
            f"| {r['policy']} | {r['kv_written_delta'] / 1e6:.1f} | {r['rss_delta'] / 1e6:.1f} | "
            f"{beyond:+.1%} | {r['step_ms_first_tenth']:.2f} ms | {r['step_ms_last_tenth']:.2f} ms | "
            f"{r['step_drift']:+.1%} |"
        )
    lines += [
        "",
        "Between the first sample (after the first step) and the last. The tiers are sized once at prefill for the "
        "whole run, but their pages become resident as the KV is written into them, so RSS grows by about the KV "
        "bytes written. Growth beyond the KV = (RSS growth - KV written) / KV written; the target is at most 2%.",
    ]
    if "cuda_allocated_delta" in results[0]:
        lines.append("")
        for r in results:
            second, last = r["samples"][1], r["samples"][-1]  # the step's graphs are recorded after the first
            lines.append(
                f"- {r['policy']}: CUDA memory allocated {r['cuda_allocated_delta'] / 1e6:+.1f} MB, reserved "
                f"{r['cuda_reserved_delta'] / 1e6:+.1f} MB over the run; from step {second['step']} (once the step's "
                f"CUDA graphs are recorded) {(last['cuda_allocated'] - second['cuda_allocated']) / 1e6:+.1f} / "
                f"{(last['cuda_reserved'] - second['cuda_reserved']) / 1e6:+.1f} MB."
            )
    return "\n".join(lines) + "\n"


def rewrite(folder: Path) -> None:
    """Write soak.md again from a soak.json (e.g. after merging runs)."""
    data = json.loads((folder / "soak.json").read_text())
    (folder / "soak.md").write_text(markdown(data["results"], data["machine"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF directory / .gguf, or a named random shape")
    parser.add_argument("--policies", default="streaming,quest")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1, help="CPU attention threads")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--layers", type=int, default=None, help="a named shape with this many layers (each of its own size)"
    )
    parser.add_argument("--progress", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available() and args.device != "cpu":
        machine += f", {torch.cuda.get_device_name()}"
    results = [soak(args, policy) for policy in args.policies.split(",")]
    text = markdown(results, machine)
    print(text)
    if args.out is not None:
        manifest.save_results(args.out, "soak", {"machine": machine, "results": results}, text)


if __name__ == "__main__":
    main()
