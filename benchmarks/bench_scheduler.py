"""How a decode step's selected host blocks are split between the GPU and the CPU (`TandemConfig.quest.scheduler`),
on mixed-length batches in the style of Fluxion §8.3: the priority queue against no parallel work (CPU only),
uniform by heads, length-based (volume) and quest's static `gpu_share` at several values, side by side.

"share" and "queue" are the config's schedulers; "cpu", "heads" and "volume" are this benchmark's static
baselines, not settings: it runs them with quest.scheduler="queue" and sets them on every layer of its cache
(`LayerKV.queue_split`, with the fraction of "heads@0.3" in `LayerKV.queue_share`; `tandem.attention.queue`).

One random-weight model of a real shape (bf16), one batch per workload whose request lengths are drawn uniformly
from a range (random K/V; rows past a request's length are not valid), quest at its budget. Every variant decodes the same cache
in alternating rounds of one decode run: between rounds the config switches and the step is recorded again, so
all variants see the same VM state. Per variant: the median step time (TPOT), its ratio to CPU-only and to the
best static split, the share of host rows the GPU read, and the hardware limit of a perfect split: weight bytes /
HBM + host bytes per step / (host read + PCIe bandwidth), both sides reading at once.

    python benchmarks/bench_scheduler.py --workloads 4:32k-128k,8:16k-64k --out benchmarks/results/<folder>
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import random
import statistics

import torch

from tandem import TandemCache, TandemConfig, manifest
from tandem.attention import queue
from tandem.config import DEFAULT_GPU_SHARE, QuestConfig
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model, model_weight_bytes_per_step
from tandem.tools.bench import bandwidth
from tandem.tools.bench.baselines import release_memory
from tandem.tools.bench.tandem_side import fill_tandem_synthetic


def _tokens(text: str) -> int:
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def parse_workloads(text: str) -> list[tuple[int, int, int]]:
    """ "4:32k-128k,8:16k-64k" -> [(4, 32768, 131072), (8, 16384, 65536)]."""
    out = []
    for item in text.split(","):
        batch, span = item.split(":")
        low, high = span.split("-")
        out.append((int(batch), _tokens(low), _tokens(high)))
    return out


def parse_variants(text: str) -> list[tuple[str, str, float | None, int | None]]:
    """E.g. "cpu,heads@0.3,share@0.4,queue,queue#16": (label, split, its share, the queue's GPU programs)
    each: "share@x" is quest's gpu_share x, "heads@x" and "volume@x" the baseline's fraction x."""
    out = []
    for item in text.split(","):
        head, _, programs = item.partition("#")
        scheduler, _, share = head.partition("@")
        out.append((item, scheduler, float(share) if share else None, int(programs) if programs else None))
    return out


def quest_for(quest: QuestConfig, split: str, share: float | None) -> QuestConfig:
    """The config's side of a variant: "share" with its `gpu_share`; the queue, and the baselines, which run
    through the queue's plan, with no device share of their own in the config."""
    if split == "share":
        return dataclasses.replace(quest, gpu_cache=None, gpu_share=share, scheduler="share")
    return dataclasses.replace(quest, gpu_cache=None, gpu_share=None, scheduler="queue")


def set_layers(cache, split: str, share: float | None) -> None:
    """The layers' side of a variant: its split (a baseline, or the config's scheduler) and, for "heads" and
    "volume", the device's fraction (quest's default share unless the variant names one)."""
    config = cache.config
    for layer in cache.tandem_layers():
        layer.gpu_share = config.gpu_share_on("cuda")
        layer.gpu_cache = config.gpu_cache_on("cuda")
        layer.queue_split = split
        layer.queue_share = share if share is not None else DEFAULT_GPU_SHARE


def switch(runner, cache, split: str, share: float | None, programs: int | None, step: int) -> None:
    """Set every layer to `split` (and its share) after decode step `step`: the next step runs eagerly (it may
    remake a recall cache of another width, which a recording cannot), the one after is recorded again."""
    queue.GPU_PROGRAMS = programs
    cache.config.quest = quest_for(cache.config.quest, split, share)
    set_layers(cache, split, share)
    if cache.step_context is not None:
        cache.step_context.segments = []
    runner.warmup_steps = step + 2


def run_workload(model, batch, low, high, variants, rounds, steps, budget, seed) -> dict:
    rng = random.Random(seed)
    lengths = sorted((rng.randint(low // 16, high // 16) * 16 for _ in range(batch)), reverse=True)
    context = lengths[0]
    first = variants[0]
    config = TandemConfig(policy="quest", quest=quest_for(QuestConfig(budget=budget), first[1], first[2]))
    cache = TandemCache.for_model(model, config)
    set_layers(cache, first[1], first[2])
    runner = TandemRunner(model, cache)
    for layer in cache.tandem_layers():
        layer.capacity_hint = context + len(variants) * rounds * (steps + 4) + 16
    fill_tandem_synthetic(cache, model, batch, context, seed, lengths=lengths)
    runner.set_positions(torch.tensor(lengths))
    warm = 3
    plan = [v for _ in range(rounds) for v in variants for _ in range(warm + steps)]
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    rows: dict[str, list[int]] = {v[0]: [0, 0] for v in variants}
    layers = cache.tandem_layers()
    seconds: list[float] = []
    position = 0
    for i, _ in enumerate(runner.stream(torch.zeros(batch, dtype=torch.long), len(plan) + 1, seconds)):
        if i == 0:
            continue  # the stream's first step is eager
        label = plan[position][0]
        if position % (warm + steps) >= warm:
            times[label].append(seconds[-1])
            rows[label][0] += sum(layer.rows_attended for layer in layers)
            rows[label][1] += sum(layer.rows_attended_device + layer.rows_attended_cached for layer in layers)
        for layer in layers:
            layer.reset_statistics()
        position += 1
        if position < len(plan) and plan[position] is not plan[position - 1]:
            switch(runner, cache, *plan[position][1:], i)
    text = model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    row_bytes = 2 * head_dim * 2  # K and V, bf16
    result = {"batch": batch, "lengths": lengths, "variants": {}}
    for label, values in times.items():
        total, device = rows[label]
        result["variants"][label] = {
            "tpot_ms": round(statistics.median(values) * 1e3, 3),
            "p90_ms": round(sorted(values)[int(0.9 * (len(values) - 1))] * 1e3, 3),
            "steps": len(values),
            "host_rows_per_step": total / max(len(values), 1),
            "gpu_row_share": round(device / total, 4) if total else None,
            "host_bytes_per_step": total / max(len(values), 1) * row_bytes if row_bytes else None,
        }
    del runner, cache
    release_memory(torch.device("cuda"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--workloads", default="4:32k-128k,8:16k-64k")
    parser.add_argument("--variants", default="share@0,cpu,heads,volume,share@0.2,share@0.4,share@0.6,queue")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_random_model(args.model, device, torch.bfloat16, num_layers=args.layers, seed=args.seed)
    hbm = bandwidth.hbm_bandwidth(device)
    host_read = bandwidth.host_read_bandwidth()
    pcie = bandwidth.pcie_h2d_bandwidth(device)
    weights = model_weight_bytes_per_step(model)
    record = {
        "benchmark": "bench_scheduler", "machine": platform.node(), "gpu": torch.cuda.get_device_name(device),
        "cpu_count": os.cpu_count(), "model": args.model, "weights": "random", "layers": model.config.num_hidden_layers,
        "budget": args.budget, "hbm_gbs": hbm, "host_read_gbs": host_read, "pcie_gbs": pcie,
        "weight_bytes": weights, "rounds": args.rounds, "steps": args.steps, "workloads": [],
    }  # fmt: skip
    print(f"# {record['gpu']}, {record['cpu_count']} cores; {args.model} random weights; HBM {hbm:.0f} GB/s, "
          f"host read {host_read:.0f} GB/s, PCIe {pcie:.1f} GB/s")  # fmt: skip
    variants = parse_variants(args.variants)
    lines = []
    for batch, low, high in parse_workloads(args.workloads):
        result = run_workload(
            model, batch, low, high, variants, args.rounds, args.steps, args.budget, args.seed
        )
        rows = result["variants"]
        cpu_ms = rows.get("cpu", {}).get("tpot_ms")
        static = [r["tpot_ms"] for label, r in rows.items() if label != "queue"]
        best_static = min(static) if static else None
        for r in rows.values():
            bound = None
            if r["host_bytes_per_step"]:
                bound = (weights / hbm + r["host_bytes_per_step"] / (host_read + pcie)) / 1e6
            r["bound_ms"] = round(bound, 3) if bound else None
            r["over_bound"] = round(r["tpot_ms"] / bound, 3) if bound else None
            r["cpu_only_over_this"] = round(cpu_ms / r["tpot_ms"], 3) if cpu_ms else None
            r["this_over_best_static"] = round(r["tpot_ms"] / best_static, 3) if best_static else None
        result["range"] = [low, high]
        record["workloads"].append(result)
        lines.append(f"\n### batch {batch}, lengths {result['lengths']}\n")
        lines.append(
            "| variant | TPOT ms | p90 | GPU row share | CPU-only / this | this / best static | bound ms | TPOT / bound |"
        )
        lines.append("|---|---|---|---|---|---|---|---|")
        for label, r in rows.items():
            lines.append(
                f"| {label} | {r['tpot_ms']} | {r['p90_ms']} | {r['gpu_row_share']} | {r['cpu_only_over_this']} | "
                f"{r['this_over_best_static']} | {r['bound_ms']} | {r['over_bound']} |"
            )
        print("\n".join(lines[-len(rows) - 3 :]), flush=True)
    if args.out:
        header = (
            f"# Schedulers on mixed-length batches\n\n{record['gpu']}, {record['cpu_count']} cores, {args.model} "
            f"(random weights), quest {args.budget}; HBM {hbm:.0f} GB/s, host read {host_read:.0f} GB/s, PCIe "
            f"{pcie:.1f} GB/s\n"
        )
        manifest.save_results(args.out, "scheduler", record, header + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
