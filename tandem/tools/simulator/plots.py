"""PNG versions of PNM-KV's Figures 10-14 from ``sweep.collect`` output; matplotlib imported lazily."""

from __future__ import annotations

from pathlib import Path

from tandem.tools.simulator.claims import GroupResult
from tandem.tools.simulator.config import format_context, parse_context
from tandem.tools.simulator.schemes import PHASES

COLORS = {"baseline": "#8c8c8c", "pnm": "#1f77b4", "pnkv": "#ff7f0e"}
LABELS = {"baseline": "GPU-CXL-Mem (baseline)", "pnm": "PNM-KV", "pnkv": "PnG-KV"}
COST_TICKS = (1, 2, 4, 8)
PHASE_COLORS = {"fc": "#4c72b0", "attention": "#dd8452", "recall": "#c44e52", "communication": "#55a868"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def _group_bars(ax, groups: list[GroupResult], metric, ylabel: str, log: bool = True) -> None:
    """Per group: one baseline bar, then PNM-KV / PnG-KV pairs for each PNM count."""
    x, ticks, labels = 0.0, [], []
    seen: set[str] = set()

    def bar(pos: float, scheme: str, value: float) -> None:
        label = LABELS[scheme] if scheme not in seen else None
        seen.add(scheme)
        ax.bar(pos, value, width=0.4, color=COLORS[scheme], label=label)

    for g in groups:
        bar(x, "baseline", metric(g.baseline))
        ticks.append(x)
        labels.append(f"{g.group.gpus}G {format_context(parse_context(g.group.context))}\nbase")
        x += 0.8
        for n in g.group.pnm_counts:
            bar(x - 0.2, "pnm", metric(g.pnm[n]))
            bar(x + 0.2, "pnkv", metric(g.pnkv[n]))
            ticks.append(x)
            labels.append(f"+{n}P")
            x += 1.0
        x += 0.6
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return path


def _server_figure(plt, server: list[GroupResult], metric, ylabel: str, title: str, path: Path) -> Path:
    fig, axes = plt.subplots(2, 1, figsize=(11, 6.5))
    for ax, model in zip(axes, ("llama-3.1-8b", "llama-3.1-70b"), strict=True):
        _group_bars(ax, [g for g in server if g.group.model == model], metric, ylabel)
        ax.set_title(f"{title}: {model}", fontsize=10)
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def _breakdown(ax, results: list[tuple[str, object]], title: str) -> None:
    """Stacked per-token latency (step time / batch) by phase."""
    bottoms = [0.0] * len(results)
    for phase in PHASES:
        values = [r.step.phases.get(phase, 0.0) / max(r.step.batch, 1) * 1e3 for _, r in results]
        ax.bar(range(len(results)), values, bottom=bottoms, color=PHASE_COLORS[phase], label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_xticks(range(len(results)), [name for name, _ in results], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("ms per generated token")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def plot_all(data: dict, out: Path) -> list[Path]:
    """Write fig10-fig14 PNGs into ``out``; return their paths."""
    plt = _pyplot()
    server, rack, cost = data["server"], data["rack"], data["cost"]
    tput = lambda r: r.tokens_per_s
    energy = lambda r: r.energy_per_token_j if r.feasible else float("nan")
    paths = [
        _server_figure(plt, server, tput, "tokens/s", "Fig. 10 throughput", out / "fig10_throughput.png"),
        _server_figure(plt, server, energy, "J/token", "Fig. 11 energy per token", out / "fig11_energy.png"),
    ]

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    _group_bars(axes[0], [rack], tput, "tokens/s", log=False)
    _group_bars(axes[1], [rack], energy, "J/token", log=False)
    axes[0].set_title("Fig. 12(a) 405B, 1M, 2 GPU nodes + 1-4 PNM nodes", fontsize=10)
    axes[1].set_title("Fig. 12(b) energy per token", fontsize=10)
    axes[0].legend(fontsize=8)
    paths.append(_save(fig, out / "fig12_rack.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    cost_base = cost["gpu_scaling"][1]
    small = [("baseline", cost_base)]
    small += [(f"{s} +{n}P", cost[s][n]) for n in cost["pnm"] for s in ("pnm", "pnkv")]
    large = [("baseline", rack.baseline)]
    large += [(f"{s} +{n}P", getattr(rack, s)[n]) for n in rack.group.pnm_counts for s in ("pnm", "pnkv")]
    _breakdown(axes[0], small, "Fig. 13(a) 8B, 128K, 1 GPU")
    _breakdown(axes[1], large, "Fig. 13(b) 405B, 1M, 16 GPUs")
    axes[0].legend(fontsize=8)
    paths.append(_save(fig, out / "fig13_breakdown.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4))
    ref = cost_base.tokens_per_dollar
    for series, label, color in (
        ("gpu_scaling", "GPU scaling (baseline), x = #GPU", COLORS["baseline"]),
        ("pnm", "1 GPU + PNM-KV, x = #PNM", COLORS["pnm"]),
        ("pnkv", "1 GPU + PnG-KV, x = #PNM", COLORS["pnkv"]),
    ):
        counts = sorted(cost[series])
        ax.plot(
            counts, [cost[series][n].tokens_per_dollar / ref for n in counts], "o-", color=color, label=label
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(COST_TICKS), [str(n) for n in COST_TICKS])
    ax.set_xlabel("devices")
    ax.set_ylabel("tokens per $ (vs 1 GPU baseline)")
    ax.set_title("Fig. 14 cost efficiency, 8B, 128K", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "fig14_cost.png"))
    plt.close("all")
    return paths
