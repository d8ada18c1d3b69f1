"""A/B of the engine's host side: hand-offs served by the compiled library against the same hand-offs served
from Python, alternated within one decode run on a random-weight model of a real shape (GPU host).

`DecodeStep.compiled_host_side` switches between the two between steps of one `TandemRunner.stream`, so both
sides see the same graphs, caches and VM state. Prints and saves (JSON + markdown) the median step time of each
side per round and their ratio.

    python benchmarks/bench_host_side_ab.py --contexts 64k,128k --configs quest,streaming --out results/ab_host_side
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from tandem import TandemCache, TandemConfig, manifest
from tandem.engine import TandemRunner
from tandem.kernels import cpu
from tandem.shapes import build_random_model
from tandem.tools.bench.baselines import release_memory
from tandem.tools.bench.tandem_side import fill_tandem_synthetic


def _context(text: str) -> int:
    return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)


def ab_row(model, policy: str, batch: int, context: int, rounds: int, steps: int) -> dict:
    cache = TandemCache.for_model(model, TandemConfig(policy=policy))
    runner = TandemRunner(model, cache)
    fill_tandem_synthetic(cache, model, batch, context)
    runner.set_positions(torch.full((batch,), context))
    warmup = 6
    plan = [None] * warmup + [
        side for _ in range(rounds) for side in ("compiled", "python") for _ in range(steps)
    ]
    seconds: list[float] = []
    for i, _ in enumerate(runner.stream(torch.zeros(batch, dtype=torch.long), len(plan), seconds)):
        if i + 1 < len(plan):  # the next step's side
            cache.step_context.compiled_host_side = plan[i + 1] != "python"
    times: dict[str, list[float]] = {"compiled": [], "python": []}
    for side, value in zip(plan, seconds, strict=True):
        if side is not None:
            times[side].append(value)
    row = {"policy": policy, "batch": batch, "context": context, "handoff": runner.handoff}
    for side, values in times.items():
        row[f"{side}_ms"] = round(statistics.median(values) * 1e3, 3)
        row[f"{side}_p90_ms"] = round(sorted(values)[int(0.9 * (len(values) - 1))] * 1e3, 3)
    row["compiled_over_python"] = round(row["compiled_ms"] / row["python_ms"], 4)
    del runner, cache
    release_memory(torch.device("cuda"))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--contexts", default="64k,128k")
    p.add_argument("--batches", default="1")
    p.add_argument("--configs", default="quest,streaming", help="policies, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="steps per side and round")
    p.add_argument("--out", default=None, help="directory for ab_host_side.json / .md")
    args = p.parse_args()
    if not torch.cuda.is_available() or not cpu.is_available():
        raise SystemExit("needs a CUDA GPU and the compiled CPU kernels")
    model = build_random_model(args.model, "cuda", torch.bfloat16)
    model.config.max_position_embeddings = 1 << 20
    machine = {
        "gpu": torch.cuda.get_device_name(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_isa": cpu.isa(),
        "torch": torch.__version__,
    }
    print(json.dumps(machine), flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (_context(c) for c in args.contexts.split(",")):
            for policy in args.configs.split(","):
                row = ab_row(model, policy, batch, context, args.rounds, args.steps)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        out = Path(args.out)
        manifest.write(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "ab_host_side.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        lines = [
            f"# Host side A/B, {args.model}, {machine['gpu']}, {machine['cores']} cores",
            "",
            "| policy | batch x context | compiled ms (p90) | Python ms (p90) | compiled / Python |",
            "|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['policy']} | {r['batch']} x {r['context'] // 1024}K | {r['compiled_ms']} ({r['compiled_p90_ms']}) "
                f"| {r['python_ms']} ({r['python_p90_ms']}) | {r['compiled_over_python']} |"
            )
        (out / "ab_host_side.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
