"""Where a batch-1 sparse-attention call's time goes, against the time the read-bandwidth target allows.

For one request of the Llama-3.1-8B layer shape (32 q / 8 KV heads, d=128, bf16) at `--context` tokens, token
rows and 16- / 64-token blocks, through `cpu.PreparedAttention` (the decode path's call), one run measures:

  * cold: rows from DRAM (calls rotate over layers' stores, as `bench_cpu_attention.py` does), at --budget;
  * hot: the same call repeated, its rows in cache: what the call costs without DRAM, at 1, 2, 4, 8 threads and
    the default count. Where hot at the default count is close to the `target ms` (the time in which the call
    would read its bytes at `--target` of the read bandwidth measured next to it), the target cannot be met
    by better prefetching: the instructions alone take that long;
  * a budget sweep (1-20%): the slope is the marginal rate (GB/s) and the intercept the call's fixed cost;
  * an empty call (no rows): the thread team, the query layout and the merge.

It prints a table and writes cpu_attention_limits_<machine>.{json,md} under --out-dir. A program, not a test.

    python benchmarks/bench_cpu_attention_limits.py                    # 128K, 5%, the GPU host's shape
    python benchmarks/bench_cpu_attention_limits.py --context 16k      # a small machine
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from bench_cpu_attention import (  # this folder is on sys.path when run as a script
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    ReadProbe,
    make_selections,
    make_store,
    prepared_calls,
    timed,
    tokens,
)

from tandem import manifest
from tandem.kernels import cpu
from tandem.kernels.cpu import _library
from tandem.tools.bench.bandwidth import machine_info, machine_slug

SELECTIONS = (("token", None), ("block16", 16), ("block64", 64))
SWEEP_BUDGETS = (0.01, 0.02, 0.05, 0.1, 0.2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", default="128k", help="tokens of the request (default 128k)")
    p.add_argument(
        "--budget", type=float, default=0.05, help="fraction attended in the main rows (default 0.05)"
    )
    p.add_argument("--target", type=float, default=0.7, help="fraction of the read bandwidth aimed for (0.7)")
    p.add_argument("--stores", type=int, default=24, help="layers' stores the cold calls rotate over (24)")
    p.add_argument("--reps", type=int, default=96, help="timed calls per cold row (median)")
    p.add_argument(
        "--layout",
        choices=["separate", "interleaved"],
        default="separate",
        help="K and V in two stores, as the host tier keeps them (default), or each token's K row next to its V "
        "row in one buffer (a layout experiment: token rows then read 512 contiguous bytes)",
    )
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default=None, help="machine name in the file names (default: from the CPU)")
    args = p.parse_args()
    if not 0 < args.budget <= 1 or not 0 < args.target <= 1:
        p.error(f"--budget and --target must be in (0, 1], got {args.budget} and {args.target}")
    if args.stores < 2:
        p.error(f"--stores must be at least 2, got {args.stores}")
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    try:
        args.tokens = tokens(args.context)
    except ValueError:
        p.error(f"--context must be a token count such as 131072 or 128k, got {args.context!r}")
    if args.tokens < 1024:  # below, the sweep's 64-token selections are all one block: no slope to fit
        p.error(f"--context must be at least 1k tokens, got {args.context!r}")
    return args


def main() -> None:
    args = parse_args()
    if not cpu.is_available():
        raise SystemExit(f"CPU kernels unavailable: {_library.unavailable_reason()}")
    threads = _library.default_num_threads()
    info = machine_info(threads)
    print(json.dumps(info), flush=True)
    context = args.tokens
    probe = ReadProbe(threads)
    gen = torch.Generator().manual_seed(0)
    stores = [
        make_store(1, context, torch.bfloat16, True, args.layout == "interleaved") for _ in range(args.stores)
    ]
    q = torch.randn(1, NUM_Q_HEADS, 1, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    thread_counts = sorted({n for n in (1, 2, 4, 8) if n < threads} | {threads})

    def calls_at(budget: float, block: int | None, nthreads: int) -> tuple[list, float]:
        units = context // (block or 1)
        count = max(1, round(budget * units))
        selections = make_selections(1, units, count, 2, gen)
        lengths = torch.full((1, NUM_KV_HEADS), count)
        calls = [(q, k, v, idx, lengths, scale) for idx in selections for k, v in stores]
        mb = NUM_KV_HEADS * count * (block or 1) * HEAD_DIM * 4 / 1e6  # K + V rows, bf16
        return prepared_calls(calls, block, nthreads), mb

    rows, sweeps = [], []
    for selection, block in SELECTIONS:
        prepared, mb = calls_at(args.budget, block, threads)
        cold_ms, bandwidth = probe.around(lambda prepared=prepared: timed(prepared, args.reps) * 1e3)
        hot = {}
        for n in thread_counts:
            one, _ = calls_at(args.budget, block, n)
            hot[n] = timed([one[0]], 50 if n > 2 else 20) * 1e3
        target_ms = mb / (args.target * bandwidth)
        rows.append({
            "selection": selection, "mb": round(mb, 2), "read_bw_gbps": round(bandwidth, 1),
            "cold_ms": round(cold_ms, 4), "cold_gbps": round(mb / cold_ms, 1),
            "pct_read_bw": round(100 * mb / cold_ms / bandwidth, 1), "target_ms": round(target_ms, 4),
            "hot_ms": {str(n): round(t, 4) for n, t in hot.items()},
            "hot_share_of_target": round(hot[threads] / target_ms, 2),
            "hot_speedup_1_to_all": round(hot[thread_counts[0]] / hot[threads], 2),
        })  # fmt: skip
        points = []
        for budget in SWEEP_BUDGETS:
            prepared, mb_b = calls_at(budget, block, threads)
            points.append((mb_b, timed(prepared, args.reps) * 1e3))
        slope, intercept = statistics.linear_regression(*zip(*points))
        sweeps.append({
            "selection": selection, "points_mb_ms": [[round(x, 2), round(y, 4)] for x, y in points],
            "marginal_gbps": round(1 / slope, 1), "intercept_us": round(intercept * 1e3, 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), json.dumps(sweeps[-1]), flush=True)
    lengths0 = torch.zeros(1, NUM_KV_HEADS, dtype=torch.int64)
    k, v = stores[0]
    empty = prepared_calls(
        [(q, k, v, make_selections(1, context, 1, 1, gen)[0], lengths0, scale)], None, threads
    )
    empty_us = timed(empty, 200) * 1e6
    low, high = min(probe.seen), max(probe.seen)

    name = (args.name or machine_slug(info)) + ("_interleaved" if args.layout == "interleaved" else "")
    out_dir = Path(args.out_dir)
    manifest.write(out_dir, name=f"cpu_attention_limits_{name}.manifest.json")
    result = {"machine": info, "layout": args.layout, "context": context, "budget": args.budget, "target": args.target,
              "probe_range_gbps": [round(low, 1), round(high, 1)], "empty_call_us": round(empty_us, 1),
              "rows": rows, "budget_sweep": sweeps}  # fmt: skip
    (out_dir / f"cpu_attention_limits_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    hot_cols = " | ".join(f"hot {n}t ms" for n in thread_counts)
    lines = [
        f"# Batch-1 sparse attention against its time budget, {info['cpu_model']} ({info['cores']} cores)",
        "",
        f"One request, {args.context} tokens, {100 * args.budget:g}% attended, Llama-3.1-8B layer (32 q / 8 KV "
        f"heads, d=128, bf16 on huge pages, {args.layout} K / V), `cpu.PreparedAttention`, {threads} threads "
        f"unless a column says otherwise, ISA `{info['isa']}`, prefetch {info['prefetch']}. `cold`: rows from DRAM "
        f"(calls rotate over {args.stores} stores and 2 disjoint selections), median of {args.reps}; MB: the K + V "
        f"rows read; `read BW`: the best of a 1 GiB read just before and just after the row (this run "
        f"{low:.0f}-{high:.0f} GB/s); `target ms`: the time in which the call reads its MB at "
        f"{100 * args.target:g}% of that; `hot`: the same call repeated, its rows in cache. Empty call (no rows): "
        f"{empty_us:.1f} us.",
        "",
        f"| selection | MB | read BW GB/s | cold ms | GB/s | % read BW | target ms | {hot_cols} | hot / target |",
        "|" + "---|" * (8 + len(thread_counts)),
        *(
            f"| {r['selection']} | {r['mb']:.1f} | {r['read_bw_gbps']:.0f} | {r['cold_ms']:.3f} | "
            f"{r['cold_gbps']:.1f} | {r['pct_read_bw']:.0f}% | {r['target_ms']:.3f} | "
            + " | ".join(f"{r['hot_ms'][str(n)]:.3f}" for n in thread_counts)
            + f" | {r['hot_share_of_target']:.2f} |"
            for r in rows
        ),
        "",
        "Budget sweep ("
        + ", ".join(f"{100 * b:g}%" for b in SWEEP_BUDGETS)
        + ", cold): a line through (MB, ms).",
        "",
        "| selection | marginal GB/s | intercept us |",
        "|---|---|---|",
        *(f"| {s['selection']} | {s['marginal_gbps']:.1f} | {s['intercept_us']:.1f} |" for s in sweeps),
        "",
    ]
    (out_dir / f"cpu_attention_limits_{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out_dir}/cpu_attention_limits_{name}.json and .md")


if __name__ == "__main__":
    main()
