"""Results of an eval: per-cell summaries, results.json, a markdown table and PNG plots (matplotlib, optional)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from .names import GENERATION_TASKS

UNITS = {"ppl": "perplexity (lower is better)", "error": "mean attention-output error, Fluxion Eq. 2"}
TOLERANCE_POINTS = 1.0  # "within 1 point of full"
ATTENDED_LIMIT = 0.05  # "at <= 5% of host entries attended"
SCORED_FLOOR = 20.0  # a generation cell counts in the verdicts only where the baseline scores at least this


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(
    runs: list[dict], tasks: list[str], lengths: list[int], labels: list[str], baseline: str | None
):
    """One cell per (task, length, policy label) with score, delta vs the baseline and fraction attended.

    Scores: generation tasks 0-100 (mean fraction of answers found); ppl: perplexity over all decoded tokens
    of the samples; error: mean over samples, steps, layers and heads.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        groups[(r["task"], r["length"], r["policy"])].append(r)
    cells = []
    for task in tasks:
        for length in lengths:
            for label in labels:
                group = groups.get((task, length, label))
                if not group:
                    continue
                cell = {
                    "task": task,
                    "length": length,
                    "policy": label,
                    "n": len(group),
                    "fraction_attended": _mean([r["fraction_attended"] for r in group]),
                }
                if any("streaming_head_share" in r for r in group):
                    cell.update(_fluxion_summary(group))
                if task in GENERATION_TASKS:
                    cell["score"] = 100.0 * _mean([r["score"] for r in group])
                    if "hf_identical" in group[0]:
                        cell["hf_identical"] = sum(r["hf_identical"] for r in group)
                        cell["hf_score"] = 100.0 * _mean([r["hf_score"] for r in group])
                elif task == "ppl":
                    tokens = sum(r["tokens"] for r in group)
                    cell["score"] = math.exp(sum(r["nll_sum"] for r in group) / tokens)
                else:
                    cell["score"] = _mean([r["score"] for r in group])
                    cell["max_error"] = max(r["max_error"] for r in group)
                    if all("certified_error" in r for r in group):
                        cell["certified_error"] = _mean([r["certified_error"] for r in group])
                    heads = [r["layer_head_error"] for r in group]
                    cell["layer_head_error"] = [
                        [_mean([h[i][j] for h in heads]) for j in range(len(heads[0][i]))]
                        for i in range(len(heads[0]))
                    ]
                cells.append(cell)
    base = baseline_scores(cells, baseline)
    for cell in cells:
        ref = base.get((cell["task"], cell["length"]))
        cell["delta"] = cell["score"] - ref if ref is not None else None
    return cells


def baseline_scores(cells: list[dict], baseline: str | None) -> dict[tuple, float]:
    """The baseline's score per (task, length)."""
    return {(c["task"], c["length"]): c["score"] for c in cells if c["policy"] == baseline}


def _fluxion_summary(group: list[dict]) -> dict:
    """Fluxion's statistics of a cell: means over its runs (a block size's share counts 0 in a run without it)."""
    shares = [r["granularity_share"] for r in group if r.get("granularity_share")]
    blocks = sorted({int(b) for share in shares for b in share})  # JSON (a merge) gives the keys as strings
    return {
        "streaming_head_share": _mean([r.get("streaming_head_share") for r in group]),
        "mean_head_budget": _mean([r.get("mean_head_budget") for r in group]),
        "granularity_share": {
            b: _mean([next((v for k, v in share.items() if int(k) == b), 0.0) for share in shares])
            for b in blocks
        }
        or None,
    }


def scored(cell: dict, base: dict[tuple, float]) -> bool:
    """Whether a generation cell can judge a policy: the baseline scores at least `SCORED_FLOOR` on its task and
    length (`base`: `baseline_scores`). Where the model cannot do the task with full attention, a sparse policy's
    score there says nothing (a small base model at 32K tokens, for example)."""
    ref = base.get((cell["task"], cell["length"]))
    return ref is not None and ref >= SCORED_FLOOR


def verdicts(cells: list[dict], labels: list[str], baseline: str | None) -> list[dict]:
    """Per policy: does it lose at most 1 point on every scored generation cell (the baseline scores at least
    `SCORED_FLOOR` there) while attending <= 5% of host rows?"""
    out = []
    base = baseline_scores(cells, baseline)
    for label in labels:
        if label == baseline:
            continue
        generation = [c for c in cells if c["policy"] == label and c["task"] in GENERATION_TASKS]
        mine = [c for c in generation if scored(c, base)]
        if not mine or baseline is None:
            continue
        worst = min(c["delta"] for c in mine)
        fractions = [c["fraction_attended"] for c in mine if c["fraction_attended"] is not None]
        peak = max(fractions) if fractions else 0.0
        verdict = {
            "policy": label,
            "worst_delta": worst,
            "mean_delta": _mean([c["delta"] for c in mine]),
            "max_fraction_attended": peak,
            "mean_fraction_attended": _mean(fractions) or 0.0,
            "within_1_point": worst >= -TOLERANCE_POINTS,
            "sparse_enough": peak <= ATTENDED_LIMIT,
            "meets": worst >= -TOLERANCE_POINTS and peak <= ATTENDED_LIMIT,
            "cells_scored": len(mine),
            "cells_below_floor": len(generation) - len(mine),
            # the attended share per context length: does the policy get sparser as contexts grow?
            "fraction_attended_by_length": {
                length: _mean([c["fraction_attended"] for c in generation if c["length"] == length])
                for length in sorted({c["length"] for c in generation})
            },
        }
        if any("streaming_head_share" in c for c in mine):
            verdict["mean_streaming_head_share"] = _mean([c.get("streaming_head_share") for c in mine])
            verdict["mean_head_budget"] = _mean([c.get("mean_head_budget") for c in mine])
        out.append(verdict)
    return out


def build_results(runs: list[dict], plan, meta: dict) -> dict:
    labels = [v.label for v in plan.variants]
    return assemble(runs, plan.tasks, plan.lengths, labels, plan.baseline, meta)


def assemble(runs, tasks, lengths, labels, baseline, meta) -> dict:
    """results.json's content: meta, cells (per task x length x policy), verdicts, hf_check and the runs."""
    cells = summarize(runs, tasks, lengths, labels, baseline)
    results = {"meta": meta, "baseline": baseline, "cells": cells}
    results["verdicts"] = verdicts(cells, labels, baseline)
    compared = [r for r in runs if "hf_identical" in r and r["policy"] == baseline]
    if compared:
        results["hf_check"] = {
            "policy": baseline,
            "compared": len(compared),
            "identical_tokens": sum(r["hf_identical"] for r in compared),
            "equal_score": sum(r["score"] == r["hf_score"] for r in compared),
        }
    results["runs"] = runs
    return results


def merge_results(parts: list[dict]) -> dict:
    """Combine results of runs split over processes or machines (e.g. one per length) into one."""
    if not parts:
        raise ValueError("--merge: no results to merge")
    runs = [r for part in parts for r in part["runs"]]
    tasks = list(dict.fromkeys(t for part in parts for t in part["meta"].get("tasks", [])))
    tasks += [t for t in dict.fromkeys(r["task"] for r in runs) if t not in tasks]
    lengths = sorted({r["length"] for r in runs})
    labels = list(dict.fromkeys(c["policy"] for part in parts for c in part["cells"]))
    meta = dict(parts[0]["meta"])
    meta["lengths"] = lengths
    meta["tasks"] = tasks
    meta["variants"] = {k: v for part in parts for k, v in part["meta"].get("variants", {}).items()}
    machines = list(dict.fromkeys(part["meta"].get("machine", "?") for part in parts))
    meta["machine"] = "; ".join(machines)
    meta["model"] = "; ".join(dict.fromkeys(Path(str(part["meta"].get("model"))).name for part in parts))
    meta["samples"] = "; ".join(dict.fromkeys(str(part["meta"].get("samples")) for part in parts))
    meta["command"] = " ; ".join(
        (f"# on {part['meta'].get('machine')}: " if len(machines) > 1 else "")
        + part["meta"].get("command", "?")
        for part in parts
    )
    meta["wall_seconds"] = max(part["meta"].get("wall_seconds") or 0 for part in parts)
    meta["parts"] = sum(part["meta"].get("parts", 1) for part in parts)
    meta["complete"] = all(part["meta"].get("complete", True) for part in parts)
    return assemble(runs, tasks, lengths, labels, parts[0]["baseline"], meta)


# ---- markdown -------------------------------------------------------------------------------------------------
def _fmt_score(task: str, value: float | None) -> str:
    if value is None:
        return "—"
    if task == "error":
        return f"{value:.3g}"
    return f"{value:.2f}" if task == "ppl" else f"{value:.0f}"


def _fmt_delta(task: str, value: float | None) -> str:
    if value is None:
        return ""
    if task == "error":
        return ""
    if abs(value) < 1e-9:
        return " (±0)"
    return f" ({value:+.2f})" if task == "ppl" else f" ({value:+.0f})"


def _fmt_fraction(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{100 * value:.1f}%" if value >= 0.001 or value == 0 else f"{100 * value:.2f}%"


def markdown_table(results: dict) -> str:
    """One row per (task, length), one column per policy: `score (Δ vs full) · attended` (transposed for
    sweeps of many variants)."""
    cells = results["cells"]
    labels = list(dict.fromkeys(c["policy"] for c in cells))
    index = {(c["task"], c["length"], c["policy"]): c for c in cells}
    rows = list(dict.fromkeys((c["task"], c["length"]) for c in cells))

    baseline = results.get("baseline")
    base = baseline_scores(cells, baseline)

    def entry(c) -> str:
        if c is None:
            return ""
        floor = "†" if c["task"] in GENERATION_TASKS and baseline is not None and not scored(c, base) else ""
        return (
            f"{_fmt_score(c['task'], c['score'])}{floor}{_fmt_delta(c['task'], c['delta'])} · "
            f"{_fmt_fraction(c['fraction_attended'])}"
        )

    if len(labels) > 6:  # a sweep: one row per policy variant reads better than a dozen columns
        head = [f"{task} {_fmt_length(length)}" for task, length in rows]
        lines = ["| policy | " + " | ".join(head) + " |", "|---|" + "---:|" * len(rows)]
        for label in labels:
            lines.append(
                f"| {label} | " + " | ".join(entry(index.get((t, n, label))) for t, n in rows) + " |"
            )
        return "\n".join(lines)
    lines = [
        "| task | length | " + " | ".join(labels) + " |",
        "|---|---:|" + "---:|" * len(labels),
    ]
    for task, length in rows:
        parts = [entry(index.get((task, length, label))) for label in labels]
        lines.append(f"| {task} | {_fmt_length(length)} | " + " | ".join(parts) + " |")
    return "\n".join(lines)


def _fmt_length(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def verdict_lines(results: dict) -> list[str]:
    lines = []
    for v in results["verdicts"]:
        mark = "meets" if v["meets"] else "does not meet"
        why = []
        if not v["within_1_point"]:
            why.append(f"loses up to {-v['worst_delta']:.0f} points")
        if not v["sparse_enough"]:
            why.append(f"attends up to {_fmt_fraction(v['max_fraction_attended'])} of host entries")
        detail = (
            f"worst Δ {v['worst_delta']:+.0f} points, mean Δ {v['mean_delta']:+.1f}, "
            f"host entries attended {_fmt_fraction(v['mean_fraction_attended'])} mean / "
            f"{_fmt_fraction(v['max_fraction_attended'])} max"
        )
        if "mean_streaming_head_share" in v:
            detail += (
                f", streaming heads {_fmt_fraction(v['mean_streaming_head_share'])} mean, "
                f"head budget {_fmt_fraction(v['mean_head_budget'])} mean"
            )
        if v.get("cells_below_floor"):
            detail += f"; {v['cells_scored']} cells scored, {v['cells_below_floor']} below the floor (†)"
        lines.append(f"- **{v['policy']}** {mark} the bar ({detail}{'; ' + ', '.join(why) if why else ''}).")
        by_length = v.get("fraction_attended_by_length") or {}
        if len(by_length) > 1:
            shares = ", ".join(f"{_fmt_length(int(n))} {_fmt_fraction(f)}" for n, f in by_length.items())
            lines.append(f"  Host entries attended by context length: {shares}.")
    return lines


def _commands(command: str | None) -> list[str]:
    if not command:
        return []
    lines = []
    for part in command.split(" ; "):
        lines += part.split(": ", 1) if part.startswith("# on ") else [part]
    return ["", "```", *(line + (":" if line.startswith("# on ") else "") for line in lines), "```"]


def markdown(results: dict) -> str:
    meta = results["meta"]
    out = [
        "# tandem eval results",
        "",
        f"Model: {meta.get('model')}; machine: {meta.get('machine')}; {meta.get('date')}.",
        f"Haystack: {meta.get('haystack')}. Samples per cell: {meta.get('samples')} (`n` of each cell in "
        f"results.json); seed {meta.get('seed')}.",
        *_commands(meta.get("command")),
        "",
        "Each cell: `score (Δ vs full) · fraction of host entries attended`. Generation tasks score 0-100 (the "
        "share of expected answers in the output); "
        + "; ".join(f"`{k}`: {v}" for k, v in UNITS.items())
        + ". The fraction attended is over decode steps, layers and KV heads.",
        "",
        markdown_table(results),
        "",
        f'"Within {TOLERANCE_POINTS:.0f} point of full at ≤ {ATTENDED_LIMIT:.0%} of host entries attended" '
        f"(on every generation-task cell where full scores at least {SCORED_FLOOR:.0f}; † marks a cell below "
        "that floor, where the model cannot do the task with full attention and a policy's score says nothing):",
        "",
        *verdict_lines(results),
    ]
    certified = [c for c in results["cells"] if c.get("certified_error") is not None]
    if certified:
        out += [
            "",
            "Certified selection (`epsilon`): the measured error beside its certified bound, in the same units "
            "(the bound holds head by head; docs/certified.md):",
            "",
            "| policy | length | measured error | certified bound |",
            "|---|---|---|---|",
            *(
                f"| {c['policy']} | {_fmt_length(c['length'])} | {c['score']:.3g} | {c['certified_error']:.3g} |"
                for c in certified
            ),
        ]
    check = results.get("hf_check")
    if check:
        out += [
            "",
            f"`{check['policy']}` against plain transformers generation (DynamicCache): identical tokens on "
            f"{check['identical_tokens']}/{check['compared']} samples, equal score on "
            f"{check['equal_score']}/{check['compared']}.",
        ]
    if meta.get("wall_seconds") is not None:
        parts = meta.get("parts", 1)
        longest = f" (the longest of the {parts} merged runs)" if parts > 1 else ""
        out += ["", f"Wall time: {meta['wall_seconds'] / 60:.1f} min{longest}."]
    return "\n".join(line for line in out if line is not None) + "\n"


# ---- files --------------------------------------------------------------------------------------------------
def write_results(results: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write results.json, results.md and (if matplotlib is installed and plots=True) PNGs; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(_dumps(results) + "\n", encoding="utf-8")
    md_path.write_text(markdown(results), encoding="utf-8")
    written = [json_path, md_path]
    if plots:
        written += write_plots(results, out)
    return written


def _dumps(results: dict) -> str:
    """Indented JSON with numeric lists (the layer x head error matrices) on one line each, 4 digits."""
    text = json.dumps(_round_lists(results), indent=1, default=_jsonable)
    return _NUMBERS.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)


_NUMBERS = re.compile(r"\[\s*((?:-?[0-9.eE+-]+,?\s*)+)\]")


def _round_lists(value):
    if isinstance(value, dict):
        return {k: _round_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(x, float) for x in value):
            return [float(f"{x:.4g}") for x in value]
        return [_round_lists(x) for x in value]
    return value


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(results: dict, out: Path) -> list[Path]:
    """accuracy_vs_length.png (one panel per task, a line per policy) and error_vs_attended.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []  # the optional `plots` extra is not installed
    cells = results["cells"]
    labels = list(dict.fromkeys(c["policy"] for c in cells))
    written = []
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    styles = {
        label: {
            "color": palette(i % palette.N),
            "marker": "osD^v<>ph*"[i % 10],
            "linestyle": ("-", "--", "-.", ":")[i % 4],
            "markersize": 7 - (i % 3),
        }
        for i, label in enumerate(labels)
    }
    panels = [t for t in dict.fromkeys(c["task"] for c in cells) if t != "error"]
    if panels:
        cols = min(3, len(panels))
        rows = math.ceil(len(panels) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
        for ax, task in zip(axes.flat, panels):
            for label in labels:
                pts = sorted(
                    (c["length"], c["score"]) for c in cells if c["task"] == task and c["policy"] == label
                )
                if pts:
                    ax.plot(
                        [p[0] for p in pts], [p[1] for p in pts], label=label, alpha=0.85, **styles[label]
                    )
            ax.set_xscale("log", base=2)
            ax.set_title(task)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel("perplexity" if task == "ppl" else "score (0-100)")
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(panels) :]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        written.append(_save(fig, out / "accuracy_vs_length.png"))
    errors = [c for c in cells if c["task"] == "error" and c["fraction_attended"] is not None]
    if errors:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for label in labels:
            mine = [c for c in errors if c["policy"] == label]
            if mine:
                style = {k: v for k, v in styles[label].items() if k in ("color", "marker")}
                ax.scatter(
                    [c["fraction_attended"] for c in mine], [c["score"] for c in mine], label=label, **style
                )
                for c in mine:
                    ax.annotate(_fmt_length(c["length"]), (c["fraction_attended"], c["score"]), fontsize=7)
        ax.set_xlabel("fraction of host entries attended")
        ax.set_ylabel("mean attention-output error (Eq. 2)")
        ax.set_xscale("symlog", linthresh=0.01)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "error_vs_attended.png"))
    certified = [c for c in cells if c.get("certified_error") is not None]
    if certified:
        fig, ax = plt.subplots(figsize=(5, 4.5))
        measured, bounds = [c["score"] for c in certified], [c["certified_error"] for c in certified]
        ax.loglog(measured, bounds, "o")
        for c in certified:
            ax.annotate(
                f"{c['policy']} {_fmt_length(c['length'])}", (c["score"], c["certified_error"]), fontsize=6
            )
        low, high = min(measured + bounds), max(measured + bounds)
        ax.plot([low, high], [low, high], "k-", lw=0.5)  # certified = measured
        ax.set_xlabel("measured attention-output error (Eq. 2)")
        ax.set_ylabel("certified bound, same units")
        ax.grid(alpha=0.3)
        written.append(_save(fig, out / "error_certified_vs_measured.png"))
    return written
