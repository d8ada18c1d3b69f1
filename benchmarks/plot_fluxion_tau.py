"""Fluxion's tau curve from a merged `tandem eval` results.json: accuracy and host entries attended against tau.

Reads the cells of `fluxion` (tau 0.1, the default) and `fluxion[tau=...]` variants and of `full`. On the
generation tasks that every tau variant ran, it writes tau_curve.json, tau_curve.md and tau_curve.png: mean
score, mean delta to full, worst delta, the mean share of host entries attended and of streaming heads.

    python benchmarks/plot_fluxion_tau.py results/results.json --out results/
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

GENERATION = ("niah", "multikey", "multivalue", "vt", "cwe")


def tau_of(label: str, default: float = 0.1) -> float | None:
    """The tau of a plain fluxion variant (no other setting changed), else None."""
    if label == "fluxion":
        return default
    match = re.fullmatch(r"fluxion\[tau=([0-9.]+)\]", label)
    return float(match.group(1)) if match else None


def curve(result: dict) -> list[dict]:
    cells = [c for c in result["cells"] if c["task"] in GENERATION]
    by_tau: dict[float, list[dict]] = {}
    for c in cells:
        tau = tau_of(c["policy"])
        if tau is not None:
            by_tau.setdefault(tau, []).append(c)
    shared = set.intersection(*({(c["task"], c["length"]) for c in cs} for cs in by_tau.values()))
    full = {(c["task"], c["length"]): c["score"] for c in cells if c["policy"] == "full"}
    shared &= set(full)
    rows = []
    for tau, cs in sorted(by_tau.items()):
        cs = [c for c in cs if (c["task"], c["length"]) in shared]
        deltas = [c["score"] - full[(c["task"], c["length"])] for c in cs]
        rows.append({
            "tau": tau,
            "cells": len(cs),
            "mean_score": sum(c["score"] for c in cs) / len(cs),
            "mean_delta": sum(deltas) / len(deltas),
            "worst_delta": min(deltas),
            "mean_attended": sum(c["fraction_attended"] for c in cs) / len(cs),
            "max_attended": max(c["fraction_attended"] for c in cs),
            "mean_streaming": sum(c.get("streaming_head_share") or 0.0 for c in cs) / len(cs),
        })  # fmt: skip
    full_mean = sum(full[k] for k in shared) / len(shared)
    return rows, sorted(shared), full_mean


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = json.loads(Path(args.results).read_text())
    rows, shared, full_mean = curve(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tau_curve.json").write_text(
        json.dumps({"cells": shared, "full_mean": full_mean, "rows": rows}, indent=1)
    )
    lines = [
        f"Cells: {', '.join(f'{t} {n // 1024}K' for t, n in shared)}; full attention's mean score {full_mean:.1f}.",
        "",
        "| tau | mean score | mean Δ | worst Δ | host entries attended, mean / max | streaming heads |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tau']:g} | {r['mean_score']:.1f} | {r['mean_delta']:+.1f} | {r['worst_delta']:+.0f} | "
            f"{100 * r['mean_attended']:.1f}% / {100 * r['max_attended']:.1f}% | {100 * r['mean_streaming']:.0f}% |"
        )
    (out / "tau_curve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    fig, ax = plt.subplots(figsize=(6, 4))
    taus = [r["tau"] for r in rows]
    ax.plot(taus, [r["mean_score"] for r in rows], "o-", label="fluxion mean score")
    ax.axhline(full_mean, color="gray", ls="--", label="full attention")
    ax.set_xscale("log")
    ax.set_xlabel("tau (Eq. 2 threshold)")
    ax.set_ylabel("mean score (0-100)")
    ax2 = ax.twinx()
    ax2.plot(
        taus, [100 * r["mean_attended"] for r in rows], "s-", color="tab:red", label="host entries attended %"
    )
    ax2.set_ylabel("host entries attended (%)", color="tab:red")
    fig.legend(loc="lower left", fontsize=8)
    ax.set_title("fluxion on SmolLM2-135M: accuracy and reads against tau")
    fig.tight_layout()
    fig.savefig(out / "tau_curve.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
