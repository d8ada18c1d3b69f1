"""`tandem bench`: decode speed of Tandem policies against Hugging Face's caches and the hardware bound.

    tandem bench --model llama-3.1-8b --contexts 16k,32k,64k --batches 1 --out bench_8b
    tandem bench --model tiny-llama --contexts 512 --steps 4      (a CPU smoke run)

One run measures the bandwidths (GPU memory read, host memory read with the CPU kernels' thread count, PCIe
from pinned memory), builds the model once, then for each context x batch x system fills the cache and times
greedy decode steps. Each configuration that does not fit is a row marked OOM. Writes bench.json, bench.md
and PNG plots into --out.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from ... import manifest
from ...config import POLICIES

HF_SYSTEMS = ("hf-dynamic", "hf-offloaded")
DTYPES = ("bfloat16", "float16", "float32")
FILLS = ("synthetic", "concentrated", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama-3.1-8b",
        help="a named shape with random weights (llama-3.1-8b, llama-3.1-70b, llama-3.2-1b, llama-3.2-3b, qwen2.5-7b, mistral-7b, "
        "smollm2-135m, tiny-llama), a packaged model's name (gemma3-270m: its real weights) or a local HF "
        "directory / .gguf (default llama-3.1-8b)",
    )
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers of a named shape")
    p.add_argument(
        "--no-model-cache",
        action="store_true",
        help="load a .gguf model from the file itself, not from its converted copy in the model cache "
        "($TANDEM_CACHE_DIR/models, default ~/.cache/tandem/models)",
    )
    p.add_argument(
        "--contexts",
        default="16k,32k,64k",
        help="context lengths, e.g. 16k,32k,64k,128k (k = 1024; default %(default)s)",
    )
    p.add_argument("--batches", default="1", help="batch sizes, e.g. 1,4,16 (default %(default)s)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per configuration (default 32)")
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps first (>= 3: the graph is captured in step 3; default %(default)s)",
    )
    p.add_argument(
        "--hf",
        default=",".join(HF_SYSTEMS),
        help=f"HF baselines to run, comma list of {', '.join(HF_SYSTEMS)}, or 'none' (default %(default)s)",
    )
    p.add_argument(
        "--policies",
        default="quest,hgca",
        help=f"Tandem policies, comma list of {', '.join(POLICIES)} (default %(default)s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="POLICY.KEY=V1,V2",
        help="Tandem settings, as in `tandem eval` (e.g. quest.budget=0.05, quest.gpu_share=0,0.5, "
        "window_tokens=512); repeatable (default: none, each policy's defaults)",
    )
    p.add_argument(
        "--fill",
        default="synthetic",
        help="how the cache is filled, comma list to compare (Tandem rows; HF rows are always synthetic): "
        "synthetic: random K/V (default; a random-weight prompt carries nothing, and its attention is flat); "
        "concentrated: random K/V whose attention is as concentrated as the default model's, measured per head "
        "(docs/engine.md, `tandem bench`); model: a real chunked prefill of random tokens",
    )
    p.add_argument(
        "--chunk-tokens", type=int, default=8192, help="prefill chunk with --fill model (default 8192)"
    )
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graph per step)")
    p.add_argument(
        "--handoff",
        default="auto",
        help="how a graph-replayed step hands q to the host and takes the CPU part back: memops (one graph per "
        "step, flags in pinned memory), launches (two graphs per layer) or auto (memops where the driver has "
        "them); comma-separated to compare, e.g. memops,launches (default %(default)s)",
    )
    p.add_argument(
        "--forward",
        default="auto",
        help="the decode step's layer code: own (Tandem's fused forward, Llama family), hf (transformers' layers "
        "with Tandem's attention) or auto (own where the model is in the family); comma-separated to compare, "
        "e.g. own,hf (default %(default)s)",
    )
    p.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="weights and KV dtype (default bfloat16)"
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: CUDA if available)")
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="tensor-parallel over N GPUs of this host (heads and MLP split; each rank its own cache and CPU "
        "cores): starts N processes under torchrun (default 1). With --device cpu, N ranks over gloo",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="CPU attention threads (default: cores - 1 with a GPU, all cores without)",
    )
    p.add_argument(
        "--out",
        default="tandem_bench",
        help="output folder (bench.json, bench.md, PNGs; default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the random weights, K/V and tokens (default %(default)s)"
    )


def _load(args, device, dtype, longest: int, rank=None):
    from ... import shapes

    if args.model in shapes.SHAPES:
        if rank is None:
            model = shapes.build_random_model(
                args.model, device, dtype, num_layers=args.layers, seed=args.seed
            )
        else:
            from ...distributed.tensor_parallel import random_shard

            model = random_shard(args.model, rank, dtype, num_layers=args.layers, seed=args.seed)
        # random weights: let "128k" mean 131072 context tokens plus the decoded ones
        needed = longest + args.warmup + args.steps + 1
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, needed)
        return model, {"name": args.model, "weights": "random", "layers": model.config.num_hidden_layers}
    from ...distributed.loading import load_shard
    from ...models import PACKAGED, load_model, packaged_model_path

    path = packaged_model_path(args.model) if args.model in PACKAGED else Path(args.model)
    if not path.exists():
        raise FileNotFoundError(
            f"--model {args.model!r} is neither a named shape ({', '.join(shapes.SHAPES)}), a packaged model "
            f"({', '.join(PACKAGED)}) nor an existing path"
        )

    load = load_model if rank is None else functools.partial(load_shard, rank=rank)  # a rank reads its slices
    kwargs = {} if rank is not None else {"device": str(device)}
    model, _ = load(
        str(path),
        dtype=str(dtype).removeprefix("torch."),
        cache=False if args.no_model_cache else None,
        **kwargs,
    )
    return model, {"name": str(path), "weights": "checkpoint", "layers": model.config.num_hidden_layers}


def run(args: argparse.Namespace) -> int:
    from ...distributed import launch

    return launch.run_on_ranks(args, _run, "bench")


def _run(args: argparse.Namespace) -> int:
    import torch

    from ...config import TandemConfig
    from ...distributed import launch
    from ...engine import freeze_heap
    from ...engine.runner import FORWARDS, HANDOFFS
    from ..evaluation.runner import make_variants, parse_lengths, parse_names
    from . import bandwidth, baselines, report
    from .tandem_side import bound_ms, run_tandem, serial_bound_ms

    contexts = parse_lengths(args.contexts, "--contexts", 1, "context length", "16k, 32k, 64k")
    batches = parse_lengths(args.batches, "--batches", 1, "batch size", "1, 4, 16")
    hf_systems = [] if args.hf.strip() == "none" else parse_names(args.hf, HF_SYSTEMS, "--hf")
    policies = [] if args.policies.strip() == "none" else parse_names(args.policies, POLICIES, "--policies")
    handoffs = parse_names(args.handoff, HANDOFFS, "--handoff")
    forwards = parse_names(args.forward, FORWARDS, "--forward")
    fills = parse_names(args.fill, FILLS, "--fill")
    for argument, value in (("--cpu-threads", args.cpu_threads), ("--chunk-tokens", args.chunk_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{argument}={value} is out of range: allowed >= 1")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 3:
        raise ValueError(
            f"--warmup must be >= 3 (steps 1-2 warm up, step 3 captures the graph), got {args.warmup}"
        )
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    from ...models import resolve_device

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype)
    # a rank first binds its cores: the default thread count below is then the rank's share
    rank = launch.init_ranks(device.type, args.gpus) if launch.in_launch() else None
    agree = None
    if rank is not None:
        device = rank.device
        agree = functools.partial(launch.all_ok, rank)
        if rank.rank != 0:  # one voice: rank 0 prints and writes
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)
    threads = args.cpu_threads if args.cpu_threads is not None else TandemConfig().host.threads
    variants = make_variants(policies, args.set, threads)

    machine = bandwidth.machine_info(threads)
    cores = f"{machine['cores']} cores" + (f" a rank, {rank.world} ranks" if rank is not None else "")
    print(f"machine: {machine.get('gpu') or 'no GPU'}; {machine['cpu_model']} ({cores})", flush=True)
    launch.barrier()  # ranks measure together: each gets its share of the host's bandwidth
    bw = {"host_read_gbps": bandwidth.host_read_bandwidth(threads)}
    if device.type == "cuda":
        bw["hbm_gbps"] = bandwidth.hbm_bandwidth(device)
        bw["pcie_h2d_gbps"] = bandwidth.pcie_h2d_bandwidth(device)
    print("bandwidth (GB/s): " + ", ".join(f"{k[:-5]} {v:.1f}" for k, v in bw.items()), flush=True)

    model, model_info = _load(args, device, dtype, max(contexts), rank)
    freeze_heap()  # no full collection of the loaded model's heap inside a timed step
    from ...shapes import model_weight_bytes_per_step

    weight_bytes = model_weight_bytes_per_step(model)  # per GPU for a shard
    model_info.update(weight_bytes=weight_bytes, dtype=args.dtype, gpus=args.gpus)
    out_dir = Path(args.out)
    result = {"machine": machine, "bandwidth": bw, "model": model_info, "args": vars(args), "rows": []}
    if model_info["weights"] == "random":
        result["fluxion_replay"] = _replay_fluxion(variants, model, out_dir, rank)
    # the first configuration timed in a process runs slow on every step (allocator, kernel selection): pay
    # that once on a throwaway run
    baselines.run_hf_baseline(model, "dynamic", 1, min(contexts), 3, 2, seed=args.seed, agree=agree)
    kv_token_bytes = _kv_bytes_per_token(model, dtype) * args.gpus  # the host holds every rank's tier
    for context in contexts:
        for batch in batches:
            for system in hf_systems:
                row = _agreed_check(system, batch, context, args, kv_token_bytes, baselines, agree)
                if row is None:
                    row = baselines.run_hf_baseline(
                        model,
                        system[3:],
                        batch,
                        context,
                        args.steps,
                        args.warmup,
                        seed=args.seed,
                        agree=agree,
                    )
                _add(result, row, out_dir, rank)
            for variant, fill, handoff, forward in itertools.product(variants, fills, handoffs, forwards):
                label = variant.label if len(handoffs) == 1 else f"{variant.label}@{handoff}"
                label = label if len(forwards) == 1 else f"{label}/{forward}"
                label = label if len(fills) == 1 else f"{label}:{fill}"
                token_bytes = kv_token_bytes
                if variant.config.host.dtype:  # one byte per element (the block scales are ~0.2% more)
                    token_bytes = kv_token_bytes // _dtype_size(dtype)
                row = _agreed_check(f"tandem-{label}", batch, context, args, token_bytes, baselines, agree)
                if row is not None:
                    _add(result, row, out_dir, rank)
                    continue
                row = run_tandem(
                    model,
                    variant.config,
                    label,
                    batch,
                    context,
                    args.steps,
                    args.warmup,
                    fill=fill,
                    chunk_tokens=args.chunk_tokens,
                    use_graphs=False if args.no_graphs else "auto",
                    seed=args.seed,
                    handoff=handoff,
                    forward=forward,
                    agree=agree,
                )
                bandwidths = (bw.get("hbm_gbps"), bw["host_read_gbps"], bw.get("pcie_h2d_gbps"))
                row["bound_ms"] = bound_ms(row, weight_bytes, *bandwidths)
                row["serial_bound_ms"] = serial_bound_ms(row, weight_bytes, *bandwidths)
                for bound, ratio in (
                    ("bound_ms", "tpot_over_bound"),
                    ("serial_bound_ms", "tpot_over_serial"),
                ):
                    if row[bound]:
                        row[ratio] = row["tpot_median_ms"] / row[bound]
                _add(result, row, out_dir, rank)
    if rank is not None and rank.rank != 0:
        return 0
    paths = report.write_report(result, out_dir) + [manifest.write(out_dir)]
    print(report.format_table(result["rows"]))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _replay_fluxion(variants, model, out_dir: Path, rank=None) -> dict:
    """Random weights make fluxion's predictor meaningless: each fluxion variant instead replays the static
    per-head budgets and streaming labels its profile measured on a real model, mapped onto this shape
    (`tools.calibration.replay`). Says so, and returns what was replayed."""
    from ...models import attention_shape
    from ...policies.fluxion_profile import load_profile
    from ..calibration.replay import replay_profile, replay_summary

    shape = attention_shape(model.config.get_text_config(decoder=True))
    replays = {}
    for variant in variants:
        config = variant.config
        if config.policy != "fluxion" or config.fluxion.tau == 0:
            continue
        source = load_profile(config.fluxion.profile)
        safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in variant.label)
        safe += f"_rank{rank.rank}" if rank is not None else ""  # a shard's heads: its own profile
        path = out_dir / f"replayed_profile_{safe}.pt"
        replayed = replay_profile(source, *shape)
        replayed.save(path)
        config.fluxion = replace(config.fluxion, profile=str(path), mode="static")
        summary = replay_summary(replayed, replayed.tau_key(config.fluxion.tau))
        replays[variant.label] = dict(
            summary, source=source.meta.get("model"), tau=config.fluxion.tau, profile=str(path)
        )
        print(
            f"{variant.label}: random weights, so the predictor is off: replaying the static per-head budgets "
            f"calibrated on {source.meta.get('model')} (tau {config.fluxion.tau:g}; {100 * summary['streaming_share']:.0f}% "
            f"streaming heads, mean budget {100 * summary['mean_budget16']:.1f}% at 16-token blocks)",
            flush=True,
        )
    return replays


# host bytes per KV byte a system keeps in host memory: HF's offloaded cache holds more than one copy (the run the
# kernel's OOM killer ended: docs/engine.md § `tandem bench`); Tandem's host tier is the KV once, plus digests /
# MAW (at most ~1/8 more)
HOST_FACTOR = {"hf-offloaded": 2.0, "tandem": 1.15}


def _dtype_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _kv_bytes_per_token(model, dtype) -> int:
    from .baselines import kv_shape

    num_layers, num_kv_heads, head_dim = kv_shape(model.config)
    return 2 * num_layers * num_kv_heads * head_dim * _dtype_size(dtype)


def _agreed_check(system, batch, context, args, kv_token_bytes, baselines, agree) -> dict | None:
    """`_host_memory_check`, the same on every tensor-parallel rank: a row runs only where every rank's check
    let it (each reads the host's free memory at its own moment)."""
    row = _host_memory_check(system, batch, context, args, kv_token_bytes, baselines)
    if agree is None or agree(row is None) or row is not None:
        return row
    row = baselines.empty_row(system, batch, context, args.steps, args.warmup)
    row.update(status="oom", error="host memory: another rank's check found too little free (see its row)")
    return row


def _host_memory_check(system, batch, context, args, kv_token_bytes, baselines) -> dict | None:
    """An OOM row, without running, when the configuration's host memory cannot fit: the kernel's OOM killer
    would end the whole benchmark instead of raising."""
    factor = HOST_FACTOR.get(system, HOST_FACTOR["tandem"] if system.startswith("tandem") else 0.0)
    from ...cache.memory import available_host_bytes

    available = available_host_bytes()
    need = factor * batch * context * kv_token_bytes
    if not factor or available is None or need <= 0.9 * available:
        return None
    row = baselines.empty_row(system, batch, context, args.steps, args.warmup)
    row["status"] = "oom"
    row["error"] = (
        f"host memory: needs about {need / 1e9:.0f} GB, {available / 1e9:.0f} GB available (checked before "
        "running: the kernel's OOM killer would end the whole run)"
    )
    return row


def _add(result: dict, row: dict, out_dir: Path, rank=None) -> None:
    if rank is not None:
        if row["status"] != "ok" and row.get("filled"):
            # failed past the agreed fill (a decode step): the other ranks are inside a collective this rank
            # will not join, so no later row could run; the rows so far stay in bench.partial.json
            raise RuntimeError(
                f"{row['system']} b{row['batch']} {row['context']} failed on rank {rank.rank} after the ranks filled "
                f"their caches ({row.get('error')}); the ranks' collectives are out of step, so the run ends here"
            )
        from ...distributed.launch import merged_row

        row = merged_row(rank, row)
    result["rows"].append(row)
    if rank is not None and rank.rank != 0:
        return
    shown = (
        "OOM"
        if row["status"] == "oom"
        else row["error"]
        if row["status"] == "error"
        else (
            f"{row['tpot_median_ms']:.2f} ms/token (p90 {row['tpot_p90_ms']:.2f}, p99 {row['tpot_p99_ms']:.2f}, "
            f"max {row['tpot_max_ms']:.2f}), {row['tokens_per_s']:.1f} tokens/s"
        )
    )
    extra = ""
    if row.get("attended_fraction") is not None:
        extra = f", attended {100 * row['attended_fraction']:.1f}%"
    if row.get("tpot_over_bound"):
        extra += f", {row['tpot_over_bound']:.2f}x bound"
    print(f"{row['system']:>24} b{row['batch']} {row['context']:>7}: {shown}{extra}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.partial.json").write_text(json.dumps(result, indent=1, default=str))
