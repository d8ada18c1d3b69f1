"""The server's decode step (`engine.rows.RowsRunner`: B requests, each its own cache) against the same B rows as
one static batch in one cache (`TandemRunner`, what `tandem bench` measures), side by side in one process.

For each policy and batch size B: B requests of `--prompt-tokens` random tokens are prefilled into their own
caches, then `--steps` decode steps of all of them run through one `RowsRunner`, recorded as a CUDA graph once the
batch has kept its requests for `record_after` steps (eager before: the steps a served batch takes while requests
join and leave). That runs twice: with each request's hot tier its own ("own"), and with the hot tiers in the
runner's pool (`slots`, "pooled": one hot-tier attention and one hand-off per layer for all rows; what the server
runs). The static side prefills the same B x prompt in one cache and decodes as many steps. Reported: the median
eager rows step, the recording step, the median replayed rows step, the static step, and rows / static. Random
weights of a named shape (the cost is real, the tokens are noise).

    python benchmarks/bench_rows.py --shape smollm2-135m --policies certified,streaming --batches 1,4,16 \
        --out benchmarks/results/<date>_<machine>_rows
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tandem import TandemCache, TandemConfig, manifest
from tandem.config import parse_setting
from tandem.engine.rows import RowsRunner
from tandem.engine.runner import TandemRunner
from tandem.integrations.hf import generate_cache_kwargs
from tandem.shapes import build_random_model


def _timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _rows(model, config, batch: int, args, device, pooled: bool) -> dict:
    vocab = model.config.vocab_size
    runner = RowsRunner(model, record_after=args.record_after, slots=batch if pooled else 0, config=config)
    caches = []
    for b in range(batch):
        cache = TandemCache.for_model(model, config)
        runner.attach(cache)
        for kv in cache.tandem_layers():
            kv.capacity_hint = args.prompt_tokens + args.steps + 1
        ids = torch.randint(0, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(b))
        model(
            input_ids=ids.to(device), use_cache=True, logits_to_keep=1, **generate_cache_kwargs(model, cache)
        )
        caches.append(cache)
    seconds = []
    for _ in range(args.steps):
        positions = [cache.get_seq_length() for cache in caches]
        seconds.append(_timed(lambda positions=positions: runner.step(caches, [1] * batch, positions)))
    runner.release()
    recorded = runner.recordings > 0
    eager = seconds[: args.record_after] if recorded else seconds[1:]  # without graphs: past the first step
    return {
        "eager_ms": 1e3 * statistics.median(eager),
        "recording_ms": 1e3 * seconds[args.record_after] if recorded else None,
        "replay_ms": 1e3 * statistics.median(seconds[args.record_after + 1 :]) if recorded else None,
        "all_ms": [round(1e3 * s, 2) for s in seconds],
    }


def _static(model, config, batch: int, args, device) -> dict:
    vocab = model.config.vocab_size
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    ids = torch.randint(0, vocab, (batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    runner.prefill(ids.to(device), max_new_tokens=args.steps + 1)
    _, seconds = runner.decode(torch.ones(batch, dtype=torch.long, device=device), args.steps)
    return {
        "step_ms": 1e3 * statistics.median(seconds[args.record_after + 1 :]),
        "all_ms": [round(1e3 * s, 2) for s in seconds],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="smollm2-135m", help="random weights of this model shape")
    p.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if available)")
    p.add_argument("--policies", default="certified,streaming")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--record-after", type=int, default=2, help="RowsRunner's record_after")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a config setting for every policy, as `tandem bench --set` (e.g. quest.gpu_share=0); repeatable",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="directory for rows.json / .md and the manifest")
    args = p.parse_args()
    settings = {}
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            p.error(f"--set takes KEY=VALUE, got {item!r}")
        try:
            settings[key.strip()] = parse_setting(key.strip(), text.strip())
        except ValueError as err:
            p.error(f"--set {item}: {err}")
    if args.steps < args.record_after + 2:
        p.error(f"--steps must be at least --record-after + 2 = {args.record_after + 2}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    machine = manifest.machine()
    print(machine, flush=True)
    model = build_random_model(args.shape, device, torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for policy in args.policies.split(","):
            try:
                config = TandemConfig(policy=policy).with_settings(settings)
            except ValueError as err:
                p.error(f"--set with policy {policy}: {err}")
            for batch in (int(b) for b in args.batches.split(",")):
                row = {"policy": policy, "batch": batch,
                       "rows": _rows(model, config, batch, args, device, pooled=False),
                       "pooled": _rows(model, config, batch, args, device, pooled=True),
                       "static": _static(model, config, batch, args, device)}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    where = ", ".join(machine["gpus"]) or machine["cpu"]
    lines = [
        f"# Rows step (each request its own cache) against a static batch: {args.shape} shape, random weights, {where}",
        "",
        f"{args.prompt_tokens}-token prompts, {args.steps} decode steps; the rows are recorded after "
        f"{args.record_after} eager steps (CUDA only; on the CPU every step is eager). Medians in ms; x: times the static "
        "batch's step." + (f" Settings: {', '.join(args.set)}." if args.set else ""),
        "",
        "| policy | B | hot tiers | rows eager | rows recording | rows replayed | static batch | eager / static | "
        "replayed / static |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row["static"]
        for kind in ("rows", "pooled"):
            r = row[kind]
            replay = "-" if r["replay_ms"] is None else f"{r['replay_ms']:.1f}"
            record = "-" if r["recording_ms"] is None else f"{r['recording_ms']:.0f}"
            ratio = "-" if r["replay_ms"] is None else f"{r['replay_ms'] / s['step_ms']:.1f}x"
            lines.append(f"| {row['policy']} | {row['batch']} | {'own' if kind == 'rows' else 'pooled'} | "
                         f"{r['eager_ms']:.1f} | {record} | {replay} | {s['step_ms']:.1f} | "
                         f"{r['eager_ms'] / s['step_ms']:.1f}x | {ratio} |")  # fmt: skip
    print("\n".join(lines))
    if args.out:
        data = {"machine": machine, "shape": args.shape, "prompt_tokens": args.prompt_tokens, "settings": args.set,
                "rows": rows}  # fmt: skip
        manifest.save_results(args.out, "rows", data, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
