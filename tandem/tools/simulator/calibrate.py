"""A GPU host's measured facts, read from `tandem bench`'s file, and the host model's reports.

The model itself is `host_step` (one model of Tandem's decode step on a host, used by every table). This module
reads the host (`HostMeasurements`: bandwidths from a bench file or flags, plus the per-layer costs measured on the
lent H100), prices a bench file's rows (`bench_comparison`) and a grid of contexts x batches (`prediction_rows`)
through that one model, and prints them.

Bench file (JSON): `tandem bench`'s own bench.json, whose "bandwidth" (host_read_gbps, pcie_h2d_gbps, hbm_gbps,
measured beside its rows) and "machine" (gpu, cores, threads, memory_gb, gpu_memory_gb) describe the host; or a
flat object with these keys:

    required: host_read_gbs (host memory read, GB/s), pcie_gbs (pinned host->GPU, GB/s),
              hbm_gbs (GPU attention/weights streaming, GB/s)
    optional: device (str), host_cores (16), cpu_threads (15), host_memory_gib (128), gpu_memory_gib (80),
              layer_sync_us (50), forward_layer_us (75), selection_layer_us (49)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from tandem.config import DEFAULT_GPU_SHARE, TandemConfig
from tandem.tools.simulator.config import format_context, parse_context
from tandem.tools.simulator.hardware import get_model
from tandem.tools.simulator.host_step import CpuRates, HostStep, StepSetup, host_step

REQUIRED_KEYS = ("host_read_gbs", "pcie_gbs", "hbm_gbs")


@dataclass(frozen=True)
class HostMeasurements:
    """Measured facts of a GPU host (units in the names; GB = 1e9 bytes). For a tensor-parallel host, the host read
    is the ranks' sum and `cpu_threads` each rank's.

    The per-layer costs default to the lent H100's, measured apart from the bench runs the model is checked on
    (each default's runs and results folder: docs/simulator.md § Tandem on a real host, the calibration column):
    - layer_sync_us: a layer's hand-off to the host and back with nothing to attend;
    - forward_layer_us: the forward's time past its weights, per layer;
    - selection_layer_us: quest's selection past reading the digests, per layer.

    Example:
        >>> HostMeasurements(host_read_gbs=108, pcie_gbs=55, hbm_gbs=3030).cpu_threads
        15
    """

    host_read_gbs: float
    pcie_gbs: float
    hbm_gbs: float
    device: str = "H100-80GB host"
    host_cores: int = 16
    cpu_threads: int = 15
    host_memory_gib: float = 128
    gpu_memory_gib: float = 80
    layer_sync_us: float = 50
    forward_layer_us: float = 75
    selection_layer_us: float = 49

    def __post_init__(self) -> None:
        for name in ("host_read_gbs", "pcie_gbs", "hbm_gbs", "host_memory_gib", "gpu_memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)}: must be positive, got {getattr(self, name)}")
        if self.host_cores < 1:
            raise ValueError(f"--host-cores: must be at least 1, got {self.host_cores}")
        if self.cpu_threads < 1:
            raise ValueError(f"--cpu-threads: must be at least 1, got {self.cpu_threads}")
        for name in ("layer_sync_us", "forward_layer_us", "selection_layer_us"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{_flag(name)}: must be 0 or more, got {getattr(self, name)}")


# the command-line flag of each HostMeasurements field, where its name differs (tandem simulate --host)
FIELD_FLAGS = {"host_read_gbs": "--host-bandwidth-gbs"}


def _flag(name: str) -> str:
    return FIELD_FLAGS.get(name, "--" + name.replace("_", "-"))


# The lent H100 host as `tandem bench` measured it (`2026-11-27_h100_host_dtype/bench/bench.json`): 15-thread host
# read, pinned PCIe and HBM streaming.
LENT_H100_HOST = HostMeasurements(host_read_gbs=107.9, pcie_gbs=55.1, hbm_gbs=3032, device="lent H100 host")


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
    if machine.get("threads"):
        flat["cpu_threads"] = int(machine["threads"])
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


def predict_host(
    host: HostMeasurements,
    model: str,
    context: str | int,
    batch: int,
    setup: StepSetup | None = None,
    rates: CpuRates | None = None,
) -> HostStep:
    """Tandem's decode step on `host` for `batch` requests of `context` tokens (`host_step`): the one model every
    table of `tandem simulate --host` / `--from-bench` uses."""
    return host_step(
        host, rates or CpuRates.load(), get_model(model), parse_context(context), batch, setup or StepSetup()
    )


def engine_setup(data: dict | None = None, sparsity: float = 0.05) -> StepSetup:
    """The layout `tandem bench` runs (TandemConfig's hot set, quest's default device share, 16-token pages) on the
    file's GPU count; a row's label may change the policy, row format, device share and split (`row_setup`)."""
    config = TandemConfig()
    gpus = int(((data or {}).get("model") or {}).get("gpus") or 1)
    return StepSetup(
        sparsity=sparsity,
        hot_tokens=config.sink_tokens + config.window_tokens,
        page_size=config.block_size,
        device_share=DEFAULT_GPU_SHARE,
        gpus=gpus,
    )


def row_setup(row: dict, base: StepSetup) -> StepSetup | None:
    """How the model prices one bench row (its label's policy and settings, its measured recall-cache hits), or
    None for a row it does not model (HF's caches, other policies)."""
    system = row.get("system", "")
    policy = system.removeprefix("tandem-").partition("[")[0]
    if not system.startswith("tandem-") or policy not in ("quest", "streaming"):
        return None
    dtype = _setting_of(system, "host_dtype")
    row_format = "bfloat16" if dtype in (None, "none", "None") else dtype
    split = _setting_of(system, "host_split") or base.host_split
    share = _setting_of(system, "gpu_share")
    budget = _setting_of(system, "budget")
    return StepSetup(
        policy=policy,
        row_format=row_format,
        sparsity=float(budget) if budget else base.sparsity,
        hot_tokens=base.hot_tokens,
        page_size=base.page_size,
        device_share=float(share) if share not in (None, "None") else base.device_share,
        recall_hit=_recall_hit(row, row_format),
        gpus=base.gpus,
        host_split=split,
    )


def _recall_hit(row: dict, row_format: str) -> float:
    """The share of a bench row's selected tokens that its recall cache served (0 without one): measured, since how
    often a step re-selects last steps' blocks depends on the model and the prompt, not the host. Counted in tokens:
    the cache holds model-dtype rows, the host tier `row_format` rows."""
    stored = {"int8": 0.5, "fp8": 0.5}.get(row_format, 1.0)  # host row bytes per model-dtype row byte
    cached = row.get("cache_bytes_per_step") or 0.0
    host = ((row.get("cpu_bytes_per_step") or 0.0) + (row.get("pcie_bytes_per_step") or 0.0)) / stored
    return cached / (cached + host) if cached + host > 0 else 0.0


def _setting_of(system: str, name: str) -> str | None:
    """The value a bench row's label gives setting `name` (`tandem-quest[gpu_share=0.7,host_split=heads]`)."""
    for part in system.partition("[")[2].rstrip("]").split(","):
        key, _, value = part.partition("=")
        if key.strip() == name:
            return value.strip()
    return None


def bench_comparison(
    path: str | Path,
    sparsity: float = 0.05,
    host: HostMeasurements | None = None,
    rates: CpuRates | None = None,
) -> list[dict]:
    """Every row of a `tandem bench` bench.json (status ok) beside the host model's prediction for the host the file
    describes: {context, batch, system, policy, row_format, gpus, host_split, measured_ms, predicted_ms, error,
    terms_ms} with error = predicted / measured - 1, or predicted_ms None and `reason` for a row the model does not
    price (HF's caches, policies other than quest and streaming)."""
    data = read_bench(path)
    host = host or _host_of(data, Path(path))  # given: the file's host with the command line's overrides
    model = (data.get("model") or {}).get("name")
    if not data.get("rows") or model is None:
        raise ValueError(f"--from-bench: {path} has no measured rows (a tandem bench bench.json has)")
    rates = rates or CpuRates.load()
    base = engine_setup(data, sparsity)
    out = []
    for row in data["rows"]:
        if row.get("status") != "ok":
            continue
        entry = {"context": row["context"], "batch": row["batch"], "system": row.get("system", ""),
                 "measured_ms": row["tpot_median_ms"], "gpus": base.gpus}  # fmt: skip
        setup = row_setup(row, base)
        if setup is None:
            out.append({**entry, "predicted_ms": None, "error": None, "reason": "not modelled"})
            continue
        step = predict_host(host, model, row["context"], row["batch"], setup, rates)
        terms = step.terms_ms()
        out.append({
            **entry, "policy": setup.policy, "row_format": setup.row_format, "host_split": setup.host_split,
            "device_share": setup.device_share, "recall_hit": setup.recall_hit, "predicted_ms": terms["step"],
            "error": terms["step"] / row["tpot_median_ms"] - 1, "terms_ms": terms,
        })  # fmt: skip
    return out


def grid_setups(data: dict, sparsity: float = 0.05) -> dict:
    """The recall-cache hit share the report's grid uses at each (context, batch) of a bench file: that of the
    file's quest row there with the grid's own setup (model-dtype rows, default share, heads split), so that the
    grid and the comparison price such a row alike; elsewhere 0."""
    base = engine_setup(data, sparsity)
    hits = {}
    for row in data.get("rows") or []:
        setup = row_setup(row, base) if row.get("status") == "ok" else None
        if (
            setup
            and setup.policy == "quest"
            and setup == StepSetup(**{**_fields(base), "recall_hit": setup.recall_hit})
        ):
            hits[(row["context"], row["batch"])] = setup.recall_hit
    return hits


def _fields(setup: StepSetup) -> dict:
    return {f.name: getattr(setup, f.name) for f in fields(setup)}


def prediction_rows(
    host: HostMeasurements = LENT_H100_HOST,
    model: str = "llama-3.1-8b",
    setup: StepSetup | None = None,
    rates: CpuRates | None = None,
    contexts=("32k", "64k", "128k"),
    batches=(1, 16),
    recall_hits: dict | None = None,
) -> list[dict]:
    """The model for each context x batch: {context, batch, fits, max_batch, predicted_ms, terms_ms} (predicted_ms
    None where the batch does not fit host RAM). recall_hits: {(context, batch): share} where measured (`grid_setups`),
    else `setup`'s."""
    setup = setup or StepSetup()
    rates = rates or CpuRates.load()
    out = []
    for context in map(parse_context, contexts):
        for batch in batches:
            hit = (recall_hits or {}).get((context, batch), setup.recall_hit)
            step = predict_host(
                host, model, context, batch, StepSetup(**{**_fields(setup), "recall_hit": hit}), rates
            )
            terms = step.terms_ms()
            out.append({
                "context": context, "batch": batch, "fits": step.fits, "max_batch": step.max_batch,
                "recall_hit": hit, "predicted_ms": terms["step"] if step.fits else None,
                "terms_ms": terms if step.fits else None,
            })  # fmt: skip
    return out


TERM_COLUMNS = ("floor", "selection", "sync", "cpu", "pcie", "shared_read", "cache")
TERM_HEADER = "floor | selection | hand-offs | CPU | PCIe | both reads | recall cache"


def _terms(terms: dict | None) -> str:
    if terms is None:
        return " | ".join("-" for _ in TERM_COLUMNS)
    return " | ".join(f"{terms[t]:.2f}" for t in TERM_COLUMNS)


def prediction_markdown(rows: list[dict]) -> str:
    """Markdown of `prediction_rows`: the step and its terms (ms; the largest of CPU, PCIe and both reads counts)."""
    lines = [
        f"| context | batch | recall hit | predicted TPOT (ms) | {TERM_HEADER} | fits host RAM |",
        "|---|---|---|---|" + "---|" * len(TERM_COLUMNS) + "---|",
    ]
    for r in rows:
        fits = "yes" if r["fits"] else f"no (max batch {r['max_batch']})"
        step = "-" if r["predicted_ms"] is None else f"{r['predicted_ms']:.2f}"
        lines.append(
            f"| {format_context(r['context'])} | {r['batch']} | {r['recall_hit']:.0%} | {step} | "
            f"{_terms(r['terms_ms'])} | {fits} |"
        )
    return "\n".join(lines)


def comparison_table(rows: list[dict]) -> str:
    """Markdown of `bench_comparison`: every row, its measured and predicted TPOT, the error and the terms (ms)."""
    lines = [
        f"| context | batch | GPUs | system | measured TPOT (ms) | predicted (ms) | error | {TERM_HEADER} |",
        "|---|---|---|---|---|---|---|" + "---|" * len(TERM_COLUMNS),
    ]
    for r in rows:
        predicted = "-" if r["predicted_ms"] is None else f"{r['predicted_ms']:.2f}"
        error = r.get("reason", "-") if r["error"] is None else f"{r['error']:+.0%}"
        lines.append(
            f"| {format_context(r['context'])} | {r['batch']} | {r['gpus']} | {r['system']} | "
            f"{r['measured_ms']:.2f} | {predicted} | {error} | {_terms(r.get('terms_ms'))} |"
        )
    return "\n".join(lines)


def format_host_prediction(
    step: HostStep, model: str, context: int, batch: int, setup: StepSetup, host
) -> str:
    """One prediction as text: TPOT and its terms."""
    head = (
        f"{model}, context {format_context(context)}, batch {batch}, {setup.policy} {setup.sparsity:.0%} + "
        f"{setup.hot_tokens} hot tokens, {setup.row_format} host rows, {setup.gpus} GPU(s), {host.device}"
    )
    if not step.fits:
        return f"{head}\n  does not fit: host RAM holds {step.max_batch} requests"
    t = step.terms_ms()
    return "\n".join([
        head,
        f"  predicted TPOT   {t['step']:.2f} ms ({batch / t['step'] * 1e3:,.1f} tokens/s over the batch)",
        f"  terms (ms)       floor {t['floor']:.2f} | selection {t['selection']:.2f} | hand-offs {t['sync']:.2f}"
        f" | host max(CPU {t['cpu']:.2f}, PCIe {t['pcie']:.2f}, both reads {t['shared_read']:.2f})"
        f" | recall cache {t['cache']:.2f}",
    ])  # fmt: skip


def check_rows(rows: list[dict]) -> list[dict]:
    """The rows of `bench_comparison` the model prices (quest and streaming)."""
    return [r for r in rows if r["predicted_ms"] is not None]


def json_ready(obj):
    """`obj` with tuple keys made strings (JSON)."""
    if isinstance(obj, dict):
        return {",".join(map(str, k)) if isinstance(k, tuple) else k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [json_ready(v) for v in obj]
    return obj
