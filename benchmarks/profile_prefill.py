"""Where a long prompt's prefill time goes on the GPU: Tandem's chunked prefill under torch's CUDA profiler, its
kernels by kind against the wall time and against the prompt's FLOPs at the matmul rate measured in the same run
(GPU host; random weights of a real shape).

Per context: the prefill twice without the profiler, the first with a new host tier (its stores mapped and
page-locked: what a process's first request of that size pays), the second with the first's freed stores from the
host pool (`cache.memory.HostPool`, as `tandem serve` keeps them; `--no-host-pool` maps them again), then once more
under the profiler. From the profile: each kind of kernel's device seconds (the attention kernel, the matmuls, the
copies each way, the rest), the seconds the device sat idle within the prefill, and the host calls that took the
most time (page-locking the host tier among them); the attention kernel's and the matmuls' rates as fractions of
the measured matmul rate, from the prompt's FLOPs (`shapes.prefill_flops`).

    python benchmarks/profile_prefill.py --model llama-3.1-8b --contexts 32k:16k,128k:16k --out <dir>

Prints and saves profile.json / profile.md, each context's host-call table, and a manifest naming the commit.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tandem import TandemCache, TandemConfig, manifest
from tandem.cache import memory
from tandem.engine import TandemRunner
from tandem.shapes import build_random_model, prefill_flops
from tandem.tools.bench.bandwidth import matmul_rate

ATTENTION = "attention kernel"
KINDS = (ATTENTION, "matmuls", "copies host->device", "copies device->host", "other Triton", "other torch")


def kind(name: str) -> str:
    """The kind of a profiled device activity, by its kernel or copy name."""
    n = name.lower()
    if "prefill_attention" in n:
        return ATTENTION
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "matmuls"
    if "memcpy" in n:
        return "copies device->host" if "dtoh" in n else "copies host->device"
    if n.endswith("_kernel") and "::" not in n:
        return "other Triton"
    return "other torch"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start, end) intervals in microseconds."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total, end = total + stop - start, stop
        elif stop > end:
            total, end = total + stop - end, stop
    return total / 1e6


def prefill_seconds(model, ids: torch.Tensor, chunk: int) -> float:
    runner = TandemRunner(model, TandemCache.for_model(model, TandemConfig(policy="quest")))
    torch.cuda.synchronize()
    start = time.perf_counter()
    runner.prefill(ids, chunk_tokens=chunk, max_new_tokens=2)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del runner
    gc.collect()  # the cache freed now, its stores back in the pool, not inside the next run
    return seconds


def profiled(model, ids: torch.Tensor, chunk: int, out: Path) -> dict:
    """The prefill under the profiler: device seconds by kind, idle seconds, the top host calls (saved)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = prefill_seconds(model, ids, chunk)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    by_kind, launches = collections.defaultdict(float), collections.Counter()
    for e in device:
        by_kind[kind(e["name"])] += e["dur"] / 1e6
        launches[kind(e["name"])] += 1
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    span = (max(s for _, s in spans) - min(s for s, _ in spans)) / 1e6
    busy = busy_seconds(spans)
    host_calls = {}
    for avg in prof.key_averages():
        if avg.self_cpu_time_total > 0.02 * seconds * 1e6:
            host_calls[avg.key] = {"seconds": avg.self_cpu_time_total / 1e6, "calls": avg.count}
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    (out / f"host_calls_{ids.shape[1]}.txt").write_text(table)
    return {
        "seconds_profiled": seconds,
        "device_seconds": {k: by_kind.get(k, 0.0) for k in KINDS},
        "launches": {k: launches.get(k, 0) for k in KINDS},
        "device_busy_seconds": busy,
        "device_idle_seconds": span - busy,
        "host_calls": dict(sorted(host_calls.items(), key=lambda kv: -kv[1]["seconds"])),
    }


def markdown(machine: dict, args, rows: list[dict]) -> str:
    rate = machine["matmul_tflops"]
    lines = [
        f"# Where a prefill's time goes: {args.model} (random bf16 weights), {machine['gpu']}",
        "",
        f"Tandem's chunked prefill (quest), bf16 matmul rate measured in this run {rate:.0f} TFLOP/s. New host "
        "tier: the stores mapped and page-locked for this request; "
        f"{'pooled: the freed stores of the run before, from the host pool' if args.host_pool else 'again: the pool off'}. "
        "Device seconds by kind from one profiled prefill (with the pool as in the second run).",
        "",
        "| context | chunk | new host tier | " + ("pooled" if args.host_pool else "again") + " | FLOPs time "
        "| x FLOPs time | attention kernel | its rate | matmuls | their rate | copies in / out | device idle "
        "| page-locking | GPU peak |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = r["device_seconds"]
        locking = sum(v["seconds"] for k, v in r["host_calls"].items() if k == "cudaHostRegister")
        lines.append(
            f"| {r['context']} | {r['chunk']} | {r['seconds_new']:.2f} s | {r['seconds_again']:.2f} s | "
            f"{r['flops_seconds']:.2f} s | {r['x_flops_time']:.2f}x | {d[ATTENTION]:.2f} s | "
            f"{r['attention_rate']:.2f} | {d['matmuls']:.2f} s | {r['matmul_rate']:.2f} | "
            f"{d['copies host->device']:.2f} / {d['copies device->host']:.2f} s | "
            f"{r['device_idle_seconds']:.2f} s | {locking:.2f} s | {r['gpu_peak_gb']:.1f} GB |"
        )
    lines += [
        "",
        "x FLOPs time: the second run's seconds over the FLOPs time. Rates: FLOPs over device seconds, as a "
        "fraction of the matmul rate (the attention kernel's from the causal attention's FLOPs, the matmuls' from "
        "the projections' and the LM head's). Device idle: within the profiled prefill, no kernel or copy running. "
        "Page-locking: `cudaHostRegister` on the host, in the profiled run.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a shape of `tandem.shapes`")
    p.add_argument("--contexts", default="32k:16k,128k:16k", help="comma list of context:chunk")
    p.add_argument("--no-host-pool", dest="host_pool", action="store_false", help="map every host tier anew")
    p.add_argument("--out", default="prefill_profile")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py profiles the GPU path: it needs CUDA")

    def tokens(text: str) -> int:
        return int(float(text[:-1]) * 1024) if text.lower().endswith("k") else int(text)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.host_pool:
        memory.enable_host_pool()
    model = build_random_model(args.model, "cuda", torch.bfloat16)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 1 << 20)
    machine = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    machine["matmul_tflops"] = rate = matmul_rate("cuda", torch.bfloat16)
    print(json.dumps(machine), flush=True)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = []
    with torch.inference_mode():
        prefill_seconds(
            model, torch.randint(0, vocab, (1, 8192), generator=gen).cuda(), 4096
        )  # kernel builds
        for spec in args.contexts.split(","):
            context, chunk = (tokens(x) for x in spec.split(":"))
            ids = torch.randint(0, vocab, (1, context), generator=gen).cuda()
            if args.host_pool:
                memory.host_pool().trim()  # the first run maps its stores anew
            new = prefill_seconds(model, ids, chunk)
            torch.cuda.reset_peak_memory_stats()
            again = prefill_seconds(model, ids, chunk)
            peak = torch.cuda.max_memory_allocated() / 1e9
            flops = prefill_flops(model.config, 0, context)
            row = {"context": context, "chunk": chunk, "seconds_new": new, "seconds_again": again}
            row.update(profiled(model, ids, chunk, out))
            d = row["device_seconds"]
            row.update(
                gpu_peak_gb=peak,
                flops=flops["total"],
                flops_seconds=flops["total"] / (rate * 1e12),
                x_flops_time=again / (flops["total"] / (rate * 1e12)),
                attention_rate=flops["attention"] / d[ATTENTION] / (rate * 1e12) if d[ATTENTION] else 0.0,
                matmul_rate=flops["linear"] / d["matmuls"] / (rate * 1e12) if d["matmuls"] else 0.0,
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = markdown(machine, args, rows)
    print(text)
    manifest.write(out)
    (out / "profile.json").write_text(
        json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=1)
    )
    (out / "profile.md").write_text(text)


if __name__ == "__main__":
    main()
