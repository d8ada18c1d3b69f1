"""Step-time tail: decode steps that evict a ring block against those that do not, with the evictions staged
ahead (the engine's way) and all done at the eviction step (the way it was), side by side in one run.

Every `block_size` steps each layer's hot ring is full, and `DecodeStep.prepare` moves the oldest block of every
layer to the host tier before the step runs. Staged, each layer writes that block into the host tier at another
step of the block period (`LayerKV._stage_next_eviction`), and the eviction step only makes it live. This times,
per decode step after `--warmup` untimed ones (eager, then the graph's recording), the whole step and its
`prepare`, marks the steps whose `prepare` evicted (the host tier grew), and reports for both kinds the medians,
and for all steps the median, p99 and max, with p99 / median: what a serving user sees as inter-token spikes. The
heap is frozen once the model is built (`engine.freeze_heap`), as `tandem bench` and `tandem serve` do.

    python benchmarks/bench_eviction_steps.py --out benchmarks/results/<date>_<machine>_eviction_steps
    python benchmarks/bench_eviction_steps.py --model llama-3.1-8b --context 65536 --steps 512 --device cuda

A named shape runs random weights (the output says so); the prompt is random tokens through the real prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem import TandemCache, TandemConfig, manifest
from tandem.cache.layer import LayerKV
from tandem.engine import TandemRunner, freeze_heap, step
from tandem.shapes import build_random_model
from tandem.tools.bench.baselines import percentile


def measure(args, staged: bool) -> dict:
    """One variant: evictions staged ahead (`staged`), or all at the eviction step (staging switched off)."""
    if not staged:
        saved, LayerKV._stage_next_eviction = LayerKV._stage_next_eviction, lambda self: None
        try:
            return measure(args, True) | {"variant": "at the eviction step"}
        finally:
            LayerKV._stage_next_eviction = saved
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random_model(args.model, device, dtype, num_layers=args.layers)
    model.generation_config.eos_token_id = None
    freeze_heap()  # no full collection of the model's heap inside a timed step
    cache = TandemCache.for_model(model, TandemConfig(policy=args.policy))
    runner = TandemRunner(model, cache)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context), generator=torch.Generator())
    logits = runner.prefill(ids, chunk_tokens=args.chunk, max_new_tokens=args.warmup + args.steps + 8)
    first = logits.argmax(-1)

    prepares: list[tuple[float, bool]] = []
    original = step.DecodeStep.prepare
    host = cache.tandem_layers()[0].host

    def timed(self, layers):
        rows, start = host.rows, time.perf_counter()
        slot = original(self, layers)
        prepares.append(((time.perf_counter() - start) * 1e3, host.rows != rows))
        return slot

    step.DecodeStep.prepare = timed
    try:
        _, seconds = runner.decode(first, args.warmup + args.steps)
    finally:
        step.DecodeStep.prepare = original
    # the warm-up steps (eager, then the one that records the graph) are not timed
    step_ms = [s * 1e3 for s in seconds[args.warmup :]]
    prepares = prepares[args.warmup :]
    evicting = [i for i, (_, evicted) in enumerate(prepares) if evicted]
    others = [i for i in range(len(step_ms)) if i not in set(evicting)]
    ordered = sorted(step_ms)
    median = statistics.median(ordered)

    def med(values):
        return statistics.median(values) if values else None

    prepare_ordered = sorted(p for p, _ in prepares)
    return {
        "variant": "staged ahead",
        "model": args.model,
        "weights": "random",
        "layers": len(cache.tandem_layers()),
        "policy": args.policy,
        "batch": args.batch,
        "context": args.context,
        "steps": args.steps,
        "use_graphs": runner.use_graphs,
        "evicting_steps": len(evicting),
        "step_ms_median": median,
        "step_ms_p99": percentile(ordered, 0.99),
        "step_ms_max": ordered[-1],
        "p99_over_median": percentile(ordered, 0.99) / median,
        "step_ms_median_evicting": med([step_ms[i] for i in evicting]),
        "step_ms_median_other": med([step_ms[i] for i in others]),
        "prepare_ms_median_evicting": med([prepares[i][0] for i in evicting]),
        "prepare_ms_median_other": med([prepares[i][0] for i in others]),
        "prepare_ms_p99": percentile(prepare_ordered, 0.99),
        "prepare_ms_max": prepare_ordered[-1],
        "step_ms": step_ms,
        "prepare_ms": [p for p, _ in prepares],
        "evicting": evicting,
    }


def markdown(rows: list[dict], machine: str) -> str:
    def ms(value):
        return "" if value is None else f"{value:.2f}"

    row = rows[0]
    lines = [
        f"Machine: {machine}. {row['model']} shape ({row['layers']} layers, {row['weights']} weights), "
        f"{row['policy']}, {row['batch']} x {row['context']} tokens, {row['steps']} steps, "
        f"graphs {'on' if row['use_graphs'] else 'off'}. Evicting steps: {row['evicting_steps']}.",
        "",
        "| evictions | step ms: median | p99 | max | p99 / median | evicting steps' median | prepare ms: evicting "
        "steps | other steps | p99 | max |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {ms(r['step_ms_median'])} | {ms(r['step_ms_p99'])} | {ms(r['step_ms_max'])} "
            f"| {r['p99_over_median']:.2f} | {ms(r['step_ms_median_evicting'])} | "
            f"{ms(r['prepare_ms_median_evicting'])} | {ms(r['prepare_ms_median_other'])} | "
            f"{ms(r['prepare_ms_p99'])} | {ms(r['prepare_ms_max'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="a named shape (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    parser.add_argument("--policy", default="quest")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=3000, help="prompt tokens")
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed steps first (the engine records its graph in step 3)"
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="folder for eviction_steps.json / .md and a manifest")
    args = parser.parse_args()
    rows = [measure(args, staged=True), measure(args, staged=False)]
    info = manifest.machine()
    machine = f"{info.get('cpu')}, {info.get('cores')} cores" + (
        f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    )
    text = markdown(rows, machine)
    print(text)
    if args.out:
        manifest.save_results(args.out, "eviction_steps", {"machine": machine, "rows": rows}, text)


if __name__ == "__main__":
    main()
