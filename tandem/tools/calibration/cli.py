"""``tandem calibrate``: measure a model's per-head Eq. 2 budgets and write the profile `policy="fluxion"` reads.

Examples:
    tandem calibrate --out smollm2.pt                       # the default model, Python's docs as documents
    tandem calibrate --model ./Qwen2.5-0.5B-Instruct --haystack essays/ --documents 32 --out qwen.pt
    tandem calibrate --no-train --out static-only.pt        # the static (bgt0, k, s) profile alone
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

from ..arguments import add_model_source_arguments

DESCRIPTION = (
    "Run a model on haystack documents with full attention and measure, for every layer and query head at sampled "
    "decode steps, the smallest budget that keeps its attention output within tau (Fluxion's Eq. 2) at block "
    "sizes 1-128; fit Eq. 1 (bgt0, k), label streaming heads, train the head-property predictor and write one "
    "profile file for TandemConfig(policy='fluxion', profile=...)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_source_arguments(p)
    p.add_argument("--out", required=True, help="profile file to write (e.g. profile.pt)")
    p.add_argument(
        "--haystack", default="pydoc", help="'pydoc' (default) or a folder / .txt / .zip / .whl of prose"
    )
    p.add_argument("--documents", type=int, default=16, help="calibration documents (default 16)")
    p.add_argument("--lengths", default="1k,2k,4k,8k", help="document lengths, cycled (default 1k,2k,4k,8k)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per document (default 32)")
    p.add_argument("--steps", type=int, default=8, help="decode steps measured per document (default 8)")
    p.add_argument(
        "--taus", default="0.02,0.05,0.1,0.2", help="Eq. 2 thresholds to calibrate (default %(default)s)"
    )
    p.add_argument("--sink-tokens", type=int, default=64, help="sinks on the device (default 64)")
    p.add_argument("--window-tokens", type=int, default=256, help="recent window on the device (default 256)")
    p.add_argument("--quantile", type=float, default=0.9,
                   help="budgets cover this quantile of the measured ones (default 0.9)")  # fmt: skip
    p.add_argument("--held-out", type=float, default=0.25, help="share of documents held out (default 0.25)")
    p.add_argument("--no-train", dest="train", action="store_false", help="static profile only, no predictor")
    p.add_argument("--train", dest="train", action="store_true", help="train the predictor (default)")
    p.add_argument("--epochs", type=int, default=60, help="predictor training epochs (default 60)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the calibration documents and the predictor's training (default %(default)s)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(train=True)


def run(args: argparse.Namespace) -> int:
    from ...models import attention_shape, load_model
    from ..evaluation.haystack import load_haystack
    from ..evaluation.runner import parse_lengths
    from .calibrate import CalibrationPlan, build_profile, collect

    taus = tuple(float(t) for t in args.taus.split(",") if t.strip())
    plan = CalibrationPlan(
        lengths=tuple(parse_lengths(args.lengths)), documents=args.documents, new_tokens=args.new_tokens,
        steps=args.steps, taus=taus, sink_tokens=args.sink_tokens, window_tokens=args.window_tokens,
        quantile=args.quantile, held_out=args.held_out, train=args.train, epochs=args.epochs, seed=args.seed,
    )  # fmt: skip
    haystack = load_haystack(args.haystack)
    start = time.perf_counter()
    model, tokenizer = load_model(
        args.model, device=args.device, dtype="float32", cache=False if args.no_model_cache else None
    )
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and min(plan.lengths) + plan.new_tokens + 160 > limit:
        raise ValueError(
            f"--lengths: {min(plan.lengths)} tokens exceed the model's context of {limit} tokens"
        )
    plan.max_positions = limit
    layers, q_heads, kv_heads, head_dim = attention_shape(model.config.get_text_config(decoder=True))
    meta = {
        "model": str(args.model or "SmolLM2-135M-Instruct.Q4_1.gguf"),
        "layers": layers,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "sink_tokens": plan.sink_tokens,
        "window_tokens": plan.window_tokens,
        "haystack": haystack.source,
        "lengths": list(plan.lengths),
        "documents": plan.documents,
        "new_tokens": plan.new_tokens,
        "steps": plan.steps,
        "seed": plan.seed,
        "machine": f"{platform.processor() or platform.machine()}, {_cores()} cores",
        "date": datetime.date.today().isoformat(),
    }
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=plan.documents, desc="calibration documents", unit="doc", file=sys.stderr)

    def on_document(i, info):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(tokens=info["prompt_tokens"], samples=info["samples"])

    samples = collect(model, tokenizer, haystack, plan, on_document)
    if bar is not None:
        bar.close()
    collect_seconds = time.perf_counter() - start
    train_bar = None
    if plan.train and not args.no_progress:
        from tqdm import tqdm

        train_bar = tqdm(total=plan.epochs * len(plan.taus), desc="predictor training", unit="epoch",
                         file=sys.stderr)  # fmt: skip

    def on_epoch(tau, epoch, loss):
        if train_bar is not None:
            train_bar.update(1)
            train_bar.set_postfix(tau=tau, loss=f"{loss:.4f}")

    meta["collect_seconds"] = round(collect_seconds, 1)
    profile = build_profile(samples, plan, meta, on_epoch)
    if train_bar is not None:
        train_bar.close()
    profile.meta["seconds"] = round(time.perf_counter() - start, 1)
    profile.save(args.out)
    print(
        json.dumps({"out": args.out, "meta": profile.meta, "metrics": profile.metrics}, indent=1, default=str)
    )
    return 0


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
