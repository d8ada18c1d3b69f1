"""A prompt that begins with a kept prefix (a shared document) against the same prompt prefilled cold, in one run:
time to first token of each, the greedy tokens of both, and the host bytes the kept prefixes hold.

    python benchmarks/bench_prefix.py --random-weights llama-3.1-8b --document-tokens 32768 \
        --chunk-tokens 2048,16384 --policies quest,certified --out benchmarks/results/<date>_<machine>_prefix
    python benchmarks/bench_prefix.py --document-tokens 4096 --out ...   # the default model

Per case (document length, chunk length, policy): one request, a document and a first question, keeps its prefixes
(`PrefixCache`, as `tandem serve` does: its last two chunk boundaries); then, `--repeats` times after one untimed
warm-up, a second question over the same document runs from the kept prefix ("warm") and cold into a new cache,
each through `TandemRunner.generate`, and the medians are compared. The questions are `--question-tokens` long, so
the document's last whole chunk is what the second question takes. With `--random-weights` the tokens are random
ids and the weights random bf16 (the cost is real, the text noise); otherwise prose through the default model.
Prints and saves prefix.json / prefix.md and a manifest naming the commit and the machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time

import torch

from tandem import TandemCache, TandemConfig, load_model, manifest
from tandem.cache import memory
from tandem.cache.prefix import PrefixCache
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model
from tandem.tools.evaluation.haystack import load_haystack


def _timed(model, config, ids: list[int], tokens: int, chunk: int, store, device, keep=None) -> dict:
    """One request in a new cache: its greedy tokens, seconds to the first, tokens taken from `store`. keep: a list
    the request's runner goes into, its cache kept alive (a request still running) instead of freed."""
    runner = TandemRunner(model, TandemCache.for_model(model, config))
    first = []

    def on_token(token):
        if not first:
            first.append(time.perf_counter())

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = runner.generate(
        torch.tensor([ids], device=device), tokens, chunk_tokens=chunk, on_token=on_token, prefix_cache=store
    )
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    result = {"tokens": out.tolist(), "ttft": first[0] - start, "reused": runner.reused_tokens, "peak": peak}
    if keep is not None:
        keep.append(runner)
    del runner, out
    gc.collect()  # the request's cache freed before the next request, as a server frees it
    return result


def one_case(model, ids: dict, length: int, chunk: int, policy: str, args, device) -> dict:
    config = TandemConfig(policy=policy)
    document = ids["document"][:length]
    first, second = document + ids["first"], document + ids["second"]
    store, running = PrefixCache(), []
    # the request that keeps the document; with --source-running its cache stays, as a request still decoding,
    # so the warm requests copy the prefix instead of taking its host rows over
    _timed(model, config, first, 1, chunk, store, device, running if args.source_running else None)
    kept = store.stats()
    warm, cold, taken_over = [], [], 0
    for attempt in range(args.repeats + 1):
        adopted = store.stats()["adopted"]
        w = _timed(model, config, second, args.answer_tokens, chunk, store, device)
        c = _timed(model, config, second, args.answer_tokens, chunk, None, device)
        if attempt:  # the first: the warm-up (kernels, allocator growth)
            warm.append(w)
            cold.append(c)
            taken_over += store.stats()["adopted"] - adopted
    running.clear()
    gc.collect()
    ttft_warm = statistics.median(r["ttft"] for r in warm)
    ttft_cold = statistics.median(r["ttft"] for r in cold)
    return {
        "policy": policy,
        "document_tokens": length,
        "prompt_tokens": len(second),
        "chunk_tokens": chunk,
        "reused_tokens": warm[0]["reused"],
        "ttft_warm_s": ttft_warm,
        "ttft_cold_s": ttft_cold,
        "ratio": ttft_warm / ttft_cold,
        "same_tokens": all(w["tokens"] == c["tokens"] for w, c in zip(warm, cold, strict=True)),
        "taken_over": taken_over,  # warm requests that took the kept host rows over (the others copied them)
        "kept_bytes": kept["bytes"],
        "kept_prefixes": kept["entries"],
        "peak_warm_gb": None if warm[0]["peak"] is None else max(r["peak"] for r in warm) / 1e9,
        "peak_cold_gb": None if cold[0]["peak"] is None else max(r["peak"] for r in cold) / 1e9,
        "repeats": args.repeats,
    }


def markdown(machine: dict, args, rows: list[dict]) -> str:
    where = machine["gpu"] or f"{machine['cpu']}, {machine['cores']} cores"
    model = f"{args.random_weights} (random bf16 weights, random token ids)" if args.random_weights else (
        args.model or "the default model")  # fmt: skip
    lines = [
        f"# A prompt from a kept prefix against the same prompt cold: {model} on {where}",
        "",
        f"A document and a {args.question_tokens}-token question; a first request with another question keeps its "
        f"prefixes (its last two chunk boundaries), then the second question's request runs from them (warm) and "
        f"cold in a new cache, {args.answer_tokens} greedy tokens each, each request's cache freed before the "
        f"next{'; the first request kept running (its cache held), so warm requests copy the prefix' if args.source_running else ''}; "
        f"host pool {'on' if args.host_pool else 'off'} (`tandem serve`'s default on CUDA). "
        f"Time to first token, median of {args.repeats} after a warm-up. Same tokens: warm and cold equal in "
        "every repeat. Host rows taken over: warm requests that took the kept host rows over instead of copying "
        "them (no request was writing into them any more).",
        "",
        "| policy | document | chunk | prompt tokens | from the prefix | TTFT warm | TTFT cold | ratio | same tokens "
        "| host rows taken over | kept (host) | peak device warm / cold |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        peak = "" if r["peak_warm_gb"] is None else f"{r['peak_warm_gb']:.1f} / {r['peak_cold_gb']:.1f} GB"
        lines.append(
            f"| {r['policy']} | {r['document_tokens']} | {r['chunk_tokens']} | {r['prompt_tokens']} | "
            f"{r['reused_tokens']} | {r['ttft_warm_s'] * 1e3:.0f} ms | {r['ttft_cold_s'] * 1e3:.0f} ms | "
            f"{r['ratio']:.3f}x | {'yes' if r['same_tokens'] else 'no'} | {r['taken_over']} of {r['repeats']} | "
            f"{r['kept_bytes'] / 1e9:.2f} GB | {peak} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF directory or .gguf (default: the default model)")
    p.add_argument(
        "--random-weights", default=None, metavar="SHAPE", help="a named shape with random weights"
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: CUDA if available)")
    p.add_argument("--document-tokens", default="4096", help="comma list of document lengths")
    p.add_argument("--chunk-tokens", default="2048", help="comma list of prefill chunk lengths")
    p.add_argument("--policies", default="quest,certified", help="comma list of TandemConfig policies")
    p.add_argument("--question-tokens", type=int, default=256, help="each question's length in tokens")
    p.add_argument("--answer-tokens", type=int, default=8, help="greedy tokens of each answer")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each case (after one warm-up)")
    p.add_argument(
        "--source-running",
        action="store_true",
        help="keep the first request's cache alive while the others run (a request still decoding): hits copy",
    )
    p.add_argument(
        "--no-host-pool",
        dest="host_pool",
        action="store_false",
        help="map every request's host tier anew (default: freed ones are reused, as `tandem serve` does on CUDA)",
    )
    p.add_argument("--out", default=None, help="directory for prefix.json / .md and the manifest")
    args = p.parse_args()
    if min(args.repeats, args.answer_tokens, args.question_tokens) < 1:
        p.error("--repeats, --answer-tokens and --question-tokens must be >= 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.host_pool and device.type == "cuda":
        memory.enable_host_pool()
    args.host_pool = args.host_pool and device.type == "cuda"
    machine = {"cpu": platform.processor() or platform.machine(), "cores": manifest.machine()["cores"],
               "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}  # fmt: skip
    print(json.dumps(machine), flush=True)
    longest = max(int(x) for x in args.document_tokens.split(","))
    q = args.question_tokens
    if args.random_weights:
        model = build_random_model(args.random_weights, device, torch.bfloat16)
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, 1 << 20)
        draw = torch.randint(
            0, model.config.vocab_size, (longest + 2 * q,), generator=torch.Generator().manual_seed(0)
        )
        text = draw.tolist()
    else:
        model, tokenizer = load_model(args.model, device=str(device))
        text = tokenizer(load_haystack().text, add_special_tokens=False).input_ids
        if len(text) < longest + 2 * q:
            p.error(f"--document-tokens: the prose holds {len(text) - 2 * q} tokens for a document at most")
    ids = {
        "document": text[:longest],
        "first": text[longest : longest + q],
        "second": text[longest + q : longest + 2 * q],
    }
    rows = []
    with torch.inference_mode():
        for length in (int(x) for x in args.document_tokens.split(",")):
            for chunk in (int(x) for x in args.chunk_tokens.split(",")):
                for policy in args.policies.split(","):
                    rows.append(one_case(model, ids, length, chunk, policy, args, device))
                    print(json.dumps(rows[-1]), flush=True)
    text = markdown(machine, args, rows)
    print(text)
    if args.out:
        manifest.save_results(
            args.out, "prefix", {"machine": machine, "args": vars(args), "rows": rows}, text
        )


if __name__ == "__main__":
    main()
