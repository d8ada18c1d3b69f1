"""Benchmark of Tandem's compiled CPU kernels against the host's measured memory read bandwidth.

One run measures the read bandwidth (a STREAM-like read of a 2 GiB buffer, same thread count), then for
the Llama-3.1-8B layer shape (32 query / 8 KV heads, head_dim 128, bf16) times
  * sparse attention (kernel 1) at each context x budget x selection (token rows, blocks of 16 / 64) x
    batch, against the torch-gather reference, with caches flushed before every timed call;
  * block scoring + top-k (kernel 2) over all 16-token digests, at logical blocks of 16 and 64.
It prints a table (ms per layer, GB/s, % of measured read bandwidth, speedup over torch) and writes
benchmarks/results/cpu_attention_<machine>.{json,md}. This is a program, not a test.

    python benchmarks/bench_cpu_attention.py                                 # the full grid
    python benchmarks/bench_cpu_attention.py --contexts 32k --batches 1      # a small machine
    python benchmarks/bench_cpu_attention.py --sweep                         # prefetch / ISA sweep only

Run from the repository root; where tandem is not installed, with PYTHONPATH=. set.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from tandem.bench.bandwidth import host_read_bandwidth, machine_info, machine_slug
from tandem.kernels import cpu, reference
from tandem.kernels.cpu import _library

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
PHYSICAL_BLOCK = 16  # digest granularity of the host cache
FLUSH_BYTES = 1 << 30  # over 3x the largest LLC we run on (300 MiB): each timed call starts from DRAM
HUGE_PAGE = 2 << 20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", default="32k,128k", help="tokens per request, e.g. 32k,128k")
    p.add_argument("--budgets", default="0.02,0.05,0.1", help="fraction of the context attended")
    p.add_argument("--selections", default="token,block16,block64", help="token | blockN")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--threads", type=int, default=None, help="default: all cores but one")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=10, help="timed calls per kernel row (median)")
    p.add_argument("--torch-reps", type=int, default=3, help="timed calls of the torch baseline")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    p.add_argument("--sweep", action="store_true", help="only sweep prefetch settings and ISAs")
    p.add_argument("--huge-pages", action="store_true", help="back the KV store with transparent huge pages")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default=None, help="machine name in the file names (default: from the CPU)")
    p.add_argument("--note", default="", help="a line of context written into the .md (e.g. machine load)")
    return p.parse_args()


def tokens(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def timed(fn, reps: int, flush=None) -> float:
    """Median seconds of `fn()` over `reps` calls after one warm-up, `flush()` before each call."""
    fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def empty(shape, dtype: torch.dtype, huge: bool) -> torch.Tensor:
    """torch.empty, optionally madvise(MADV_HUGEPAGE)d before first touch (THP in "madvise" mode)."""
    t = torch.empty(shape, dtype=dtype)
    if huge:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            if libc.madvise(start, end - start, 14) != 0:  # MADV_HUGEPAGE
                print(f"madvise(MADV_HUGEPAGE) failed: errno {ctypes.get_errno()}")
    return t


def make_store(batch: int, context: int, dtype: torch.dtype, huge: bool = False):
    # random rows repeated along the context: real values (never zeros) without minutes of RNG
    base = torch.randn(batch, NUM_KV_HEADS, 4096, HEAD_DIM).to(dtype)
    k = empty((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype, huge)
    v = empty((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype, huge)
    for start in range(0, context, 4096):
        n = min(4096, context - start)
        k[:, :, start : start + n] = base[:, :, :n]
        v[:, :, start : start + n] = base[:, :, :n].flip(-1)
    return k, v


def make_selection(batch: int, units: int, count: int, gen: torch.Generator) -> torch.Tensor:
    # sorted distinct ids per (request, KV head), as the selection policies produce them
    picks = [torch.randperm(units, generator=gen)[:count].sort().values for _ in range(batch * NUM_KV_HEADS)]
    return torch.stack(picks).view(batch, NUM_KV_HEADS, count)


def attention_rows(args, threads, bandwidth, flush, gen) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    for context in map(tokens, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            k, v = make_store(batch, context, dtype, args.huge_pages)
            q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
            scale = HEAD_DIM**-0.5
            for budget in map(float, args.budgets.split(",")):
                for selection in args.selections.split(","):
                    block = None if selection == "token" else int(selection.removeprefix("block"))
                    units = context // (block or 1)
                    count = max(1, round(budget * units))
                    idx = make_selection(batch, units, count, gen)
                    lengths = torch.full((batch, NUM_KV_HEADS), count)
                    row_count = count * (block or 1)
                    nbytes = batch * NUM_KV_HEADS * (row_count * HEAD_DIM * k.element_size() * 2 + count * 8)

                    call = (q, k, v, idx, lengths, scale)
                    native = functools.partial(
                        cpu.sparse_attention_lse, *call, block_size=block, num_threads=threads
                    )
                    baseline = functools.partial(reference.sparse_attention_lse, *call, block_size=block)
                    native_s = timed(native, args.reps, flush)
                    torch_s = None if args.no_torch else timed(baseline, args.torch_reps, flush)
                    label = (context, batch, budget, selection, row_count, nbytes)
                    rows.append(row("attention", *label, native_s, torch_s, bandwidth))
                    print_row(rows[-1])
            del k, v
    return rows


def scoring_rows(args, threads, bandwidth, flush, gen) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    for context in map(tokens, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            num_blocks = context // PHYSICAL_BLOCK
            center = torch.randn(batch, NUM_KV_HEADS, num_blocks, HEAD_DIM, generator=gen)
            key_min, key_max = (center - 0.5).to(dtype), (center + 0.5).to(dtype)
            q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
            nbytes = 2 * key_min.numel() * key_min.element_size()
            for logical in (16, 64):
                factor = logical // PHYSICAL_BLOCK
                top = max(1, round(0.05 * num_blocks / factor))

                call = (q, key_min, key_max, top, factor)
                native_s = timed(
                    functools.partial(cpu.score_topk, *call, num_threads=threads), args.reps, flush
                )
                baseline = functools.partial(torch_score_topk, *call)
                torch_s = None if args.no_torch else timed(baseline, args.torch_reps, flush)
                label = (context, batch, None, f"block{logical}", num_blocks // factor, nbytes)
                rows.append(row("score+top5%", *label, native_s, torch_s, bandwidth))
                print_row(rows[-1])
    return rows


def torch_score_topk(q, key_min, key_max, k, factor):
    scores = reference.block_scores(q, *reference.coarsen_digest(key_min, key_max, factor))
    return reference.topk_blocks(scores, k)


def row(kernel, context, batch, budget, selection, units, nbytes, native_s, torch_s, bandwidth) -> dict:
    gbps = nbytes / native_s / 1e9
    return {
        "kernel": kernel,
        "context": context,
        "batch": batch,
        "budget": budget,
        "selection": selection,
        "rows_per_head": units,
        "mbytes": round(nbytes / 1e6, 2),
        "ms": round(native_s * 1e3, 4),
        "gbps": round(gbps, 2),
        "pct_read_bw": round(100 * gbps / bandwidth, 1),
        "torch_ms": None if torch_s is None else round(torch_s * 1e3, 3),
        "speedup": None if torch_s is None else round(torch_s / native_s, 1),
    }


HEADER = (
    "| kernel | context | batch | budget | selection | rows/head | MB | ms | GB/s | % read BW | torch ms "
    "| speedup |"
)


def format_row(r: dict) -> str:
    budget = "all" if r["budget"] is None else f"{100 * r['budget']:g}%"
    torch_ms = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.2f}"
    speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
    return (
        f"| {r['kernel']} | {r['context'] // 1024}K | {r['batch']} | {budget} | {r['selection']} | "
        f"{r['rows_per_head']} | {r['mbytes']:.1f} | {r['ms']:.3f} | {r['gbps']:.1f} | "
        f"{r['pct_read_bw']:.0f}% | {torch_ms} | {speedup} |"
    )


def print_row(r: dict) -> None:
    print(format_row(r), flush=True)


# rows ahead, locality hint (-1 = none, 1 = prefetcht2, 3 = prefetcht0), bytes between prefetched lines
SWEEP_PREFETCH = ("0,-1,64", "32,1,64", "64,1,64", "64,1,128", "96,1,64", "96,1,128", "128,1,64", "128,1,128",
                  "192,1,64", "192,1,128", "64,3,64", "128,3,128")  # fmt: skip


def sweep(args, threads, bandwidth, flush, gen) -> dict:
    """Prefetch setting x ISA x page size at the target shape (128K, 5%, token rows), per batch, and the
    compute cost per row with the rows in cache. Returns the runs and the best setting per page size."""
    dtype = getattr(torch, args.dtype)
    context = tokens(args.contexts.split(",")[-1])
    default_isa = cpu.isa()
    runs, totals, isa_totals = [], {}, {}

    def measure(label, call, nbytes, nrows, nthreads, reps):
        sec = timed(call, reps, flush)
        gbps = nbytes / sec / 1e9
        ns_row = sec * 1e9 * nthreads / nrows
        runs.append(
            {**label, "threads": nthreads, "ms": sec * 1e3, "gbps": gbps, "ns_per_row_thread": ns_row}
        )
        print(f"sweep {label} threads={nthreads}: {sec * 1e3:.3f} ms {gbps:.1f} GB/s "
              f"{100 * gbps / bandwidth:.0f}% {ns_row:.0f} ns/row/thread", flush=True)  # fmt: skip
        return sec

    for huge in (False, True):
        for batch in map(int, args.batches.split(",")):
            k, v = make_store(batch, context, dtype, huge)
            q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
            count = round(0.05 * context)
            idx = make_selection(batch, context, count, gen)
            lengths = torch.full((batch, NUM_KV_HEADS), count)
            nbytes = batch * NUM_KV_HEADS * count * (HEAD_DIM * k.element_size() * 2 + 8)
            call = functools.partial(
                cpu.sparse_attention_lse, q, k, v, idx, lengths, 0.1, num_threads=threads
            )
            for isa in cpu.supported_isas()[2:]:
                os.environ["TANDEM_CPU_ISA"] = isa
                for config in SWEEP_PREFETCH:
                    os.environ["TANDEM_CPU_PREFETCH"] = config
                    label = {"batch": batch, "huge_pages": huge, "isa": isa, "prefetch": config}
                    sec = measure(label, call, nbytes, batch * NUM_KV_HEADS * count, threads, args.reps)
                    if isa == default_isa:
                        totals[(huge, config)] = totals.get((huge, config), 0.0) + sec
                    isa_totals[(huge, isa, config)] = isa_totals.get((huge, isa, config), 0.0) + sec
            del k, v, call
    best = {
        huge: min((c for h, c in totals if h == huge), key=lambda c: totals[(huge, c)]) for huge in (0, 1)
    }
    # compute per row with K/V in cache: 512 rows per head, each attended 13 times
    os.environ["TANDEM_CPU_PREFETCH"] = best[False]
    k, v = make_store(1, 512, dtype)
    q = torch.randn(1, NUM_Q_HEADS, 1, HEAD_DIM)
    idx = torch.arange(512).repeat(13).view(1, 1, -1).expand(1, NUM_KV_HEADS, -1).contiguous()
    lengths = torch.full((1, NUM_KV_HEADS), idx.shape[-1])
    for isa in cpu.supported_isas()[1:]:
        os.environ["TANDEM_CPU_ISA"] = isa
        for nthreads in (1, threads):
            call = functools.partial(
                cpu.sparse_attention_lse, q, k, v, idx, lengths, 0.1, num_threads=nthreads
            )
            label = {"batch": 1, "hot": True, "isa": isa, "prefetch": best[False]}
            measure(label, call, idx.numel() * HEAD_DIM * 4, idx.numel(), nthreads, 20)
    os.environ.pop("TANDEM_CPU_ISA")
    os.environ.pop("TANDEM_CPU_PREFETCH")
    # the faster AVX-512 level at the best setting (to compare bf16-specific code with the AVX-512F path)
    best_isa = min(cpu.supported_isas()[2:], key=lambda i: isa_totals[(False, i, best[False])])
    return {
        "runs": runs,
        "best_prefetch": best[False],
        "best_prefetch_huge_pages": best[True],
        "best_isa": best_isa,
    }


def main() -> None:
    args = parse_args()
    if not cpu.is_available():
        raise SystemExit(f"CPU kernels unavailable: {_library.unavailable_reason()}")
    threads = args.threads or _library.default_num_threads()
    torch.set_num_threads(threads)  # the torch baseline gets the same cores
    info = machine_info(threads)
    print(json.dumps(info), flush=True)
    bandwidth = host_read_bandwidth(threads)
    print(f"measured read bandwidth ({threads} threads, 2 GiB): {bandwidth:.1f} GB/s", flush=True)
    flush_buffer = torch.ones(FLUSH_BYTES // 4)

    def flush():
        cpu.read_sum(flush_buffer, num_threads=threads)

    gen = torch.Generator().manual_seed(0)
    if args.sweep:
        result = {
            "machine": info,
            "read_bandwidth_gbps": bandwidth,
            **sweep(args, threads, bandwidth, flush, gen),
        }
        out = Path(args.out_dir) / f"cpu_attention_sweep_{args.name or machine_slug(info)}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"best prefetch: {result['best_prefetch']} (huge pages: {result['best_prefetch_huge_pages']}), "
              f"best isa: {result['best_isa']}; wrote {out}")  # fmt: skip
        return
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    rows = attention_rows(args, threads, bandwidth, flush, gen) + scoring_rows(
        args, threads, bandwidth, flush, gen
    )

    name = args.name or machine_slug(info) + ("-thp" if args.huge_pages else "")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"machine": info, "read_bandwidth_gbps": round(bandwidth, 2), "dtype": args.dtype,
              "huge_pages": args.huge_pages, "note": args.note, "rows": rows}  # fmt: skip
    (out_dir / f"cpu_attention_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# CPU kernels on {info['cpu_model']} ({info['cores']} cores, host `{info['hostname']}`)",
        "",
        f"Threads {threads}, ISA `{info['isa']}`, prefetch {info['prefetch']}, {args.dtype} KV "
        f"({'transparent huge pages' if args.huge_pages else '4 KiB pages'}), torch "
        f"{info['torch']}, {info['compiler']}. Measured read bandwidth: **{bandwidth:.1f} GB/s** "
        "(2 GiB read, same threads). Llama-3.1-8B layer: 32 q / 8 KV heads, head_dim 128; caches flushed "
        "before every timed call; medians. MB = K+V rows (+ ids) read for attention, all min+max digests "
        "for scoring. Speedup is over the torch-gather reference (`tandem.kernels.reference`).",
        "",
        *([args.note, ""] if args.note else []),
        HEADER,
        "|" + "---|" * (HEADER.count("|") - 1),
        *(format_row(r) for r in rows),
        "",
    ]
    (out_dir / f"cpu_attention_{name}.md").write_text("\n".join(lines))
    print(f"wrote {out_dir}/cpu_attention_{name}.json and .md")


if __name__ == "__main__":
    main()
