"""One validated configuration of the simulated system: hardware counts, scheme and workload.

CLI parsing stays at the edge (``cli.py``); everything below raises ValueError naming the argument.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tandem.tools.simulator.hardware import (
    PLATFORM,
    PNM,
    GpuSpec,
    MemoryDeviceSpec,
    ModelSpec,
    PlatformSpec,
    get_gpu,
    get_model,
)

# CLI spelling -> the paper's name (Section 3, Figure 6).
SCHEMES: dict[str, str] = {"baseline": "GPU-CXL-Mem", "pnm": "PNM-KV", "pnkv": "PnG-KV"}
MAPPINGS = ("dp", "tp")

_CONTEXT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_context(text: str | int) -> int:
    """Parse a context length: ``128k`` -> 131072, ``1m`` -> 1048576, ``4096`` -> 4096 (tokens).

    k and m are binary (1024 and 1024**2), as context windows are quoted (Llama-3.1 "128K" = 131072).
    """
    if isinstance(text, int):
        value = text
    else:
        match = _CONTEXT_RE.match(str(text))
        if not match:
            raise ValueError(f"--context: cannot parse {text!r}; use e.g. 128k, 512k, 1m or a plain integer")
        number, suffix = float(match.group(1)), match.group(2).lower()
        value = int(number * {"": 1, "k": 1024, "m": 1024**2}[suffix])
    if value <= 0:
        raise ValueError(f"--context: must be positive, got {text!r}")
    return value


def format_context(tokens: int) -> str:
    """Inverse of parse_context for round values: 131072 -> '128K', 1048576 -> '1M'."""
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}M"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}K"
    return str(tokens)


def check_scheme(name: str) -> str:
    """Return the scheme key or raise ValueError naming the allowed spellings."""
    if name not in SCHEMES:
        allowed = ", ".join(f"{k} ({v})" for k, v in SCHEMES.items())
        raise ValueError(f"--scheme: unknown scheme {name!r}; allowed: {allowed}")
    return name


@dataclass(frozen=True)
class Workload:
    """What one decode step does per request (values the paper leaves out are assumptions, see docs).

    context_tokens: tokens in each request's KV cache.
    budget_fraction: T_Budget / context, tokens attended per step after page selection.
    page_size: tokens per page; each page has a min/max key digest.
    recall_rate: tokens an ArkVale-style GPU cache recalls per step, as a fraction of the context
        (0.01 reproduces the ~5 MB per layer recall of Section 2.3 for 8B at 128K).
    steady_churn: fraction of the GPU-resident steady set replaced per step (PnG-KV, Algorithm 1).
    steady_ratio: fraction of T_Budget served on the GPU; None = #GPU / (#GPU + #PNM) (Section 4.1).
    max_batch: optional cap on the batch a scheme may hold (None = as many as memory allows).
    mapping: how attention maps onto PNM devices: "dp" (per request, Section 3.2) or "tp" (per head).
    hot_tokens: Tandem's layout instead of steady selection: this many tokens (sinks + recent window)
        always on the GPU, and ``budget_fraction`` applies to the rest only (used by calibrate.py).
    device_share: with ``hot_tokens``, Tandem's `gpu_share`: this fraction of each step's selected tokens is read
        by the GPU itself over the link, in place, while the memory side attends the rest (0: all by the latter).
    gpu_selection: with ``hot_tokens``, the page digests are mirrored in GPU memory and scored there (Tandem's
        quest on CUDA): the selection reads HBM instead of the memory tier.
    recall_hit: with ``hot_tokens``, the fraction of each step's selected tokens found in Tandem's recall cache
        (`gpu_cache`) and attended from HBM; ``device_share`` then splits the rest.
    """

    context_tokens: int
    budget_fraction: float = 0.25
    page_size: int = 16
    recall_rate: float = 0.005
    steady_churn: float = 0.01
    steady_ratio: float | None = None
    max_batch: int | None = None
    mapping: str = "dp"
    hot_tokens: int | None = None
    device_share: float = 0.0
    gpu_selection: bool = False
    recall_hit: float = 0.0

    def __post_init__(self) -> None:
        if self.context_tokens <= 0:
            raise ValueError(f"--context: must be positive, got {self.context_tokens}")
        if not 0.0 < self.budget_fraction <= 1.0:
            raise ValueError(f"--budget: must be in (0, 1], got {self.budget_fraction}")
        if self.page_size <= 0:
            raise ValueError(f"--page-size: must be positive, got {self.page_size}")
        if not 0.0 <= self.recall_rate <= 1.0:
            raise ValueError(f"--recall-rate: must be in [0, 1], got {self.recall_rate}")
        if not 0.0 <= self.steady_churn <= 1.0:
            raise ValueError(f"--steady-churn: must be in [0, 1], got {self.steady_churn}")
        if self.steady_ratio is not None and not 0.0 <= self.steady_ratio < 1.0:
            raise ValueError(f"--steady-ratio: must be in [0, 1), got {self.steady_ratio}")
        if self.max_batch is not None and self.max_batch <= 0:
            raise ValueError(f"--batch: must be positive, got {self.max_batch}")
        if self.hot_tokens is not None and not 0 <= self.hot_tokens <= self.context_tokens:
            raise ValueError(f"--hot-tokens: must be in [0, context], got {self.hot_tokens}")
        if not 0.0 <= self.device_share <= 1.0:
            raise ValueError(f"--device-share: must be in [0, 1], got {self.device_share}")
        if not 0.0 <= self.recall_hit <= 1.0:
            raise ValueError(f"--recall-hit: must be in [0, 1], got {self.recall_hit}")
        if self.mapping not in MAPPINGS:
            raise ValueError(f"--mapping: unknown mapping {self.mapping!r}; allowed: {', '.join(MAPPINGS)}")

    @property
    def budget_tokens(self) -> int:
        """T_Budget (tokens attended per step) rounded up to whole pages and at most the context."""
        hot = self.hot_tokens or 0
        pages = -(-int(self.budget_fraction * (self.context_tokens - hot)) // self.page_size)
        return min(hot + max(pages, 1) * self.page_size, self.context_tokens)


@dataclass(frozen=True)
class SystemConfig:
    """A system to simulate: ``num_gpus`` GPUs with TP for FC plus ``num_pnm`` CXL devices.

    For ``baseline`` the CXL devices are plain memory expanders; ``num_pnm=0`` sizes them automatically
    (fewest devices holding the batch's KV cache). ``memory`` is the device playing the PNM role: the
    paper's CXL-PNM, or host DRAM + CPU cores when calibrating against a real host (calibrate.py).

    Example:
        >>> cfg = SystemConfig.build("llama-3.1-70b", "512k", gpus=2, pnm=8, scheme="pnkv")
        >>> cfg.workload.context_tokens
        524288
    """

    model: ModelSpec
    gpu: GpuSpec
    num_gpus: int
    num_pnm: int
    scheme: str
    workload: Workload
    platform: PlatformSpec = field(default=PLATFORM)
    memory: MemoryDeviceSpec = field(default=PNM)

    def __post_init__(self) -> None:
        check_scheme(self.scheme)
        if self.num_gpus < 1:
            raise ValueError(f"--gpus: must be at least 1, got {self.num_gpus}")
        if self.num_pnm < 0:
            raise ValueError(f"--pnm: must be 0 or more, got {self.num_pnm}")
        if self.scheme in ("pnm", "pnkv") and self.num_pnm < 1:
            raise ValueError(f"--pnm: scheme {self.scheme!r} needs at least 1 PNM device, got {self.num_pnm}")

    @classmethod
    def build(
        cls,
        model: str,
        context: str | int,
        gpus: int = 1,
        pnm: int = 0,
        scheme: str = "pnkv",
        gpu: str = "a100",
        **workload: object,
    ) -> SystemConfig:
        """Build from names and plain values (what the CLI and the sweep pass)."""
        load = Workload(context_tokens=parse_context(context), **workload)  # type: ignore[arg-type]
        return cls(get_model(model), get_gpu(gpu), gpus, pnm, check_scheme(scheme), load)

    @property
    def num_servers(self) -> int:
        """Servers (each with its own host link to a CXL switch) the GPUs occupy."""
        return -(-self.num_gpus // self.platform.gpus_per_server)
