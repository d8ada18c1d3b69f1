"""How concentrated the default model's attention is on the rows Tandem would offload: per layer and head, over the
last `--queries` positions of a prose prompt, the share of the attention mass on the host tier's rows, how much
of that the top 0.1%, 1% and 5% of those rows hold, where in the host span the top 1% lie, and the fewest rows an
oracle would keep so that the mass left out is at most epsilon of the total (what a certified selection at that
epsilon must attend at the least).

The host rows of a query at position p are those Tandem keeps on the host with its defaults: past the
`--sink-tokens` first and before the `--window-tokens` last (p - window, p]. Weights come from transformers' eager
attention (`output_attentions`) for the last queries, after a prefill of the rest with SDPA.

    python benchmarks/measure_concentration.py --lengths 4096 --out benchmarks/results/<date>_<machine>_concentration
    python benchmarks/measure_concentration.py --lengths 4096 --task niah --samples 4   # `tandem eval`'s prompts

Prints and saves concentration.json (per layer, head and query length) and concentration.md (medians and spread
over heads, per layer and over all). The default model, float32, on the CPU; the haystack is Python's docs. With
`--task`, the prompts are `tandem eval`'s samples of that task (seed 0) instead of plain prose, and every sample's
heads are pooled: the oracle beside the share a certified selection attends on the same prompts.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import DynamicCache

from tandem import load_model, manifest
from tandem.integrations.hf import generate_cache_kwargs
from tandem.tools.evaluation.haystack import load_haystack
from tandem.tools.evaluation.names import GENERATION_TASKS
from tandem.tools.evaluation.tasks import TaskBuilder

TOP = (0.001, 0.01, 0.05)
POSITION_BINS = 5


def head_stats(weights: torch.Tensor, first: int, sinks: int, window: int, epsilon: float):
    """Concentration of one head's weights [M, L] (queries at positions first .. first + M - 1), averaged over the
    queries that have host rows, and per such query the mask of the host rows the oracle keeps."""
    per_query, kept_rows = [], []
    for j in range(weights.shape[0]):
        p = first + j
        host_end = p + 1 - window  # rows [sinks, host_end) are on the host
        if host_end <= sinks:
            continue
        w = weights[j, : p + 1].double()
        host = w[sinks:host_end]
        n = host.numel()
        host_mass, total = float(host.sum()), float(w.sum())
        ranked, order = host.sort(descending=True)
        share = {f"top_{t:g}": float(ranked[: max(1, round(t * n))].sum()) / host_mass for t in TOP}
        # the oracle: the fewest host rows whose complement holds at most epsilon of the total mass
        residual = host_mass - ranked.cumsum(0)
        needed = min(n, int((residual > epsilon * total).sum()) + 1) if host_mass > epsilon * total else 0
        kept = torch.zeros(n, dtype=torch.bool)
        kept[order[:needed]] = True
        top = order[: max(1, round(0.01 * n))].double() / max(1, n - 1)  # 0 = oldest host row, 1 = newest
        bins = torch.histc(top, bins=POSITION_BINS, min=0.0, max=1.0) / top.numel()
        per_query.append(
            {"host_rows": n, "host_share": host_mass, "oracle_share": needed / n, **share, "top1_bins": bins}
        )
        kept_rows.append(kept)
    if not per_query:
        return {}, []
    out = {k: statistics.fmean(q[k] for q in per_query) for k in per_query[0] if k != "top1_bins"}
    out["top1_bins"] = (sum(q["top1_bins"] for q in per_query) / len(per_query)).tolist()
    return out, kept_rows


def union_share(kept: list[list[torch.Tensor]]) -> float:
    """The mean over queries of the share of host rows a KV head attends when each of its query heads keeps its
    own oracle rows (`kept`: per query head, per query, a mask of the host rows)."""
    shares = [float(torch.stack(masks).any(0).float().mean()) for masks in zip(*kept, strict=True)]
    return statistics.fmean(shares) if shares else 0.0


def measure(model, ids: torch.Tensor, queries: int, sinks: int, window: int, epsilon: float) -> list[dict]:
    """Per layer: `head_stats` of each query head over the last `queries` positions of ids [1, L] ("heads"), and
    per KV head the share of host rows its group's oracle rows cover together ("kv_union")."""
    length = ids.shape[1]
    cache = DynamicCache()
    saved = model.config._attn_implementation
    with torch.no_grad():
        model(ids[:, : length - queries], **generate_cache_kwargs(model, cache), use_cache=True)
        model.config._attn_implementation = "eager"  # only eager attention returns its weights
        try:
            out = model(
                ids[:, length - queries :],
                **generate_cache_kwargs(model, cache),
                use_cache=True,
                output_attentions=True,
            )
        finally:
            model.config._attn_implementation = saved
    first = length - queries
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    layers = []
    for weights in out.attentions:
        stats = [head_stats(weights[0, h], first, sinks, window, epsilon) for h in range(weights.shape[1])]
        kv_union = [
            union_share([kept for _, kept in stats[g : g + group]]) for g in range(0, len(stats), group)
        ]
        layers.append({"heads": [head for head, _ in stats], "kv_union": kv_union})
    return layers


def _spread(values: list[float]) -> str:
    values = sorted(values)
    lo, hi = values[len(values) // 10], values[(9 * len(values)) // 10]
    return f"{statistics.median(values):.3f} ({lo:.3f}-{hi:.3f})"


def markdown(results: dict, args) -> str:
    lines = [
        f"Default model, float32, CPU. {_prompts(args)}; the last {args.queries} positions of each prompt; "
        f"host rows: past the first {args.sink_tokens}, before the last {args.window_tokens}. Medians over heads "
        "(10th-90th percentile). Shares of the host mass held by the top rows; oracle: the fewest host rows "
        f"that leave at most epsilon {args.epsilon:g} of the total mass out, as a share of the host rows; a KV "
        "head attends the union of its query heads' rows.",
        "",
    ]
    for length, layers in results.items():
        heads = [h for layer in layers for h in layer["heads"] if h]
        unions = [u for layer in layers for u in layer["kv_union"]]
        lines += [
            f"### {length} tokens",
            "",
            "| layers | host share of the mass | top 0.1% | top 1% | top 5% | oracle share per query head | "
            "per KV head (its group's union) |",
            "|---|---|---|---|---|---|---|",
        ]
        groups = [
            (f"{i}", [h for h in layer["heads"] if h], layer["kv_union"]) for i, layer in enumerate(layers)
        ]
        for name, group, union in [*groups, ("all", heads, unions)]:
            if not group:
                continue
            keys = ("host_share", "top_0.001", "top_0.01", "top_0.05", "oracle_share")
            cells = [_spread([h[k] for h in group]) for k in keys] + [_spread(union)]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        bins = [statistics.fmean(h["top1_bins"][b] for h in heads) for b in range(POSITION_BINS)]
        lines += [
            "",
            "Where the top 1% of host rows lie, oldest fifth of the host span first (mean over heads): "
            + ", ".join(f"{b:.2f}" for b in bins)
            + f". Mean oracle share: {statistics.fmean(h['oracle_share'] for h in heads):.3f} per query head, "
            f"{statistics.fmean(unions):.3f} per KV head.",
            "",
        ]
    return "\n".join(lines)


def _prompts(args) -> str:
    if args.task is None:
        return "Prose from Python's docs"
    return (
        f"`tandem eval`'s {args.task} prompts, {args.samples} per length (seed 0, Python's docs as haystack)"
    )


def _pooled(runs: list[list[dict]]) -> list[dict]:
    """Per layer, the heads and KV-head unions of several prompts' `measure`, pooled."""
    return [
        {
            "heads": [h for run in runs for h in run[i]["heads"]],
            "kv_union": [u for run in runs for u in run[i]["kv_union"]],
        }
        for i in range(len(runs[0]))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", default="4096", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--queries", type=int, default=32, help="last positions measured per prompt")
    parser.add_argument("--sink-tokens", type=int, default=64)
    parser.add_argument("--window-tokens", type=int, default=256)
    parser.add_argument("--epsilon", type=float, default=0.05)
    parser.add_argument(
        "--task",
        default=None,
        choices=GENERATION_TASKS,
        help="a `tandem eval` task whose prompts to measure (default: prose)",
    )
    parser.add_argument("--samples", type=int, default=4, help="with --task: prompts per length")
    parser.add_argument("--out", default=None, help="folder for concentration.json / .md and a manifest")
    args = parser.parse_args()
    model, tokenizer = load_model(None, device="cpu", dtype="float32")
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {}
    if args.task is not None:
        builder = TaskBuilder(tokenizer, load_haystack(), seed=0)
        for length in lengths:
            runs = [
                measure(
                    model, sample.input_ids, args.queries, args.sink_tokens, args.window_tokens, args.epsilon
                )
                for sample in builder.samples(args.task, length, args.samples)
            ]
            results[length] = _pooled(runs)
    else:
        ids = tokenizer(load_haystack().text, return_tensors="pt").input_ids
        for length in lengths:
            if length > ids.shape[1] or length > model.config.max_position_embeddings:
                raise SystemExit(
                    f"--lengths: {length} is more than the haystack or the model's positions allow"
                )
            results[length] = measure(
                model, ids[:, :length], args.queries, args.sink_tokens, args.window_tokens, args.epsilon
            )
    text = markdown(results, args)
    print(text)
    if args.out:
        manifest.save_results(args.out, "concentration", {"args": vars(args), "results": results}, text)


if __name__ == "__main__":
    main()
