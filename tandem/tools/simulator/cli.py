"""``tandem simulate``: size GPU + CXL-PNM systems, reproduce PNM-KV's Figures 10-14, predict a host.

The main CLI calls ``add_arguments(parser)`` and ``run(args)``; ``python -m tandem.tools.simulator.cli`` runs
standalone. Library code raises ValueError; ``run`` prints it on stderr and returns 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, fields, replace

from tandem import manifest
from tandem.tools.simulator.calibrate import (
    LENT_H100_HOST,
    HostMeasurements,
    bench_comparison,
    comparison_table,
    engine_setup,
    format_host_prediction,
    grid_setups,
    load_bench,
    predict_host,
    prediction_markdown,
    prediction_rows,
    read_bench,
)
from tandem.tools.simulator.config import (
    SCHEMES,
    SystemConfig,
    Workload,
    check_scheme,
    parse_context,
)
from tandem.tools.simulator.hardware import GPUS, MODELS
from tandem.tools.simulator.host_step import ROW_BYTES, CpuRates
from tandem.tools.simulator.model import format_result, simulate
from tandem.tools.simulator.sweep import DEFAULT_OUT, write_sweep

DESCRIPTION = """\
Model a long-context decode system's throughput, energy and cost.

Without host flags: a GPU + CXL-PNM platform under the PNM-KV paper's three schemes. With
no arguments that is llama-3.1-8b at 128K tokens per request on 1 x A100 + 8 CXL-PNM
devices, scheme pnkv (PnG-KV); every default is listed below, and the output's first line
names the system modelled.

With --host or any host flag: Tandem's decode time per token (TPOT) on a GPU host whose
KV host tier is DRAM attended by CPU cores. --sweep writes the paper's Figures 10-14.
Assumptions: docs/simulator.md.

examples:
  tandem simulate --model llama-3.1-70b --context 512k --gpus 2 --pnm 8 --scheme pnkv
  tandem simulate --model llama-3.1-8b --context 128k --compare
  tandem simulate --sweep --out /tmp/simulate_sweep
  tandem simulate --host --context 128k --batch 1 --host-bandwidth-gbs 65 --pcie-gbs 55
"""

# CLI flag -> HostMeasurements field
HOST_FLAGS = {
    "host_bandwidth_gbs": "host_read_gbs",
    "pcie_gbs": "pcie_gbs",
    "hbm_gbs": "hbm_gbs",
    "host_cores": "host_cores",
    "host_memory_gib": "host_memory_gib",
    "cpu_threads": "cpu_threads",
    "layer_sync_us": "layer_sync_us",
    "forward_layer_us": "forward_layer_us",
    "selection_layer_us": "selection_layer_us",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every flag of ``tandem simulate`` to ``parser``."""
    load_defaults = Workload(context_tokens=1)
    host_defaults = LENT_H100_HOST
    system = parser.add_argument_group("system (PNM-KV platform)")
    system.add_argument(
        "--model", default="llama-3.1-8b", help=f"one of: {', '.join(MODELS)} (default %(default)s)"
    )
    system.add_argument(
        "--context",
        default=None,
        help="tokens per request: 128k, 512k, 1m or an integer (default 128k; host mode without it: a grid of "
        "contexts)",
    )
    system.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs, FC layers tensor-parallel over them (default %(default)s; host mode with a bench file: its run's)",
    )
    system.add_argument(
        "--pnm",
        type=int,
        default=8,
        help="CXL-PNM devices, or CXL-Mem expanders for the baseline scheme (default %(default)s)",
    )
    system.add_argument(
        "--scheme",
        default="pnkv",
        help="baseline (the paper's GPU-CXL-Mem: KV on CXL memory, attended on the GPU), pnm (PNM-KV: attended "
        "on the PNM devices) or pnkv (the paper's PnG-KV: PNM-KV plus a steady set attended on the GPU) "
        "(default %(default)s)",
    )
    system.add_argument(
        "--compare",
        action="store_true",
        help="print all three schemes for this system (default: --scheme only)",
    )
    system.add_argument("--gpu", default="a100", help=f"GPU type: {', '.join(GPUS)} (default %(default)s)")
    system.add_argument(
        "--mapping",
        default="dp",
        help="attention onto the PNM devices: dp (requests spread) or tp (heads spread) (default %(default)s)",
    )
    system.add_argument("--json", action="store_true", help="print JSON instead of text")

    load = parser.add_argument_group("workload (assumptions: docs/simulator.md)")
    load.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"T_Budget / context, tokens attended per step (default {load_defaults.budget_fraction:g})",
    )
    load.add_argument(
        "--page-size", type=int, default=16, help="tokens per page digest (default %(default)s)"
    )
    load.add_argument(
        "--recall-rate",
        type=float,
        default=None,
        help=f"baseline: tokens recalled per step / context (default {load_defaults.recall_rate:g})",
    )
    load.add_argument(
        "--steady-churn",
        type=float,
        default=None,
        help=f"PnG-KV: share of the steady set replaced per step (default {load_defaults.steady_churn:g})",
    )
    load.add_argument(
        "--steady-ratio",
        type=float,
        default=None,
        help="GPU share of T_Budget (default #GPUs / (#GPUs + #PNMs))",
    )
    load.add_argument(
        "--batch",
        type=int,
        default=None,
        help="cap on the batch (default: as many requests as memory holds; host mode: the batch, default 1)",
    )

    sweep = parser.add_argument_group("sweep (Figures 10-14)")
    sweep.add_argument("--sweep", action="store_true", help="write markdown, JSON and PNG figures")
    sweep.add_argument(
        "--out", default=str(DEFAULT_OUT), help="output folder for --sweep (default %(default)s)"
    )
    sweep.add_argument("--no-plots", action="store_true", help="skip PNGs in --sweep")

    host = parser.add_argument_group(
        f"host calibration (memory tier = host DRAM + CPU cores; defaults: the {host_defaults.device}'s, or the "
        "--from-bench file's)"
    )
    host.add_argument("--host", action="store_true", help="predict Tandem's TPOT on a GPU host")
    host.add_argument(
        "--from-bench",
        default=None,
        metavar="FILE",
        help="bench JSON whose host measurements and rows to use (keys in docs/simulator.md; default: none)",
    )
    host.add_argument(
        "--host-bandwidth-gbs",
        type=float,
        default=None,
        help=f"host memory read GB/s (default {host_defaults.host_read_gbs:g})",
    )
    host.add_argument(
        "--host-cores",
        type=int,
        default=None,
        help="host CPU cores (reports; --cpu-threads sets the attention threads) "
        f"(default {host_defaults.host_cores})",
    )
    host.add_argument(
        "--pcie-gbs",
        type=float,
        default=None,
        help=f"pinned host->GPU GB/s (default {host_defaults.pcie_gbs:g})",
    )
    host.add_argument(
        "--hbm-gbs",
        type=float,
        default=None,
        help=f"GPU HBM streaming GB/s (default {host_defaults.hbm_gbs:g})",
    )
    host.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help=f"host RAM GiB (default {host_defaults.host_memory_gib:g})",
    )
    host.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help=f"CPU attention threads (a rank's; default {host_defaults.cpu_threads})",
    )
    host.add_argument(
        "--cpu-rates",
        default=None,
        metavar="FILE",
        help="bench_cpu_attention.py JSON with the CPU attention rates (default: the GPU host's, committed)",
    )
    host.add_argument(
        "--layer-sync-us",
        type=float,
        default=None,
        help=f"per-layer hand-off round trip, us (default {host_defaults.layer_sync_us:g})",
    )
    host.add_argument(
        "--forward-layer-us",
        type=float,
        default=None,
        help=f"forward time past the weights, us/layer (default {host_defaults.forward_layer_us:g})",
    )
    host.add_argument(
        "--selection-layer-us",
        type=float,
        default=None,
        help=f"quest selection's fixed us/layer (default {host_defaults.selection_layer_us:g})",
    )
    host.add_argument(
        "--sparsity",
        type=float,
        default=0.05,
        help="fraction of offloaded tokens the CPU attends (default %(default)s)",
    )
    host.add_argument(
        "--hot-tokens",
        type=int,
        default=None,
        help=f"sinks + window on the GPU (default {engine_setup().hot_tokens}: TandemConfig's sink_tokens + "
        "window_tokens)",
    )
    host.add_argument(
        "--host-dtype",
        default="bfloat16",
        help=f"host tier row format: {', '.join(ROW_BYTES)} (host mode; default %(default)s)",
    )


def _workload_kwargs(args: argparse.Namespace) -> dict:
    given = {
        "budget_fraction": args.budget,
        "page_size": args.page_size,
        "recall_rate": args.recall_rate,
        "steady_churn": args.steady_churn,
        "steady_ratio": args.steady_ratio,
        "max_batch": args.batch,
        "mapping": args.mapping,
    }
    return {k: v for k, v in given.items() if v is not None}


def _host_measurements(args: argparse.Namespace) -> HostMeasurements:
    host = load_bench(args.from_bench) if args.from_bench else LENT_H100_HOST
    overrides = {
        field: getattr(args, flag) for flag, field in HOST_FLAGS.items() if getattr(args, flag) is not None
    }
    known = {f.name for f in fields(HostMeasurements)}
    return replace(host, **{k: v for k, v in overrides.items() if k in known})


def _host_mode(args: argparse.Namespace) -> bool:
    flags = (*HOST_FLAGS, "cpu_rates", "hot_tokens")
    return bool(args.host or args.from_bench or any(getattr(args, flag) is not None for flag in flags))


def _run_host(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.sparsity) and 0 < args.sparsity <= 1):
        raise ValueError(f"--sparsity: must be in (0, 1], got {args.sparsity}")
    if args.hot_tokens is not None and args.hot_tokens < 0:
        raise ValueError(f"--hot-tokens: must be 0 or more, got {args.hot_tokens}")
    if args.host_dtype not in ROW_BYTES:
        raise ValueError(f"--host-dtype: unknown {args.host_dtype!r}; allowed: {', '.join(ROW_BYTES)}")
    host = _host_measurements(args)
    rates = CpuRates.load(args.cpu_rates)
    data = read_bench(args.from_bench) if args.from_bench else {}
    measured = bool(data.get("rows"))  # tandem bench's own file
    model = ((data.get("model") or {}).get("name") if measured else None) or args.model
    # a bench file's rows are priced as its run was set up (its GPU count); the grid uses the same setup
    setup = replace(engine_setup(data if measured else None, args.sparsity), row_format=args.host_dtype)
    if args.hot_tokens is not None:
        setup = replace(setup, hot_tokens=args.hot_tokens)
    if args.gpus != 1 and not measured:
        setup = replace(setup, gpus=args.gpus)
    if args.context is not None:
        step = predict_host(host, model, args.context, args.batch or 1, setup, rates)
        context = step_context = parse_context(args.context)
        if args.json:
            print(json.dumps({"host": asdict(host), "model": model, "context": step_context, "batch": args.batch or 1,
                              "setup": asdict(setup), "cpu_rates": rates.source, **step.to_dict()}, indent=1))  # fmt: skip
        else:
            print(format_host_prediction(step, model, context, args.batch or 1, setup, host))
        return 0
    hits = grid_setups(data, args.sparsity) if measured and args.host_dtype == "bfloat16" else {}
    predictions = prediction_rows(host, model, setup, rates, recall_hits=hits)
    comparison = bench_comparison(args.from_bench, args.sparsity, host=host, rates=rates) if measured else []
    if args.json:
        report = {"host": asdict(host), "model": model, "setup": asdict(setup), "cpu_rates": rates.source}
        print(json.dumps({**report, "predictions": predictions, "comparison": comparison}, indent=1))
        return 0
    print(
        f"Tandem decode TPOT predicted for {host.device} ({model}, {setup.gpus} GPU(s), quest {args.sparsity:.0%}, "
        f"{setup.row_format} host rows; CPU rates: {rates.source}). Terms in ms; the host reads count once, the "
        "largest of CPU, PCIe and both reads."
    )
    print(prediction_markdown(predictions))
    if measured:
        print(f"\nEvery row of {args.from_bench} beside the same model:")
        print(comparison_table(comparison))
    return 0


def _run_system(args: argparse.Namespace) -> int:
    context = args.context or "128k"
    schemes = list(SCHEMES) if args.compare else [check_scheme(args.scheme)]
    results = []
    for scheme in schemes:
        pnm = args.pnm if scheme != "baseline" or not args.compare else 0
        cfg = SystemConfig.build(
            args.model, context, args.gpus, pnm, scheme, gpu=args.gpu, **_workload_kwargs(args)
        )
        results.append(simulate(cfg))
    if args.json:
        print(json.dumps([r.to_dict() for r in results] if args.compare else results[0].to_dict(), indent=1))
    else:
        print("\n\n".join(format_result(r) for r in results))
    return 0


def run(args: argparse.Namespace) -> int:
    """Execute ``tandem simulate``; return 0 on success, 2 on bad input (message on stderr)."""
    try:
        if args.sweep:
            try:
                paths = write_sweep(args.out, plots=not args.no_plots) + [manifest.write(args.out)]
            except OSError as err:
                raise ValueError(f"--out: cannot write {args.out} ({err})") from err
            print("wrote " + ", ".join(str(p) for p in paths))
            return 0
        if _host_mode(args):
            return _run_host(args)
        return _run_system(args)
    except ValueError as err:
        print(f"tandem simulate: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem simulate", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
