"""The host-step model: Tandem's decode step on a GPU host (memory tier = host DRAM + CPU cores).

One model, used by every host table of `tandem simulate`. A decode step of `batch` requests on `gpus`
tensor-parallel ranks takes, per rank (all times seconds):

    step = floor + selection + layers x hand-off + layers x max(cpu, pcie, both) + recall cache

- floor: the forward without host attention: weights / HBM + layers x forward_layer_us (the layers' other kernels,
  launches and idle gaps, measured per layer so that it carries over to other depths) + the hot set's attention;
- selection (quest): the page digests scored from HBM + layers x selection_layer_us (bounds, top-k, recall plan);
- hand-off: a layer's round trip to the host and back (layer_sync_us), paid by every layer with a CPU part: a
  layer's query needs the previous layer's output, so the host's work adds to the step instead of hiding under it;
- per layer, the CPU part (one compiled call over the batch's selected rows: fixed + bytes / rate at the host
  tier's row format, thread count and selection kind, from the CPU-kernel benchmark), the GPU's in-place reads of
  its device share over PCIe, and both from host memory, whose read bandwidth they share; the slowest sets the
  layer;
- recall cache: the selected rows the recall cache held, attended from HBM.

`streaming` attends no host rows: its step is the floor (no hand-off, no selection). The selected rows follow the
engine's layout: a hot set (sinks + window) on the GPU, `sparsity` of the rest in whole pages, of which the recall
cache serves `recall_hit` (measured per run: it depends on the model and the prompt, not the host), the GPU reads
`device_share` of the rest over the link, and the CPU attends what remains.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.tools.simulator.hardware import GIB, ModelSpec

# bytes per stored element of each host row format (the 8-bit formats' per-block scales are not counted: the rates
# are measured per code byte, `benchmarks/bench_cpu_attention.py`'s `kv_gbps`)
ROW_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "fp8": 1}
# the committed CPU-kernel benchmark of the GPU host's CPU (16-core Xeon of the lent H100 / H200 VMs)
DEFAULT_RATES = (
    Path(__file__).resolve().parents[3]
    / "benchmarks/results/2026-11-29_xeon16_cpu_attention_formats/cpu_attention_h200host-formats.json"
)


@dataclass(frozen=True)
class CallRate:
    """Seconds of one CPU attention call over `n` bytes of K+V rows: fixed_s + n / bytes_per_s."""

    fixed_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.fixed_s + num_bytes / self.bytes_per_s if num_bytes > 0 else 0.0


class CpuRates:
    """CPU attention rates per (row format, thread count, selection kind), read from a `bench_cpu_attention.py` JSON.

    For each (format, threads, selection) the benchmark's attention rows (prepared calls: the kernel as the decode
    path calls it) are fitted by least squares as time = fixed + bytes / rate over their shapes, so a call of
    another size is priced by the same line. A file from before per-format rows counts as its `dtype` at its
    machine's thread count.

    Example:
        >>> rates = CpuRates.load()
        >>> rates.rate("int8", 15, "block16").bytes_per_s > 1e9
        True
    """

    def __init__(self, rows: list[dict], source: str = "") -> None:
        points: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
        for r in rows:
            seconds = (r.get("prepared_ms") or r["ms"]) / 1e3
            num_bytes = r["kv_gbps"] * 1e9 * seconds if r.get("kv_gbps") else r["mbytes"] * 1e6
            points.setdefault((r["row_format"], r["threads"], r["selection"]), []).append(
                (num_bytes, seconds)
            )
        if not points:
            raise ValueError(f"--cpu-rates: {source or 'the file'} has no attention rows")
        self.source = source
        self.fits = {key: _fit(pts) for key, pts in points.items()}

    @classmethod
    def load(cls, path: str | Path | None = None) -> CpuRates:
        """The rates of a `bench_cpu_attention.py` JSON (default: the committed run on the GPU host's CPU)."""
        file = Path(path) if path else DEFAULT_RATES
        if not file.is_file():
            raise ValueError(f"--cpu-rates: file not found: {file}")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--cpu-rates: {file} is not valid JSON ({err})") from err
        threads = (data.get("machine") or {}).get("threads")
        rows = [
            {"row_format": data.get("dtype", "bfloat16"), "threads": threads, **r}
            for r in data.get("rows", [])
            if r.get("kernel") == "attention"
        ]
        return cls(rows, str(file))

    def rate(self, row_format: str, threads: int, selection: str) -> CallRate:
        """The fit for this row format at the measured thread count nearest `threads` and the selection kind
        nearest `selection` ("token" or "block<N>")."""
        keys = [k for k in self.fits if k[0] == row_format]
        if not keys:
            have = sorted({k[0] for k in self.fits})
            raise ValueError(
                f"--cpu-rates: {self.source} has no {row_format} rows (it has {', '.join(have)})"
            )
        want = _block_of(selection)
        key = min(keys, key=lambda k: (abs(k[1] - threads), abs(math.log(_block_of(k[2]) / want))))
        return self.fits[key]


def _block_of(selection: str) -> int:
    return 1 if selection == "token" else int(selection.removeprefix("block"))


def _fit(points: list[tuple[float, float]]) -> CallRate:
    """Least-squares line time = fixed + bytes / rate (fixed >= 0); one point gives a rate through the origin."""
    if len(points) == 1 or len({b for b, _ in points}) == 1:
        num_bytes = sum(b for b, _ in points)
        return CallRate(0.0, num_bytes / sum(s for _, s in points))
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    slope = sum((b - mean_b) * (s - mean_s) for b, s in points) / sum((b - mean_b) ** 2 for b, _ in points)
    fixed = mean_s - slope * mean_b
    if fixed < 0 or slope <= 0:
        return CallRate(0.0, sum(b for b, _ in points) / sum(s for _, s in points))
    return CallRate(fixed, 1 / slope)


@dataclass(frozen=True)
class HostStep:
    """One predicted decode step on a host, per rank: the terms (seconds) and the bytes behind them.

    step_s = floor_s + selection_s + sync_s + host_s + cache_s, with host_s = max(cpu_s, pcie_s, shared_read_s).
    """

    floor_s: float
    selection_s: float
    sync_s: float
    cpu_s: float
    pcie_s: float
    shared_read_s: float
    cache_s: float
    cpu_bytes: float
    pcie_bytes: float
    cache_bytes: float
    fits: bool
    max_batch: int

    @property
    def host_s(self) -> float:
        return max(self.cpu_s, self.pcie_s, self.shared_read_s)

    @property
    def step_s(self) -> float:
        return self.floor_s + self.selection_s + self.sync_s + self.host_s + self.cache_s

    def terms_ms(self) -> dict[str, float]:
        """Every term in milliseconds, and the step (`step`), for reports."""
        names = ("floor", "selection", "sync", "cpu", "pcie", "shared_read", "host", "cache", "step")
        return {name: getattr(self, f"{name}_s") * 1e3 for name in names}

    def to_dict(self) -> dict:
        return {**asdict(self), "host_s": self.host_s, "step_s": self.step_s}


@dataclass(frozen=True)
class StepSetup:
    """What one row runs: the policy and the engine's layout (defaults: TandemConfig's quest on CUDA).

    policy: "quest" (page selection, host attention) or "streaming" (hot set only, no host reads).
    row_format: the host tier's rows: the model dtype ("bfloat16") or "int8" / "fp8" (`TandemConfig.host.dtype`).
    host_split: how tensor-parallel ranks divide the host tier: "heads" (each rank its heads of every request) or
    "requests" (each rank whole requests with all heads; the busiest holds ceil(batch / gpus); no device share).
    """

    policy: str = "quest"
    row_format: str = "bfloat16"
    sparsity: float = 0.05
    hot_tokens: int = 320
    page_size: int = 16
    device_share: float = 0.4
    recall_hit: float = 0.0
    gpus: int = 1
    host_split: str = "heads"

    def __post_init__(self) -> None:
        if self.policy not in ("quest", "streaming"):
            raise ValueError(f"policy: the host model prices quest and streaming, got {self.policy!r}")
        if self.row_format not in ROW_BYTES:
            raise ValueError(f"row format: one of {', '.join(ROW_BYTES)}, got {self.row_format!r}")
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"--sparsity: must be in (0, 1], got {self.sparsity}")
        if self.hot_tokens < 0 or self.page_size < 1 or self.gpus < 1:
            raise ValueError("--hot-tokens must be 0 or more, --page-size and --gpus at least 1")
        if not (0 <= self.device_share <= 1 and 0 <= self.recall_hit <= 1):
            raise ValueError("device share and recall hit: must be in [0, 1]")
        if self.host_split not in ("heads", "requests"):
            raise ValueError(f"host split: 'heads' or 'requests', got {self.host_split!r}")


def selected_tokens(context: int, setup: StepSetup) -> int:
    """Host tokens a request's step attends: `sparsity` of the tokens past the hot set, in whole pages."""
    hot = min(setup.hot_tokens, context)
    pages = -(-int(setup.sparsity * (context - hot)) // setup.page_size)
    return min(max(pages, 1) * setup.page_size, context - hot)


def host_step(
    host, rates: CpuRates, model: ModelSpec, context: int, batch: int, setup: StepSetup
) -> HostStep:
    """Predict one decode step of `batch` requests of `context` tokens on `host` (`calibrate.HostMeasurements`):
    the busiest rank's terms (see the module doc)."""
    if batch < 1:
        raise ValueError(f"--batch: must be at least 1, got {batch}")
    gpus, layers = setup.gpus, model.num_layers
    hbm, pcie = host.hbm_gbs * 1e9, host.pcie_gbs * 1e9
    # a rank's share of the host tier: its heads of every request, or whole requests with every head
    if setup.host_split == "requests" and gpus > 1:
        requests, head_share, device_share = math.ceil(batch / gpus), 1.0, 0.0
    else:
        requests, head_share, device_share = batch, 1 / gpus, setup.device_share
    host_read = host.host_read_gbs * 1e9 / gpus  # the ranks read host memory together
    kv_token = model.kv_bytes_per_token  # model dtype, all layers
    stored_token = kv_token // model.dtype_bytes * ROW_BYTES[setup.row_format]
    request_bytes = context * stored_token
    max_batch = int(host.host_memory_gib * GIB * 0.85 // request_bytes)

    hot = min(setup.hot_tokens, context)
    floor = (
        model.streamed_weight_bytes / gpus / hbm
        + layers * host.forward_layer_us * 1e-6
        + batch * hot * kv_token / gpus / hbm
    )
    if setup.policy == "streaming":
        zero = dict(selection_s=0.0, sync_s=0.0, cpu_s=0.0, pcie_s=0.0, shared_read_s=0.0, cache_s=0.0)
        return HostStep(floor_s=floor, **zero, cpu_bytes=0.0, pcie_bytes=0.0, cache_bytes=0.0,
                        fits=batch <= max_batch, max_batch=max_batch)  # fmt: skip

    selected = selected_tokens(context, setup)
    hits = setup.recall_hit * selected
    shared = device_share * (selected - hits)
    on_cpu = selected - hits - shared
    # per rank and step (all layers); the 8-bit formats read codes, the recall cache holds model-dtype rows
    cpu_bytes = requests * head_share * on_cpu * stored_token
    pcie_bytes = requests * head_share * shared * stored_token
    cache_bytes = requests * head_share * hits * kv_token
    digest_bytes = requests * head_share * context * model.digest_bytes_per_token(setup.page_size)
    call = rates.rate(setup.row_format, host.cpu_threads, f"block{setup.page_size}")
    return HostStep(
        floor_s=floor,
        selection_s=digest_bytes / hbm + layers * host.selection_layer_us * 1e-6,
        sync_s=layers * host.layer_sync_us * 1e-6,
        cpu_s=layers * call.seconds(cpu_bytes / layers),  # one call per layer over the batch
        pcie_s=pcie_bytes / pcie,
        shared_read_s=(cpu_bytes + pcie_bytes) / host_read,
        cache_s=cache_bytes / hbm,
        cpu_bytes=cpu_bytes,
        pcie_bytes=pcie_bytes,
        cache_bytes=cache_bytes,
        fits=batch <= max_batch,
        max_batch=max_batch,
    )
