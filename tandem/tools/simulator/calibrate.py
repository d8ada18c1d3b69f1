"""The same step model with "memory tier = host DRAM + CPU cores": predicts Tandem's decode TPOT on a host.

Tandem's hybrid attention is PnG-KV with one GPU and one memory-side device: the GPU runs the FC layers
and dense attention over a hot set (sinks + recent window, appended on the GPU, never recalled), the
host scores page digests and attends the selected fraction of the offloaded tokens, and only q, o and
lse cross PCIe. So a host is described as a ``MemoryDeviceSpec`` (capacity = host RAM, bandwidth =
measured read bandwidth, compute = cores x per-core rate, link = pinned PCIe) and run through
``schemes.pnkv_step`` unchanged.

Bench file (JSON): `tandem bench`'s own bench.json, whose "bandwidth" (host_read_gbps, pcie_h2d_gbps, hbm_gbps,
measured beside its rows) and "machine" (gpu, cores, memory_gb, gpu_memory_gb) describe the host; or a flat object
with these keys:

    required: host_read_gbs (host memory read, GB/s), pcie_gbs (pinned host->GPU, GB/s),
              hbm_gbs (GPU attention/weights streaming, GB/s)
    optional: device (str), host_cores (16), host_memory_gib (128), gpu_memory_gib (80),
              gpu_tflops (989), cpu_gflops_per_core (100), layer_sync_us (60)

`bench_comparison` puts a bench.json's measured quest rows beside the model's prediction for the same host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from tandem.config import DEFAULT_GPU_SHARE, TandemConfig
from tandem.tools.simulator.config import SystemConfig, Workload, format_context, parse_context
from tandem.tools.simulator.hardware import GPUS, MemoryDeviceSpec, PlatformSpec, get_model
from tandem.tools.simulator.model import SimResult, simulate

REQUIRED_KEYS = ("host_read_gbs", "pcie_gbs", "hbm_gbs")


@dataclass(frozen=True)
class HostMeasurements:
    """Measured facts of a GPU host (units in the names; GB = 1e9 bytes).

    Defaults for optional fields are the lent H100 host's (`LENT_H100_HOST`, docs/simulator.md); ``cpu_gflops_per_core`` (bf16 dot
    products with fp32 accumulation on AVX-512) is an assumption until a benchmark measures it. ``layer_sync_us``
    (per layer: hand q to the CPU workers, wait, copy (o, lse) back, merge) is the engine's measured round trip
    on the H100: ~50 us a layer even with nothing to attend (a streaming step with and without hand-offs,
    `2026-11-27_h100_decode_forward/`) and 60-70 us on a small model (`2026-11-27_h100_handoff_server/`).

    Example:
        >>> HostMeasurements(host_read_gbs=65, pcie_gbs=55, hbm_gbs=2900).host_cores
        16
    """

    host_read_gbs: float
    pcie_gbs: float
    hbm_gbs: float
    device: str = "H100-80GB host"
    host_cores: int = 16
    host_memory_gib: float = 128
    gpu_memory_gib: float = 80
    gpu_tflops: float = 989
    cpu_gflops_per_core: float = 100
    layer_sync_us: float = 60

    def __post_init__(self) -> None:
        for name in (
            "host_read_gbs",
            "pcie_gbs",
            "hbm_gbs",
            "host_memory_gib",
            "gpu_memory_gib",
            "gpu_tflops",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)}: must be positive, got {getattr(self, name)}")
        if self.host_cores < 1:
            raise ValueError(f"--host-cores: must be at least 1, got {self.host_cores}")
        if not self.cpu_gflops_per_core > 0 or self.layer_sync_us < 0:
            raise ValueError("--cpu-gflops-per-core must be positive and --layer-sync-us non-negative")


# the command-line flag of each HostMeasurements field, where its name differs (tandem simulate --host)
FIELD_FLAGS = {"host_read_gbs": "--host-bandwidth-gbs"}


def _flag(name: str) -> str:
    return FIELD_FLAGS.get(name, "--" + name.replace("_", "-"))


# Measured on the lent H100 host (docs/simulator.md): 15-thread host copy 65 GB/s (read + write bytes, so a
# pure read stream reaches at least this), pinned PCIe 55 GB/s, SDPA decode over 128K tokens of one 8B
# layer (512 MiB of KV) in 185 us = 2.9 TB/s.
LENT_H100_HOST = HostMeasurements(host_read_gbs=65, pcie_gbs=55, hbm_gbs=2900, device="lent H100 host")


def read_bench(path: str | Path) -> dict:
    """A bench file's JSON object; raise ValueError naming a missing file or bad JSON."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--from-bench: file not found: {file}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"--from-bench: {file} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise ValueError(f"--from-bench: {file} must hold a JSON object")
    return data


def load_bench(path: str | Path) -> HostMeasurements:
    """Read a bench JSON file; raise ValueError naming a missing file, bad JSON or missing keys."""
    return _host_of(read_bench(path), Path(path))


def _host_of(data: dict, file: Path) -> HostMeasurements:
    """The host a bench file's JSON object describes (see the module doc)."""
    if "bandwidth" in data and "machine" in data:
        data = _from_tandem_bench(data, file)
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise ValueError(
            f"--from-bench: {file} lacks {', '.join(missing)} (required: {', '.join(REQUIRED_KEYS)})"
        )
    known = {f.name for f in fields(HostMeasurements)}
    return HostMeasurements(**{k: v for k, v in data.items() if k in known})


# tandem bench's bandwidth keys -> HostMeasurements fields
BENCH_BANDWIDTHS = {"host_read_gbps": "host_read_gbs", "pcie_h2d_gbps": "pcie_gbs", "hbm_gbps": "hbm_gbs"}
GIB_PER_GB = 1e9 / 2**30


def _from_tandem_bench(data: dict, file: Path) -> dict:
    """The flat keys of a `tandem bench` bench.json: its measured bandwidths and the machine it ran on."""
    bandwidth, machine = data["bandwidth"] or {}, data["machine"] or {}
    missing = [k for k in BENCH_BANDWIDTHS if not bandwidth.get(k)]
    if missing:
        raise ValueError(
            f"--from-bench: {file} is a tandem bench file without the bandwidths {', '.join(missing)} (a run "
            "without a GPU measures none): pass one from a GPU host, or the bandwidths as flags"
        )
    flat = {field: float(bandwidth[key]) for key, field in BENCH_BANDWIDTHS.items()}
    flat["device"] = f"{machine.get('gpu', 'GPU')} host ({file.parent.name or file.name})"
    # a tensor-parallel bench's ranks measured the host together, each on its own cores: the host is the sum
    gpus = int((data.get("model") or {}).get("gpus") or 1)
    flat["host_read_gbs"] *= gpus
    if machine.get("cores"):
        flat["host_cores"] = int(machine["cores"]) * gpus
    if machine.get("memory_gb"):
        flat["host_memory_gib"] = float(machine["memory_gb"]) * GIB_PER_GB
    if machine.get("gpu_memory_gb"):
        flat["gpu_memory_gib"] = float(machine["gpu_memory_gb"]) * GIB_PER_GB
    return flat


def bench_comparison(
    path: str | Path,
    sparsity: float = 0.05,
    hot_tokens: int | None = None,
    device_share: float | None = None,
    host: HostMeasurements | None = None,
) -> list[dict]:
    """Each quest row of a `tandem bench` bench.json (status ok, the host tier in the model's dtype) beside the
    prediction for the host the file describes: {context, batch, system, measured_ms, predicted_ms, error}
    with error = predicted / measured - 1. hot_tokens: sinks + window on the GPU (default: `bench_settings`,
    TandemConfig's); device_share: quest's gpu_share on CUDA (default: the engine's), or the one a row's label
    names. Selection is
    priced on the GPU, as the engine runs it (the digests mirrored in GPU memory). The recall cache's hit share is
    the row's own (`cache_bytes_per_step` of the selected bytes); a tensor-parallel file is priced on its GPUs.

    Where the file also measured `streaming` at the same context and batch (the step without host attention),
    `floor_predicted_ms` / `floor_error` replace the model's weight-streaming time by that measured floor: the
    model prices the weights at HBM speed, and the layers' code takes longer (docs/engine.md)."""
    data = read_bench(path)
    host = host or _host_of(data, Path(path))  # given: the file's host with the command line's overrides
    settings = bench_settings(data)
    model, gpus = settings["model"], settings["gpus"]
    hot_tokens = settings["hot_tokens"] if hot_tokens is None else hot_tokens
    device_share = settings["device_share"] if device_share is None else device_share
    if not data.get("rows") or model is None:
        raise ValueError(f"--from-bench: {path} has no measured rows (a tandem bench bench.json has)")
    floors = {
        (r["context"], r["batch"]): r["tpot_median_ms"]
        for r in data["rows"]
        if r.get("system") == "tandem-streaming" and r.get("status") == "ok"
    }
    out = []
    for row in data["rows"]:
        system = row.get("system", "")
        if not system.startswith("tandem-quest") or row.get("status") != "ok":
            continue
        if "host_dtype=" in system and "host_dtype=none" not in system:
            continue  # the model prices a host tier in the model's dtype
        pred = predict_host(
            host, model, row["context"], row["batch"], sparsity=sparsity, hot_tokens=hot_tokens,
            device_share=_share_of(system, device_share), gpu_selection=settings["gpu_selection"], gpus=gpus,
            recall_hit=_recall_hit(row), host_split=_setting_of(system, "host_split") or "heads",
        )  # fmt: skip
        predicted = pred.result.step.step_s * 1e3
        measured = row["tpot_median_ms"]
        entry = {
            "context": row["context"], "batch": row["batch"], "system": system, "measured_ms": measured,
            "predicted_ms": predicted, "error": predicted / measured - 1,
        }  # fmt: skip
        floor = floors.get((row["context"], row["batch"]))
        if floor is not None:
            with_floor = predicted - pred.result.step.phases["fc"] * 1e3 + floor
            entry.update(floor_predicted_ms=with_floor, floor_error=with_floor / measured - 1)
        out.append(entry)
    return out


def _recall_hit(row: dict) -> float:
    """The share of a bench row's selected bytes that its recall cache served (0 without one): measured, since
    how often a step re-selects last steps' blocks depends on the model, not the host."""
    cached = row.get("cache_bytes_per_step") or 0.0
    total = cached + (row.get("cpu_bytes_per_step") or 0.0) + (row.get("pcie_bytes_per_step") or 0.0)
    return cached / total if total > 0 else 0.0


def _share_of(system: str, default: float) -> float:
    """The gpu_share a bench row's label names (`tandem-quest[gpu_share=0.7]`), else `default`; a request split
    has none."""
    if _setting_of(system, "host_split") == "requests":
        return 0.0
    try:
        return float(_setting_of(system, "gpu_share") or default)
    except ValueError:
        return default


def _setting_of(system: str, name: str) -> str | None:
    """The value a bench row's label gives setting `name` (`tandem-quest[gpu_share=0.7,host_split=heads]`)."""
    for part in system.partition("[")[2].rstrip("]").split(","):
        key, _, value = part.partition("=")
        if key.strip() == name:
            return value.strip()
    return None


def comparison_table(rows: list[dict]) -> str:
    """Markdown of `bench_comparison`."""
    lines = [
        "| context | batch | system | measured TPOT (ms) | predicted (ms) | error | with the measured floor | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor = (
            f"{r['floor_predicted_ms']:.2f} | {r['floor_error']:+.0%}"
            if "floor_predicted_ms" in r
            else "- | -"
        )
        lines.append(
            f"| {format_context(r['context'])} | {r['batch']} | {r['system']} | {r['measured_ms']:.2f} | "
            f"{r['predicted_ms']:.2f} | {r['error']:+.0%} | {floor} |"
        )
    return "\n".join(lines)


def host_system(
    host: HostMeasurements,
    model: str,
    context: str | int,
    batch: int,
    sparsity: float = 0.05,
    hot_tokens: int = 4096,
    page_size: int = 16,
    device_share: float = 0.0,
    gpu_selection: bool = False,
    gpus: int = 1,
    recall_hit: float = 0.0,
    host_split: str = "heads",
) -> SystemConfig:
    """`gpus` GPUs (tensor-parallel) + the host tier, running Tandem's layout (PnG-KV with a fixed hot set).

    sparsity: fraction of the offloaded tokens the CPU attends per step. Efficiencies are 1 because the
    bandwidths are measured; 85% of host RAM is assumed usable for KV (OS, pinned staging buffers).
    host_split: how `gpus` ranks divide the host tier (`TandemConfig.host_split`). "heads": every rank takes an
    equal share of every request, so the host is one memory device with the ranks' summed bandwidth and cores.
    "requests": the host is one device per rank (its share of the bandwidth, cores and memory) under PnG-KV's
    DP mapping: whole requests per device, so the busiest one holds ceil(batch / gpus) of them.
    """
    ctx = parse_context(context)
    workload = Workload(
        context_tokens=ctx,
        budget_fraction=sparsity,
        page_size=page_size,
        max_batch=batch,
        hot_tokens=min(hot_tokens, ctx),
        device_share=device_share,
        gpu_selection=gpu_selection,
        recall_hit=recall_hit,
    )
    tier = MemoryDeviceSpec(
        name=f"host DRAM + {host.host_cores} cores",
        capacity_gib=host.host_memory_gib * 0.85,
        bandwidth_gbs=host.host_read_gbs,
        tflops=host.host_cores * host.cpu_gflops_per_core / 1000,
        active_w=0.0,
        idle_w=0.0,
        link_gbs=host.pcie_gbs,
        hw_cost_per_h=0.0,
        op_cost_per_h=0.0,
    )
    devices = 1
    if host_split == "requests" and gpus > 1:
        devices = gpus
        tier = replace(
            tier,
            capacity_gib=tier.capacity_gib / gpus,
            bandwidth_gbs=tier.bandwidth_gbs / gpus,
            tflops=tier.tflops / gpus,
        )
    gpu = replace(GPUS["h100"], name=host.device, hbm_gib=host.gpu_memory_gib, hbm_gbs=host.hbm_gbs)
    gpu = replace(gpu, bf16_tflops=host.gpu_tflops, pcie_gbs=host.pcie_gbs)
    platform = PlatformSpec(
        host_link_gbs=host.pcie_gbs,
        gpu_bw_eff=1.0,
        pnm_bw_eff=1.0,
        pnm_flops_eff=1.0,
        link_eff=1.0,
        layer_overhead_us=host.layer_sync_us / 2,  # two hops per layer: q out, (o, lse) back
    )
    return SystemConfig(get_model(model), gpu, gpus, devices, "pnkv", workload, platform, tier)


@dataclass(frozen=True)
class HostPrediction:
    """Predicted decode step on a host; ``fits`` is False when the requested batch exceeds host RAM."""

    result: SimResult
    requested_batch: int

    @property
    def fits(self) -> bool:
        return self.result.feasible and self.result.step.batch >= self.requested_batch

    @property
    def max_batch(self) -> int:
        return self.result.step.batch


def predict_host(
    host: HostMeasurements, model: str, context: str | int, batch: int, **kwargs: object
) -> HostPrediction:
    """Predict Tandem's TPOT on ``host`` for ``batch`` requests of ``context`` tokens."""
    if batch < 1:
        raise ValueError(f"--batch: must be at least 1, got {batch}")
    cfg = host_system(host, model, context, batch, **kwargs)  # type: ignore[arg-type]
    if cfg.memory.capacity_gib <= 0:
        raise ValueError("--host-memory-gib: must be positive")
    unlimited = replace(cfg, workload=replace(cfg.workload, max_batch=None))
    capacity = simulate(unlimited).step.batch
    result = simulate(cfg)
    if capacity < batch:
        return HostPrediction(replace(result, step=replace(result.step, batch=capacity)), batch)
    return HostPrediction(result, batch)


def format_host_prediction(pred: HostPrediction) -> str:
    """One prediction as text: TPOT and the critical-path breakdown."""
    r = pred.result
    c, s = r.config, r.step
    head = (
        f"{c.model.name}, context {format_context(c.workload.context_tokens)}, batch {pred.requested_batch},"
        f" sparsity {c.workload.budget_fraction:.0%} + {c.workload.hot_tokens} hot tokens on the GPU,"
        f" {c.gpu.name} + {c.memory.name}"
    )
    if not pred.fits:
        need = pred.requested_batch * c.workload.context_tokens * c.model.kv_bytes_per_token / 2**30
        fit = f"host RAM holds {pred.max_batch} requests"
        return f"{head}\n  does not fit: {need:.0f} GiB of KV for the batch; {fit}"
    ms = {k: v * 1e3 for k, v in s.phases.items()}
    return "\n".join(
        [
            head,
            f"  predicted TPOT   {s.step_s * 1e3:.2f} ms ({r.tokens_per_s:,.1f} tokens/s over the batch)",
            f"  breakdown        FC {ms['fc']:.2f} ms"
            f" | attention (GPU hot set || CPU sparse) {ms['attention']:.2f} ms"
            f" | PCIe + sync {ms['communication']:.2f} ms",
        ]
    )


def bench_settings(data: dict) -> dict:
    """How `bench_comparison` prices the rows of a `tandem bench` file (its JSON object, `read_bench`), as
    `predict_host` keywords plus `model`: the file's model and GPU count, Tandem's hot set (sinks + window of
    `TandemConfig`), quest's default device share and selection on the GPU. The report's prediction table for such
    a file uses the same, so that its two tables agree wherever they price the same row."""
    config = TandemConfig()
    return {
        "model": (data.get("model") or {}).get("name"),
        "gpus": int((data.get("model") or {}).get("gpus") or 1),
        "hot_tokens": config.sink_tokens + config.window_tokens,
        "device_share": DEFAULT_GPU_SHARE,
        "gpu_selection": True,
    }


def prediction_rows(
    host: HostMeasurements = LENT_H100_HOST,
    model: str = "llama-3.1-8b",
    sparsity: float = 0.05,
    hot_tokens: int = 4096,
    contexts=("32k", "64k", "128k"),
    batches=(1, 16),
    **kwargs: object,
) -> list[dict]:
    """Predictions for each context x batch at `sparsity`: {context, batch, fits, max_batch, predicted_ms, fc_ms,
    attention_ms, communication_ms} (times None where the batch does not fit host RAM). `kwargs` go to
    `predict_host` (gpus, device_share, gpu_selection, ...)."""
    out = []
    for context in contexts:
        for batch in batches:
            pred = predict_host(
                host, model, context, batch, sparsity=sparsity, hot_tokens=hot_tokens, **kwargs
            )
            row = {
                "context": parse_context(context),
                "batch": batch,
                "fits": pred.fits,
                "max_batch": pred.max_batch,
            }
            phases = pred.result.step.phases if pred.fits else {}
            row.update(
                predicted_ms=pred.result.step.step_s * 1e3 if pred.fits else None,
                **{
                    f"{k}_ms": phases[k] * 1e3 if pred.fits else None
                    for k in ("fc", "attention", "communication")
                },
            )
            out.append(row)
    return out


def prediction_table(
    host: HostMeasurements = LENT_H100_HOST,
    model: str = "llama-3.1-8b",
    sparsity: float = 0.05,
    hot_tokens: int = 4096,
    **kwargs: object,
) -> str:
    """Markdown table of predictions for 32K/64K/128K at batch 1 and 16, at `sparsity` (default 5%); `kwargs` as
    `prediction_rows`."""
    return prediction_markdown(prediction_rows(host, model, sparsity, hot_tokens, **kwargs))


def prediction_markdown(rows: list[dict]) -> str:
    """Markdown of `prediction_rows`."""
    lines = [
        "| context | batch | predicted TPOT (ms) | FC (ms) | attention (ms) | PCIe + sync (ms)"
        " | fits host RAM |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        context = format_context(r["context"])
        if not r["fits"]:
            lines.append(f"| {context} | {r['batch']} | - | - | - | - | no (max batch {r['max_batch']}) |")
            continue
        lines.append(
            f"| {context} | {r['batch']} | {r['predicted_ms']:.2f} | {r['fc_ms']:.2f} |"
            f" {r['attention_ms']:.2f} | {r['communication_ms']:.2f} | yes |"
        )
    return "\n".join(lines)
