"""Throughput, energy per token and tokens per dollar of one configuration.

Energy: each device draws its idle power for the whole step plus (active - idle) while busy
(``StepResult.gpu_busy_s`` / ``mem_busy_s``). Cost: Table 3's hardware + operating $/h per device.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.tools.simulator.config import SCHEMES, SystemConfig, format_context
from tandem.tools.simulator.hardware import CXL_MEM
from tandem.tools.simulator.schemes import PHASES, StepResult, decode_step


@dataclass(frozen=True)
class SimResult:
    """A simulated configuration.

    Example:
        >>> r = simulate(SystemConfig.build("llama-3.1-8b", "128k", gpus=1, pnm=8, scheme="pnm"))
        >>> r.step.batch
        240
    """

    config: SystemConfig
    step: StepResult

    @property
    def feasible(self) -> bool:
        return self.step.feasible

    @property
    def mem_device(self):
        return CXL_MEM if self.config.scheme == "baseline" else self.config.memory

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole batch (0 when nothing fits)."""
        return self.step.batch / self.step.step_s if self.feasible else 0.0

    @property
    def tpot_s(self) -> float:
        """Seconds per output token of one request (= step time)."""
        return self.step.step_s if self.feasible else float("inf")

    @property
    def energy_per_step_j(self) -> float:
        """Joules per decode step over all GPUs and memory devices."""
        s, g, d = self.step, self.config.gpu, self.mem_device
        gpus = self.config.num_gpus * (g.idle_w * s.step_s + (g.tdp_w - g.idle_w) * s.gpu_busy_s)
        mems = s.num_mem_devices * (d.idle_w * s.step_s + (d.active_w - d.idle_w) * s.mem_busy_s)
        return gpus + mems

    @property
    def energy_per_token_j(self) -> float:
        """Joules per generated token (inf when nothing fits)."""
        return self.energy_per_step_j / self.step.batch if self.feasible else float("inf")

    @property
    def cost_per_h(self) -> float:
        """Hardware + operating dollars per hour of the whole system (Table 3)."""
        g, d = self.config.gpu, self.mem_device
        return self.config.num_gpus * (g.hw_cost_per_h + g.op_cost_per_h) + self.step.num_mem_devices * (
            d.hw_cost_per_h + d.op_cost_per_h
        )

    @property
    def tokens_per_dollar(self) -> float:
        return self.tokens_per_s * 3600 / self.cost_per_h

    def to_dict(self) -> dict:
        """Flat JSON-ready summary (seconds, joules, dollars)."""
        c, s = self.config, self.step
        return {
            "model": c.model.name,
            "context": c.workload.context_tokens,
            "gpu": c.gpu.name,
            "num_gpus": c.num_gpus,
            "num_pnm": c.num_pnm,
            "num_mem_devices": s.num_mem_devices,
            "scheme": c.scheme,
            "feasible": s.feasible,
            "reason": s.reason,
            "batch": s.batch,
            "batch_limit": s.batch_limit,
            "step_s": s.step_s if s.feasible else None,
            "tokens_per_s": self.tokens_per_s,
            "phases_s": dict(s.phases),
            "energy_per_token_j": self.energy_per_token_j if s.feasible else None,
            "cost_per_h": self.cost_per_h,
            "tokens_per_dollar": self.tokens_per_dollar,
            "traffic_bytes": dict(s.traffic),
            "info": dict(s.info),
        }


def simulate(config: SystemConfig) -> SimResult:
    """Run the step model for one configuration."""
    return SimResult(config, decode_step(config))


def format_result(result: SimResult) -> str:
    """Human-readable report of one configuration."""
    c, s = result.config, result.step
    mem = "CXL-Mem expander" if c.scheme == "baseline" else c.memory.name
    head = (
        f"{c.model.name}, context {format_context(c.workload.context_tokens)}, {c.num_gpus}x {c.gpu.name}"
        f" + {s.num_mem_devices}x {mem}, scheme {c.scheme} ({SCHEMES[c.scheme]}),"
        f" mapping {c.workload.mapping}"
    )
    if not s.feasible:
        return f"{head}\n  does not fit: {s.reason}"
    ms = {k: v * 1e3 for k, v in s.phases.items()}
    info = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.info.items())
    lines = [
        head,
        f"  batch            {s.batch} requests (limited by {s.batch_limit})",
        f"  step time (TPOT) {s.step_s * 1e3:.2f} ms",
        f"  throughput       {result.tokens_per_s:,.1f} tokens/s",
        "  breakdown        " + " | ".join(f"{p} {ms[p]:.2f} ms" for p in PHASES),
        f"  energy           {result.energy_per_token_j:.3f} J/token",
        f"  cost             {result.cost_per_h:.3f} $/h -> {result.tokens_per_dollar:,.0f} tokens/$",
        f"  traffic/step     recall {s.traffic.get('recall', 0) / 1e9:.3f} GB,"
        f" GPU<->PNM {s.traffic.get('exchange', 0) / 1e9:.3f} GB",
        f"  details          {info}",
    ]
    return "\n".join(lines)
