"""Tightness of the certified selection (`TandemConfig.certified.epsilon`, quest's or fluxion's) on the default model: for every layer,
decode step and (request, query head), the certified probability of the skipped entries beside the measured one,
full attention over the same cache in float64. Each cell selects with one `certify_bound` (`--bounds`: the int8
key sketch, or the block digests), and every bound's certificate of that same selection is recorded: the
sketch, the digests (box + ball) and the box alone. Also the output bound beside the measured deviation, and the
share of host blocks kept and of head-steps that met epsilon. Prompts are `tandem eval`'s niah samples (a
haystack with one planted fact).

    python benchmarks/bench_certified.py --lengths 2048,4096 --epsilons 0.01,0.05,0.1 --bounds sketch,digest \
        --samples 20 --out benchmarks/results/<date>_<machine>_certified

Prints and saves certified.json / certified.md (+ a manifest, and certified.png with matplotlib: certified against
measured p, both bounds). Every soundness violation is counted; there must be none.

`--cost` instead times the certified selection (bounds, hot mass, ranking and tail, union), with the digest and
with the sketch bound over blocks, and over single rows as the default selects (`certify.certified_rows`, the
sketch bound), against quest's own selection (block bounds + top-k) on one Llama-3.1-8B-shaped layer's digests
and key sketch (random keys), side by side. On CUDA each is recorded in a CUDA graph and timed by replays, as the
engine runs it, and the row selection runs twice: with the Triton kernels (sketch bounds, histogram) and with the
torch versions they replace:

    python benchmarks/bench_certified.py --cost --contexts 32768,131072 --out benchmarks/results/<...>_certified_cost

`--gaps` instead measures, on one decode step of the default model (a `--lengths` niah prompt), how far each bound
lies above the truth, per layer: the mean gap between a 16-token block's box / ball bound and its largest real
logit, the factor by which the certificate's mass bound (n_b exp(u_b), every block) over-states the real mass, and
that factor for per-row bounds from an 8-bit and a 4-bit key sketch (u_row = q.k~ + |q| |k - k~|, the sketch
rounding each row to its largest magnitude):

    python benchmarks/bench_certified.py --gaps --lengths 2048 --out benchmarks/results/<...>_certified_gaps
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from tandem import TandemCache, TandemConfig, generate_cache_kwargs, load_model, manifest
from tandem.config import CertifiedConfig
from tandem.tools.evaluation.certified import trace_certificates
from tandem.tools.evaluation.haystack import load_haystack
from tandem.tools.evaluation.tasks import TaskBuilder


def _quantiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median": at(0.5), "p90": at(0.9), "max": ordered[-1]}


BOUNDS = ("sketch", "digest", "box")  # the certificates recorded for every selection (`trace_certificates`)


def cell(
    model,
    samples,
    epsilon: float,
    bound: str,
    max_budget: float,
    steps: int,
    window: int,
    policy: str = "quest",
) -> dict:
    """Every head-step of `samples` decoded with `policy`'s certified selection at `epsilon` with `bound` (fluxion:
    its default profile and tau, the certificate adding blocks to its own selection)."""
    heads: dict[str, list[float]] = {
        k: []
        for k in (
            "p_measured",
            "p_certified",
            "deviation",
            "bound",
            *(f"{x}_{b}" for x in ("p", "bound") for b in BOUNDS),
        )
    }
    met, kept, needed, violations = [], [], [], 0
    start = time.perf_counter()
    for sample in samples:
        config = TandemConfig(policy=policy, sink_tokens=64 if policy == "fluxion" else 16, window_tokens=window, certified=CertifiedConfig(epsilon=epsilon, max_budget=max_budget, bound=bound))  # fmt: skip
        cache = TandemCache.for_model(model, config)
        with trace_certificates() as records:
            model.generate(
                sample.input_ids, max_new_tokens=steps, do_sample=False, pad_token_id=0,
                **generate_cache_kwargs(model, cache),
            )  # fmt: skip
        for r in records:
            for key in heads:
                heads[key] += r[key]
            met += r["met"]
            kept += r["kept"]
            needed += r["needed"]
            for name in ("p_certified", *(f"p_{b}" for b in BOUNDS)):
                violations += sum(p > c + 1e-6 for p, c in zip(r["p_measured"], r[name]))
            for name in ("bound", *(f"bound_{b}" for b in BOUNDS)):
                violations += sum(d > b * (1 + 1e-3) + 1e-4 for d, b in zip(r["deviation"], r[name]))
    measured = heads["p_measured"]
    return {
        "policy": policy,
        "epsilon": epsilon,
        "certify_bound": bound,
        "head_steps": len(met),
        "violations": violations,
        "met_share": sum(met) / len(met) if met else None,
        "blocks_kept": statistics.mean(kept) if kept else None,
        "blocks_kept_quantiles": _quantiles(kept),
        "blocks_needed": statistics.mean(needed) if needed else None,
        "blocks_needed_quantiles": _quantiles(needed),
        "p_measured": _quantiles(measured),
        "p_certified": _quantiles(heads["p_certified"]),
        **{f"p_{b}": _quantiles(heads[f"p_{b}"]) for b in BOUNDS},
        # each bound's over-statement of the same selection's skipped probability (the measured p floored at 1e-12)
        **{
            f"{b}_over_measured": _quantiles([c / max(p, 1e-12) for p, c in zip(measured, heads[f"p_{b}"])])
            for b in BOUNDS
        },
        "deviation": _quantiles(heads["deviation"]),
        "bound": _quantiles(heads["bound"]),
        # each bound's output bound over the measured deviation (floored at 1e-12)
        **{
            f"{b}_bound_over_deviation": _quantiles(
                [c / max(d, 1e-12) for d, c in zip(heads["deviation"], heads[f"bound_{b}"])]
            )
            for b in BOUNDS
        },
        "seconds": time.perf_counter() - start,
        "points": {
            k: heads[k][:: max(1, len(met) // 2000)]
            for k in ("p_measured", "deviation", *(f"{x}_{b}" for x in ("p", "bound") for b in BOUNDS))
        },
    }


def bound_gaps(model, sample, block: int = 16) -> list[dict]:
    """Per layer, on one decode step of `sample`: the bounds against the true logits (see the module doc)."""
    from tandem.policies import certify

    seen = {}
    config = TandemConfig(
        policy="quest", sink_tokens=16, window_tokens=256, certified=CertifiedConfig(epsilon=0.05)
    )
    cache = TandemCache.for_model(model, config)
    with trace_certificates(on_select=lambda layer, q: seen.setdefault(layer.layer_idx, (layer, q))):
        model.generate(
            sample.input_ids,
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=0,
            **generate_cache_kwargs(model, cache),
        )
    rows = []
    for index, (layer, q) in sorted(seen.items()):
        keys, values, valid = layer.host.live()
        batch, heads, n, dim = keys.shape
        nb = n // block
        k = keys.float()[:, :, : nb * block]
        qg = q.float().view(batch, heads, -1, dim)
        scale = layer.attention_scale
        true = (qg @ k.transpose(-1, -2)) * scale  # [B, Hkv, G, n]
        blocks = true.view(*true.shape[:3], nb, block)
        true_max, true_mass = blocks.amax(-1), true.logsumexp(-1)
        centre, radius, _, counts = certify.block_digest(
            k, values[:, :, : nb * block], valid[:, : nb * block], block
        )
        kb = k.view(batch, heads, nb, block, dim)
        args = (q, kb.amin(3), kb.amax(3), centre, radius, counts, scale)
        box, both = certify.logit_bounds(*args, ball=False), certify.logit_bounds(*args)
        ball_only = (
            (qg @ centre.transpose(-1, -2)) + qg.norm(dim=-1, keepdim=True) * radius[:, :, None]
        ) * scale
        row = {
            "layer": index,
            "box_gap": float((box.view_as(true_max) - true_max).mean()),
            "ball_gap": float((ball_only - true_max).mean()),
            "mass_factor": float(
                certify.mass_bounds(both, counts).view_as(true_max).logsumexp(-1).sub(true_mass).mean().exp()
            ),
        }
        for bits in (8, 4):
            top = 2 ** (bits - 1) - 1
            step = k.abs().amax(-1, keepdim=True) / top
            sketch = (k / step).round().clamp(-top, top) * step
            bound = (
                qg @ sketch.transpose(-1, -2)
                + qg.norm(dim=-1, keepdim=True) * (k - sketch).norm(dim=-1)[:, :, None]
            ) * scale
            row[f"sketch{bits}_mass_factor"] = float((bound.logsumexp(-1) - true_mass).mean().exp())
        rows.append(row)
    return rows


def selection_cost(context: int, batch: int, device: str, repeats: int = 20) -> dict:
    """Median seconds of one layer's certified selection (digest bound: "certified_ms", sketch bound:
    "sketch_ms") and of quest's selection over the same keys' digests and sketch: the Llama-3.1-8B layer shape (32 query / 8 KV heads of 128), 16-token blocks, 256 hot slots, random bf16 keys."""
    from tandem.kernels import ops
    from tandem.policies import certify
    from tandem.policies.granularity import mask_to_ids

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 32, 8, 128, 16
    nb = context // block
    keys = torch.randn(batch, kv_heads, nb, block, dim, generator=gen).to(torch.bfloat16).to(device)
    key_min, key_max = keys.amin(3), keys.amax(3)
    centre = keys.float().mean(3)
    radius = (keys.float() - centre[:, :, :, None]).norm(dim=-1).amax(-1)
    value_norm = torch.rand(batch, kv_heads, nb, device=device)
    rows = torch.full((batch, nb), float(block), device=device)
    valid = torch.ones(batch, nb, dtype=torch.bool, device=device)
    row_valid = torch.ones(batch, context, dtype=torch.bool)
    sketch = certify.key_sketch(keys.view(batch, kv_heads, context, dim).cpu(), row_valid)
    codes, row_scale, error = (t.to(device) for t in sketch)
    row_valid = row_valid.to(device)
    q = torch.randn(batch, heads, dim, generator=gen).to(torch.bfloat16).to(device)
    hot_keys = torch.randn(batch, kv_heads, 256, dim, generator=gen).to(torch.bfloat16).to(device)
    hot_valid = torch.ones(batch, 256, dtype=torch.bool, device=device)
    scale = dim**-0.5
    k_max = max(1, nb // 20)
    k = torch.tensor([k_max], device=device)
    # the caps as device tensors: an int would be copied from pageable memory, which a graph's capture refuses
    half_blocks, half_rows = (torch.tensor(v, device=device) for v in (nb // 2, context // 2))

    def quest():
        scores = ops.block_scores_matmul(q, key_min, key_max, valid)
        return ops.top_blocks(scores, k, k_max)

    def certified(bound):
        if bound == "sketch":
            bounds = certify.sketch_logit_bounds(q, codes, row_scale, error, row_valid, scale)
            mass, lower = (certify.sketch_mass_bounds(b, block) for b in bounds)
        else:
            mass = certify.mass_bounds(
                certify.logit_bounds(q, key_min, key_max, centre, radius, rows, scale), rows
            )
            lower = certify.ball_lower_mass(q, centre, radius, rows, scale)
        known = certify.hot_mass(q, hot_keys, hot_valid, scale)
        union, _, _ = certify.certified_blocks(mass, known, 0.05, half_blocks, kv_heads, lower)
        return mask_to_ids(union), value_norm

    def rows_selection():
        known = certify.hot_mass(q, hot_keys, hot_valid, scale)
        union, *_ = certify.certified_rows(
            q,
            codes,
            row_scale,
            error,
            row_valid,
            scale,
            known,
            0.05,
            half_rows,
            kv_heads,
            value_norm,
            block,
        )
        return mask_to_ids(union)

    def torch_only(fn):
        def run():
            saved = ops._triton_on
            ops._triton_on = lambda device: False
            try:
                return fn()
            finally:
                ops._triton_on = saved

        return run

    def timed(fn):
        if device == "cuda":  # as the engine runs it: recorded once, replayed
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            fn = graph.replay
        fn()
        seconds = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    quest_s = timed(quest)
    digest_s, sketch_s = timed(lambda: certified("digest")), timed(lambda: certified("sketch"))
    rows_s, rows_torch_s = timed(rows_selection), timed(torch_only(rows_selection))
    return {"context": context, "batch": batch, "device": device, "graphs": device == "cuda",
            "quest_ms": quest_s * 1e3, "certified_ms": digest_s * 1e3, "ratio": digest_s / quest_s,
            "sketch_ms": sketch_s * 1e3, "sketch_ratio": sketch_s / quest_s,
            "rows_ms": rows_s * 1e3, "rows_ratio": rows_s / quest_s,
            "rows_torch_ms": rows_torch_s * 1e3, "rows_torch_ratio": rows_torch_s / quest_s}  # fmt: skip


def _output_overstatement(row: dict) -> str:
    if "box_bound_over_deviation" not in row:  # recorded since the output bounds per bound
        return "n/a"
    return " / ".join(
        f"{row[f'{b}_bound_over_deviation']['median']:.3g}" for b in ("sketch", "digest", "box")
    )


def markdown(rows: list[dict], machine: dict, args) -> str:
    lines = [
        "# Certified selection: certificate against measurement (default model)",
        "",
        f"Machine: {machine.get('cpu', machine)}. SmolLM2-135M-Instruct (real weights), niah prompts, {args.samples} "
        f"samples per cell, {args.steps} decode steps each, sinks 16 (fluxion 64), window {args.window}, max_budget "
        f"{args.max_budget}. Quantiles are over (layer, step, request, query head); blocks kept (the union a KV "
        "head attends) over (layer, step, request, KV head); blocks a head needs: what its certificate asked "
        "for, before max_budget, as a share of the live host blocks. Each over-statement is that bound's certificate of the cell's selection over "
        "the measured p.",
        "",
        "| length | policy | selects with | epsilon | head-steps | violations | met epsilon | blocks kept (mean / median) | "
        "blocks a head needs (mean / median) | "
        "measured p (median / p90) | certified p (median / p90) | over-statement: sketch / digest / box "
        "(median) | deviation / bound (median) | output over-statement: sketch / digest / box (median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r.get('policy', 'quest')} | {r['certify_bound']} | {r['epsilon']} | {r['head_steps']} | {r['violations']} | "
            f"{r['met_share']:.1%} | {r['blocks_kept']:.1%} / {r['blocks_kept_quantiles']['median']:.1%} | "
            f"{r['blocks_needed']:.1%} / {r['blocks_needed_quantiles']['median']:.1%} | "
            f"{r['p_measured']['median']:.2e} / {r['p_measured']['p90']:.2e} | "
            f"{r['p_certified']['median']:.2e} / {r['p_certified']['p90']:.2e} | "
            f"{r['sketch_over_measured']['median']:.3g} / {r['digest_over_measured']['median']:.3g} / "
            f"{r['box_over_measured']['median']:.3g} | {r['deviation']['median']:.2e} / "
            f"{r['bound']['median']:.2e} | {_output_overstatement(r)} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Per cell: certified against measured p (top) and each bound's output bound against the measured output
    deviation (bottom), for the box bound alone, box + ball and the int8 sketch."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(2, len(rows), figsize=(4 * len(rows), 8), squeeze=False)
    labels = (("box", "box alone"), ("digest", "box + ball"), ("sketch", "int8 sketch"))
    for column, r in enumerate(rows):
        pts = r["points"]
        title = f"{r['length']} tokens, {r.get('policy', 'quest')}, {r['certify_bound']}, eps {r['epsilon']}"
        top, bottom = axes[0][column], axes[1][column]
        measured = [max(p, 1e-12) for p in pts["p_measured"]]
        for name, label in labels:
            top.loglog(measured, pts[f"p_{name}"], ".", ms=2, label=label)
        top.plot([1e-12, 1], [1e-12, 1], "k-", lw=0.5)
        top.set(title=title, xlabel="measured p", ylabel="certified p")
        top.legend(fontsize=7)
        if "deviation" in pts and "bound_box" in pts:  # recorded since the output bounds per bound
            deviation = [max(d, 1e-12) for d in pts["deviation"]]
            for name, label in labels:
                bottom.loglog(deviation, pts[f"bound_{name}"], ".", ms=2, label=label)
            bottom.plot([1e-12, 1e3], [1e-12, 1e3], "k-", lw=0.5)
            bottom.set(xlabel="measured output deviation", ylabel="output bound")
            bottom.legend(fontsize=7)
        else:
            bottom.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _report(out, name: str, rows: list[dict], title: str, how: str, header: str, row_line) -> None:
    """Print a markdown table of `rows` under `title` and the machine, and save it (with the rows as JSON) to
    `out` as `name` when given."""
    machine = manifest.machine()
    lines = [title, "", f"Machine: {machine.get('cpu', machine)}. {how}", "", header]
    lines += ["|" + "---|" * (header.count("|") - 1)] + [row_line(r) for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        manifest.save_results(out, name, {"machine": machine, "rows": rows}, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--epsilons", default="0.01,0.05,0.1")
    p.add_argument("--bounds", default="sketch,digest", help="the certify_bound each cell selects with")
    p.add_argument(
        "--policies", default="quest", help="quest, fluxion: whose certified selection each cell runs"
    )
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--max-budget", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--cost", action="store_true", help="time the selection instead (see the module doc)")
    p.add_argument(
        "--gaps", action="store_true", help="measure the bounds' gaps instead (see the module doc)"
    )
    p.add_argument("--contexts", default="32768,131072", help="--cost: contexts of the 8B-shaped layer")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="--cost: device")
    args = p.parse_args()
    if args.cost:
        rows = [selection_cost(int(c), 1, args.device) for c in args.contexts.split(",")]
        _report(
            args.out, "certified_cost", rows,
            f"# Certified selection against quest's selection, one Llama-3.1-8B layer ({args.device}, random keys)",
            "Median of 20 calls each (on CUDA: replays of a recorded graph), batch 1, side by side in one run. "
            "Rows: the default's selection (single rows, sketch bound); torch: the same without the Triton kernels.",
            "| context | quest selection (ms) | certified blocks, digest bound (ms) | / quest | "
            "certified blocks, sketch bound (ms) | / quest | certified rows (ms) | / quest | "
            "certified rows, torch (ms) | / quest |",
            lambda r: f"| {r['context']} | {r['quest_ms']:.3f} | {r['certified_ms']:.3f} | {r['ratio']:.1f}x | "
            f"{r['sketch_ms']:.3f} | {r['sketch_ratio']:.1f}x | {r['rows_ms']:.3f} | {r['rows_ratio']:.1f}x | "
            f"{r['rows_torch_ms']:.3f} | {r['rows_torch_ratio']:.1f}x |",
        )  # fmt: skip
        return
    torch.manual_seed(0)
    model, tokenizer = load_model(device="cpu", dtype="float32")
    builder = TaskBuilder(tokenizer, load_haystack())
    if args.gaps:
        length = int(args.lengths.split(",")[0])
        rows = bound_gaps(model, builder.samples("niah", length, 1)[0])
        _report(
            args.out, "certified_gaps", rows,
            f"# How far the certificate's bounds lie above the truth (default model, one {length}-token niah prompt)",
            "One decode step; means over requests, heads and 16-token blocks.",
            "| layer | box bound - block max (logits) | ball bound - block max | mass bound / mass (box+ball) | "
            "8-bit sketch: bound / mass | 4-bit sketch: bound / mass |",
            lambda r: f"| {r['layer']} | {r['box_gap']:.1f} | {r['ball_gap']:.1f} | {r['mass_factor']:.3g} | "
            f"{r['sketch8_mass_factor']:.2f} | {r['sketch4_mass_factor']:.3g} |",
        )  # fmt: skip
        return
    rows = []
    for length in map(int, args.lengths.split(",")):
        samples = builder.samples("niah", length, args.samples)
        for policy, bound, epsilon in itertools.product(
            args.policies.split(","), args.bounds.split(","), map(float, args.epsilons.split(","))
        ):
            row = {
                "length": length,
                **cell(model, samples, epsilon, bound, args.max_budget, args.steps, args.window, policy),
            }
            rows.append(row)
            print({k: v for k, v in row.items() if k != "points"}, flush=True)
    machine = manifest.machine()
    text = markdown(rows, machine, args)
    print(text)
    if args.out is not None:
        manifest.save_results(args.out, "certified", {"machine": machine, "rows": rows}, text)
        plot(rows, args.out / "certified.png")


if __name__ == "__main__":
    main()
