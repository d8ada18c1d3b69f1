"""Results of `tandem bench`: bench.json, bench.md (machine, measured bandwidths, model, one table) and PNG plots.

`result` = {"machine": {...}, "bandwidth": {"hbm_gbps", "host_read_gbps", "pcie_h2d_gbps"}, "model": {...},
"rows": [row, ...]} plus optional "settings" (dict) and "command" (str). A row (see
`tandem.bench.baselines.empty_row`) holds at least system, batch, context, status ("ok" / "oom" / "error"),
tpot_median_ms, tpot_p90_ms, tpot_p99_ms, tpot_max_ms, tokens_per_s, gpu_peak_bytes, host_kv_bytes; Tandem rows
also cpu_bytes_per_step, pcie_bytes_per_step, cache_bytes_per_step, attended_fraction, bound_ms, tpot_over_bound,
serial_bound_ms, tpot_over_serial. Rows
that did not run stay in every output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BASELINES = (("hf-dynamic", "vs dynamic"), ("hf-offloaded", "vs offloaded"))
STATUS_TEXT = {"oom": "OOM", "error": "error"}
HEADER = (
    "| system | batch | context | TPOT ms (median) | TPOT ms (p90) | TPOT ms (p99) | TPOT ms (max) | tokens/s "
    "| GPU peak GB | host KV GB | CPU MB/step | PCIe MB/step | GPU-cache MB/step | attended | bound ms | TPOT/bound | serial bound ms "
    "| TPOT/serial | vs dynamic | vs offloaded |"
)


def _fmt(value, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return "" if value is None else f"{value / scale:{spec}}{suffix}"


def _fmt_context(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def _ratio(row: dict, index: dict, baseline: str) -> str:
    if row["system"] == baseline:
        return ""
    base = index.get((baseline, row["batch"], row["context"]))
    if base is None:
        return "-"
    if base.get("status") != "ok":
        return STATUS_TEXT.get(base.get("status"), "-")
    if row.get("status") != "ok" or not row.get("tpot_median_ms") or not base.get("tpot_median_ms"):
        return ""
    return f"{row['tpot_median_ms'] / base['tpot_median_ms']:.2f}x"


def format_table(rows: list[dict]) -> str:
    """Markdown table of the rows in their order; rows that did not run show "OOM" / "error" and blanks.
    "vs dynamic" / "vs offloaded" = TPOT / the HF baseline's TPOT at the same batch and context."""
    index = {(r["system"], r["batch"], r["context"]): r for r in rows}
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        head = f"| {r['system']} | {r['batch']} | {_fmt_context(r['context'])} |"
        ratios = " | ".join(_ratio(r, index, base) for base, _ in BASELINES)
        status = r.get("status", "ok")
        if status != "ok":
            blanks = " |" * 14  # the cells after TPOT (median), up to TPOT/serial
            lines.append(f"{head} {STATUS_TEXT.get(status, status)} |{blanks} {ratios} |")
            continue
        cells = [
            _fmt(r.get("tpot_median_ms"), ".2f"),
            _fmt(r.get("tpot_p90_ms"), ".2f"),
            _fmt(r.get("tpot_p99_ms"), ".2f"),
            _fmt(r.get("tpot_max_ms"), ".2f"),
            _fmt(r.get("tokens_per_s"), ".1f"),
            _fmt(r.get("gpu_peak_bytes"), ".1f", 1e9),
            _fmt(r.get("host_kv_bytes"), ".1f", 1e9),
            _fmt(r.get("cpu_bytes_per_step"), ".1f", 1e6),
            _fmt(r.get("pcie_bytes_per_step") or None, ".1f", 1e6),
            _fmt(r.get("cache_bytes_per_step") or None, ".1f", 1e6),
            _fmt(r.get("attended_fraction"), ".1f", 0.01, "%"),
            _fmt(r.get("bound_ms"), ".2f"),
            _fmt(r.get("tpot_over_bound"), ".2f", 1.0, "x"),
            _fmt(r.get("serial_bound_ms"), ".2f"),
            _fmt(r.get("tpot_over_serial"), ".2f", 1.0, "x"),
        ]
        lines.append(f"{head} {' | '.join(cells)} | {ratios} |")
    return "\n".join(lines)


def _machine_lines(result: dict) -> list[str]:
    m = result.get("machine", {})
    bw = result.get("bandwidth", {})
    gpu = m.get("gpu") or "none"
    if m.get("gpu_memory_gb"):
        gpu += f" ({m['gpu_memory_gb']} GB)"
    if m.get("gpu") and m.get("cuda"):
        gpu += f", CUDA {m['cuda']}"
    cpu = [f"{m['cores']} cores" if m.get("cores") else None]
    cpu.append(f"{m['threads']} threads for the CPU tier" if m.get("threads") else None)
    cpu.append(f"ISA `{m['isa']}`" if m.get("isa") else None)
    cpu_text = f"{m.get('cpu_model', '?')} ({', '.join(c for c in cpu if c)})"
    if m.get("memory_gb"):
        cpu_text += f", {m['memory_gb']} GB memory"
    bandwidths = ", ".join(
        f"{label} **{bw[key]:.1f} GB/s**" if bw.get(key) is not None else f"{label} not measured"
        for key, label in (
            ("hbm_gbps", "HBM read"),
            ("host_read_gbps", "host read"),
            ("pcie_h2d_gbps", "PCIe H2D (pinned)"),
        )
    )
    return [
        f"- Machine: host `{m.get('hostname', '?')}`; GPU: {gpu}; CPU: {cpu_text}.",
        f"- Software: torch {m.get('torch', '?')}, transformers {m.get('transformers', '?')}.",
        f"- Bandwidths measured in this run: {bandwidths}.",
    ]


def markdown(result: dict) -> str:
    """bench.md's text: header (machine, GPU, CPU, bandwidths, model shape), the table, then notes."""
    model = result.get("model", {})
    name = model.get("name", "model")
    gpu = result.get("machine", {}).get("gpu") or "CPU"
    rows = result.get("rows", [])
    out = [
        f"# tandem bench: {name} on {gpu}",
        "",
        *_machine_lines(result),
        "- Model: " + ", ".join(f"{k} {v}" for k, v in model.items()) + ".",
    ]
    if (model.get("gpus") or 1) > 1:
        out.append(
            f"- Tensor-parallel over {model['gpus']} GPUs: the machine line, the bandwidths and every row's bytes "
            "and GPU peak are one rank's (rank 0's; the ranks measured the host together, each on its own cores); "
            "weight_bytes is one GPU's."
        )
    if result.get("settings"):
        out.append("- Settings: " + ", ".join(f"{k} {v}" for k, v in result["settings"].items()) + ".")
    for label, replay in (result.get("fluxion_replay") or {}).items():
        out.append(
            f"- `{label}` on random weights replays the static per-head budgets calibrated on {replay['source']} "
            f"(tau {replay['tau']:g}: {100 * replay['streaming_share']:.0f}% streaming heads, mean budget "
            f"{100 * replay['mean_budget16']:.1f}% of the host tier at 16-token blocks), mapped onto this shape; "
            "no predictor runs."
        )
    out += [
        "",
        "TPOT = time per output token (one decode step of the whole batch); tokens/s = batch / median TPOT. "
        "bound = max(weight bytes / HBM bandwidth, CPU-tier bytes per step / host read bandwidth, host-tier "
        "bytes the GPU read itself per step (PCIe MB, a quest gpu_share) / PCIe bandwidth), all bandwidths "
        "from this run; GPU-cache MB = host-tier blocks attended from quest's recall cache in GPU memory "
        "(gpu_cache); TPOT/bound >= 1, nearer 1 is better. serial bound = the same with the layers in "
        "sequence, as one batch decodes (a layer's host reads wait for its query, so weights and host reads add "
        "up): weight bytes / HBM + max(CPU bytes / host read, PCIe bytes / PCIe, (CPU + PCIe bytes) / host read, "
        "since both readers share host memory). vs dynamic / vs offloaded = TPOT / "
        "the HF baseline's TPOT at the same batch and context (below 1 = faster); OOM there = the baseline "
        "did not fit. GB = 1e9 bytes; GPU peak includes the weights.",
        "",
        format_table(rows),
    ]
    notes = [
        f"- {r['system']} batch {r['batch']} context {_fmt_context(r['context'])}: {text}"
        for r in rows
        for text in (r.get("error"), r.get("note"))
        if text
    ]
    if notes:
        out += ["", "Notes:", "", *notes]
    if result.get("command"):
        out += ["", "```", result["command"], "```"]
    return "\n".join(out) + "\n"


def write_report(result: dict, out_dir: Path) -> list[Path]:
    """Write bench.json, bench.md and, with matplotlib installed, tpot_vs_context.png and
    throughput_vs_batch.png into `out_dir`; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "bench.json", out / "bench.md"
    json_path.write_text(_dumps(result) + "\n", encoding="utf-8")
    md_path.write_text(markdown(result), encoding="utf-8")
    return [json_path, md_path, *write_plots(result.get("rows", []), out)]


def _dumps(result: dict) -> str:
    """Indented JSON with each list of numbers (per-step times, tokens) on one line."""
    text = json.dumps(result, indent=2, default=_jsonable)
    return _NUMBERS.sub(lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)


_NUMBERS = re.compile(r"\[\s*((?:-?[0-9.eE+-]+,?\s*)+)\]")


def _jsonable(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)  # e.g. a torch.dtype or a Path


def write_plots(rows: list[dict], out: Path) -> list[Path]:
    """tpot_vs_context.png (smallest batch; a line per system, log y; OOM marked with x at the top) and
    throughput_vs_batch.png (a panel per context; a line per system). [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tandem bench: matplotlib is not installed; no PNG plots (pip install matplotlib)")
        return []
    if not any(r.get("status") == "ok" for r in rows):
        return []  # nothing measured (every row out of memory): no line to draw, and no log axis of nothing
    systems = list(dict.fromkeys(r["system"] for r in rows))
    palette = plt.get_cmap("tab10")
    styles = {s: {"color": palette(i % 10), "marker": "osD^v<>ph*"[i % 10]} for i, s in enumerate(systems)}
    written = []

    batch = min(r["batch"] for r in rows)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    _lines(ax, [r for r in rows if r["batch"] == batch], systems, styles, "context", "tpot_median_ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    _ticks(ax, sorted({r["context"] for r in rows if r["batch"] == batch}), _fmt_context)
    ax.set_xlabel("context (tokens per request)")
    ax.set_ylabel("TPOT, median (ms)")
    ax.set_title(f"time per output token, batch {batch}")
    written.append(_save(fig, plt, out / "tpot_vs_context.png"))

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.8), squeeze=False)
    for ax, context in zip(axes.flat, contexts):
        _lines(ax, [r for r in rows if r["context"] == context], systems, styles, "batch", "tokens_per_s")
        ax.set_xscale("log", base=2)
        _ticks(ax, sorted({r["batch"] for r in rows if r["context"] == context}), str)
        ax.set_xlabel("batch")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"context {_fmt_context(context)}")
    written.append(_save(fig, plt, out / "throughput_vs_batch.png"))
    return written


def _lines(ax, rows, systems, styles, x_key: str, y_key: str) -> None:
    for system in systems:
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r[x_key])
        ok = [(r[x_key], r[y_key]) for r in mine if r.get("status") == "ok" and r.get(y_key)]
        if ok:
            ax.plot(*zip(*ok), label=system, alpha=0.85, **styles[system])
        failed = [r[x_key] for r in mine if r.get("status") != "ok"]
        if failed:  # drawn at the top edge, so a configuration that did not fit stays visible
            ax.scatter(
                failed,
                [1.0] * len(failed),
                transform=ax.get_xaxis_transform(),
                marker="x",
                color=styles[system]["color"],
                clip_on=False,
                label=f"{system}: OOM / error",
            )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _ticks(ax, values, label) -> None:
    ax.set_xticks(values, [label(v) for v in values])
    ax.set_xticks([], minor=True)


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
