"""The configurations of PNM-KV's Figures 10-14 and the paper's headline claims computed on them.

The paper plots these figures without listing every bar; the PNM counts per bar group below are our
reading of Section 4.2 (1 to 8 PNMs beside 1 GPU, "2GPU+8PNM", PNM nodes of 16 devices) and are
stated in ``docs/simulator.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.tools.simulator.config import SystemConfig, format_context, parse_context
from tandem.tools.simulator.hardware import PLATFORM, PlatformSpec
from tandem.tools.simulator.model import SimResult, simulate


@dataclass(frozen=True)
class Group:
    """One bar group: a model and context on a fixed GPU count, PNM count varied."""

    model: str
    context: str
    gpus: int
    pnm_counts: tuple[int, ...]


def _server_groups(model: str, first_gpus: int, first_context: str) -> list[Group]:
    # GPUs and context double together up to 8 GPUs (Figure 10); PNMs from #GPU up to 8 per server.
    groups, gpus, context = [], first_gpus, parse_context(first_context)
    while gpus <= 8:
        counts = tuple(k * gpus for k in (1, 2, 4, 8) if k * gpus <= 8)
        groups.append(Group(model, format_context(context).lower(), gpus, counts))
        gpus, context = gpus * 2, context * 2
    return groups


# Figure 10/11: 8B from 128K on 1 GPU to 1M on 8 GPUs; 70B from 128K on 2 GPUs to 512K on 8 GPUs.
SERVER_GROUPS = _server_groups("llama-3.1-8b", 1, "128k") + _server_groups("llama-3.1-70b", 2, "128k")
# Figure 12/13(b): 405B at 1M on two DGX nodes (16 GPUs) with 1-4 PNM nodes of 16 devices.
RACK_GROUP = Group("llama-3.1-405b", "1m", 16, (16, 32, 48, 64))
# Figure 13(a) and 14: 8B at 128K, one GPU with 1-8 PNMs; GPU scaling of the baseline 1-8 GPUs.
COST_MODEL, COST_CONTEXT = "llama-3.1-8b", "128k"
COST_PNM_COUNTS = (1, 2, 4, 8)
COST_GPU_COUNTS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Scenario:
    """Assumptions a run uses: workload overrides (``Workload`` fields) and the platform."""

    workload: tuple[tuple[str, object], ...] = ()
    platform: PlatformSpec = PLATFORM
    gpu: str = "a100"

    def run(self, model: str, context: str, gpus: int, pnm: int, scheme: str) -> SimResult:
        cfg = SystemConfig.build(model, context, gpus, pnm, scheme, gpu=self.gpu, **dict(self.workload))
        return simulate(replace(cfg, platform=self.platform))


DEFAULT = Scenario()


@dataclass
class GroupResult:
    group: Group
    baseline: SimResult
    pnm: dict[int, SimResult]
    pnkv: dict[int, SimResult]


def run_group(group: Group, scenario: Scenario = DEFAULT) -> GroupResult:
    """Baseline once (CXL-Mem sized to its batch) and both PNM schemes per PNM count."""
    run = lambda scheme, n: scenario.run(group.model, group.context, group.gpus, n, scheme)
    return GroupResult(
        group,
        run("baseline", 0),
        {n: run("pnm", n) for n in group.pnm_counts},
        {n: run("pnkv", n) for n in group.pnm_counts},
    )


@dataclass(frozen=True)
class Claim:
    """A number the paper states and the model's value for the same configurations."""

    key: str
    text: str
    section: str
    paper: float
    model: float
    unit: str = "x"

    @property
    def diff_pct(self) -> float:
        return 100.0 * (self.model - self.paper) / self.paper


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _ratios(groups: list[GroupResult], top, bottom) -> list[float]:
    # Bars whose reference does not fit (zero throughput, infinite energy) have no finite ratio: skipped.
    pairs = [(top(g, n), bottom(g, n)) for g in groups for n in g.group.pnm_counts]
    return [a / b for a, b in pairs if 0 < b < float("inf") and a < float("inf")]


def evaluate_claims(scenario: Scenario = DEFAULT) -> list[Claim]:
    """Every headline claim of the paper next to the model's value (see docs/simulator.md)."""
    server = [run_group(g, scenario) for g in SERVER_GROUPS]
    rack = run_group(RACK_GROUP, scenario)
    tput = lambda r: r.tokens_per_s
    energy = lambda r: r.energy_per_token_j

    all_groups = server + [rack]
    best = max(
        _ratios(all_groups, lambda g, n: max(tput(g.pnm[n]), tput(g.pnkv[n])), lambda g, n: tput(g.baseline))
    )
    png_ratios = _ratios(server, lambda g, n: tput(g.pnkv[n]), lambda g, n: tput(g.baseline))
    png_vs_base = _mean(png_ratios)
    png_geomean = math.exp(_mean([math.log(r) for r in png_ratios]))
    png_energy = _mean(_ratios(server, lambda g, n: energy(g.baseline), lambda g, n: energy(g.pnkv[n])))
    png_vs_pnm = _mean(_ratios(server, lambda g, n: tput(g.pnkv[n]), lambda g, n: tput(g.pnm[n])))
    png_energy_vs_pnm = max(_ratios(server, lambda g, n: energy(g.pnkv[n]), lambda g, n: energy(g.pnm[n])))
    g70 = next(g for g in server if g.group.model == "llama-3.1-70b" and g.group.gpus == 2)
    e60 = energy(g70.baseline) / energy(g70.pnkv[8])

    cost = lambda gpus, pnm, scheme: (
        scenario.run(COST_MODEL, COST_CONTEXT, gpus, pnm, scheme).tokens_per_dollar
    )
    base1, base8 = cost(1, 0, "baseline"), cost(8, 0, "baseline")
    rack_tput = _mean(_ratios([rack], lambda g, n: tput(g.pnkv[n]), lambda g, n: tput(g.pnm[n])))
    rack_energy = _mean(_ratios([rack], lambda g, n: energy(g.pnkv[n]), lambda g, n: energy(g.pnm[n])))
    rack_vs_base = _mean(_ratios([rack], lambda g, n: tput(g.pnkv[n]), lambda g, n: tput(g.baseline)))
    rack_energy_base = _mean(_ratios([rack], lambda g, n: energy(g.baseline), lambda g, n: energy(g.pnkv[n])))
    return [
        Claim(
            "max_speedup", "best PNM-KV/PnG-KV throughput over baseline, all groups", "Abstract", 21.9, best
        ),
        Claim("png_tput", "PnG-KV / baseline throughput, mean of Fig. 10 bars", "4.2", 2.7, png_vs_base),
        Claim(
            "png_tput_geomean",
            "same, geometric mean (other reading of 'on average')",
            "4.2",
            2.7,
            png_geomean,
        ),
        Claim(
            "png_energy", "baseline / PnG-KV energy per token, mean of Fig. 11 bars", "4.2", 4.9, png_energy
        ),
        Claim("energy_70b", "70B 128K: 2GPU baseline / 2GPU+8PNM PnG-KV energy per token", "4.2", 60.0, e60),
        Claim(
            "tokens_per_dollar",
            "8B 128K: 1GPU+8PNM PnG-KV / 8GPU baseline tokens/$",
            "4.2, Fig. 14",
            7.3,
            cost(1, 8, "pnkv") / base8,
        ),
        Claim("png_vs_pnm", "PnG-KV / PNM-KV throughput, mean of Fig. 10 bars", "4.2", 1.283, png_vs_pnm),
        Claim(
            "png_energy_vs_pnm",
            "PnG-KV / PNM-KV energy per token, largest Fig. 11 bar",
            "4.2",
            2.2,
            png_energy_vs_pnm,
        ),
        Claim(
            "gpu_scaling_cost", "8B 128K: 8GPU / 1GPU baseline tokens/$", "4.2, Fig. 14", 0.4, base8 / base1
        ),
        Claim("batch_70b_base", "70B 128K 2GPU baseline batch", "4.2", 1, g70.baseline.step.batch, "req"),
        Claim("batch_70b_pnm", "70B 128K 2GPU+8PNM batch", "4.2", 96, g70.pnkv[8].step.batch, "req"),
        Claim(
            "rack_png_vs_pnm",
            "405B 1M rack: PnG-KV / PNM-KV throughput, mean",
            "4.2, Fig. 12",
            1.085,
            rack_tput,
        ),
        Claim(
            "rack_energy_vs_pnm",
            "405B 1M rack: PnG-KV / PNM-KV energy, mean",
            "4.2, Fig. 12",
            1.193,
            rack_energy,
        ),
        Claim(
            "rack_png_vs_base",
            "405B 1M rack: PnG-KV / baseline throughput, mean",
            "4.2, Fig. 12",
            2.6,
            rack_vs_base,
        ),
        Claim(
            "rack_energy_base",
            "405B 1M rack: baseline / PnG-KV energy, mean",
            "4.2, Fig. 12",
            11.8,
            rack_energy_base,
        ),
    ]


HEADLINE = ("max_speedup", "png_tput", "png_energy", "energy_70b", "tokens_per_dollar", "png_vs_pnm")
