"""Benchmark of Tandem's compiled CPU kernels against the host's measured memory read bandwidth.

One run measures the read bandwidth (a STREAM-like read of a 2 GiB buffer, same thread count), then for
the Llama-3.1-8B layer shape (32 query / 8 KV heads, head_dim 128) times
  * sparse attention (kernel 1) at each row format x thread count x context x budget x selection (token rows,
    blocks of 16 / 64) x batch, against the torch-gather reference. Row formats: the model dtype (bf16 by
    default) and the host tier's 8-bit rows (`--row-formats int8,fp8`: codes plus one float32 scale per 16-row
    block for K and for V, made by `reference.quantize_blocks` and passed to the same compiled calls, as
    `tandem.cache.host.HostTier` stores and hands them);
  * block scoring + top-k (kernel 2) over all 16-token digests, at logical blocks of 16 and 64.
It prints a table (ms per layer, GB/s, % of measured read bandwidth, speedup over torch) and writes
benchmarks/results/cpu_attention_<machine>.{json,md}. This is a program, not a test.

Every timed call reads its K/V (or digests) from DRAM, as a decode step does. By default (`--cold layers`)
each call reads another of several layers' stores (up to the 32 of the 8B model, within `--store-gib`), and
within a store a selection disjoint from its earlier ones, so that at least twice the last-level cache of
other rows is read before any row is read again; the code, the call's small arguments and the thread team
stay warm, as between the layers of a step. `--cold flush` instead reads 1 GiB through the cache before
every call, which also evicts the interpreter and the kernel's own state (the method of the results before
2026-11-26, slower per call than a decode step's: docs/cpu-kernels.md § How it is measured). Stores and digests are allocated like the host
tier's (`tandem.cache.memory`, on transparent huge pages unless `--pages 4k`).

    python benchmarks/bench_cpu_attention.py                                 # the full grid
    python benchmarks/bench_cpu_attention.py --contexts 32k --batches 1      # a small machine
    python benchmarks/bench_cpu_attention.py --kernels score                 # kernel 2's rows only
    python benchmarks/bench_cpu_attention.py --sweep                         # prefetch / ISA sweep only
    python benchmarks/bench_cpu_attention.py --kernels attention --row-formats bfloat16,int8,fp8 \
        --threads 15,7 --shapes 32k:1,32k:16,128k:1 --budgets 0.05 --selections token,block16
                                                        # the rates `tandem simulate`'s host model reads

Each attention row carries its `row_format` and `threads`, and `kv_gbps`: the K+V row bytes it attended (in the
row format, without ids or scales) per second of the prepared call, the rate the host-step model divides by.

Run from the repository root; where tandem is not installed, with PYTHONPATH=. set.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch

from tandem import manifest
from tandem.cache.memory import host_zeros
from tandem.kernels import cpu, reference
from tandem.kernels.cpu import _library
from tandem.kernels.reference import QUANT_DTYPES, quantize_blocks
from tandem.tools.bench.bandwidth import (
    host_read_bandwidth,
    last_level_cache_bytes,
    machine_info,
    machine_slug,
    read_bandwidth,
)

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
PHYSICAL_BLOCK = 16  # digest granularity of the host cache, and the rows per scale of its 8-bit formats
# the host tier's row formats: a float dtype stores rows as they are; "int8" / "fp8" store 8-bit codes and scales
ROW_FORMATS = ("bfloat16", "float16", "float32", *QUANT_DTYPES)
FLUSH_BYTES = 1 << 30  # over 3x the largest LLC we run on (300 MiB): each timed call starts from DRAM
PROBE_BYTES = 1 << 30
MODEL_LAYERS = 32  # Llama-3.1-8B: a decode step reads this many layers' stores
COLD_TEXT = {
    "layers": "each timed call reads another layer's store (and, within a store, a selection disjoint from "
    "its earlier ones: stores x selections per row in the JSON's `rotation`), so its rows come from DRAM while "
    f"code and arguments stay warm, as between the layers of a decode step (LLC {last_level_cache_bytes() >> 20} "
    "MiB)",
    "flush": "all caches flushed (1 GiB read) before every timed call",
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--kernels",
        default="attention,score",
        help="attention (kernel 1), score (kernel 2), or both (default)",
    )
    p.add_argument("--contexts", default="32k,128k", help="tokens per request, e.g. 32k,128k")
    p.add_argument("--budgets", default="0.02,0.05,0.1", help="fraction of the context attended")
    p.add_argument("--selections", default="token,block16,block64", help="token | blockN")
    p.add_argument("--batches", default="1,8")
    p.add_argument(
        "--shapes",
        default=None,
        help="context:batch pairs, e.g. 32k:1,32k:16 (instead of contexts x batches)",
    )
    p.add_argument("--threads", default=None, help="thread counts, e.g. 15,7 (default: all cores but one)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--row-formats",
        default=None,
        help=f"host row formats to attend: {', '.join(ROW_FORMATS)} (default: --dtype)",
    )
    p.add_argument("--reps", type=int, default=10, help="timed calls per kernel row (median)")
    p.add_argument("--torch-reps", type=int, default=3, help="timed calls of the torch baseline")
    p.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    p.add_argument(
        "--sweep", action="store_true", help="only sweep prefetch settings and ISAs (caches flushed per call)"
    )
    p.add_argument(
        "--pages",
        choices=["huge", "4k"],
        default="huge",
        help="back the stores with transparent huge pages, as the host tier does (default), or 4 KiB pages",
    )
    p.add_argument(
        "--cold",
        choices=["layers", "flush"],
        default="layers",
        help="how each call starts from DRAM: rotate over layers' stores (default) or flush all caches",
    )
    p.add_argument(
        "--store-gib",
        type=float,
        default=None,
        help="memory for the rotated stores (default: min(16, a third of RAM))",
    )
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--name", default=None, help="machine name in the file names (default: from the CPU)")
    p.add_argument("--note", default="", help="a line of context written into the .md (e.g. machine load)")
    args = p.parse_args()
    unknown = set(args.kernels.split(",")) - {"attention", "score"}
    if unknown:
        p.error(f"--kernels: unknown {', '.join(sorted(unknown))}; allowed: attention, score")
    args.row_formats = (args.row_formats or args.dtype).split(",")
    unknown = set(args.row_formats) - set(ROW_FORMATS)
    if unknown:
        p.error(f"--row-formats: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(ROW_FORMATS)}")
    try:
        args.thread_counts = [int(t) for t in args.threads.split(",")] if args.threads else []
        args.shape_list = shapes(args)
    except ValueError as err:
        p.error(f"--threads / --shapes: {err}")
    if any(t < 1 for t in args.thread_counts):
        p.error("--threads: every count must be at least 1")
    return args


def shapes(args) -> list[tuple[int, int]]:
    """(context, batch) pairs: --shapes where given, else every context with every batch."""
    if args.shapes:
        return [(tokens(c), int(b)) for c, _, b in (s.partition(":") for s in args.shapes.split(","))]
    return [(c, b) for c in map(tokens, args.contexts.split(",")) for b in map(int, args.batches.split(","))]


def tokens(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def timed(fns, reps: int, flush=None) -> float:
    """Median seconds of a call over `reps` calls after one warm-up; call i runs `fns[i % len(fns)]` (another
    layer's data each time), `flush()` before each call where given."""
    fns = fns if isinstance(fns, (list, tuple)) else [fns]
    fns[-1]()
    times = []
    for i in range(reps):
        if flush is not None:
            flush()
        start = time.perf_counter()
        fns[i % len(fns)]()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rotation(store_bytes: int, call_bytes: int, budget_bytes: float) -> tuple[int, int]:
    """(stores, disjoint selections per store) so that rows come back only after 2x the LLC of other reads: as
    many stores as a decode step's layers where memory allows (at least 2), then selections to make up the
    rest. A flushing run needs one of each."""
    stores = max(2, min(MODEL_LAYERS, int(budget_bytes // max(store_bytes, 1))))
    needed = math.ceil(2 * last_level_cache_bytes() / max(call_bytes, 1))
    return stores, max(1, math.ceil(needed / stores))


def make_store(batch: int, context: int, dtype: torch.dtype, huge: bool = False, interleaved: bool = False):
    """K and V stores [batch, NUM_KV_HEADS, context, HEAD_DIM] allocated like the host tier's; `interleaved`: views
    of one buffer in which each token's K row is followed by its V row (a layout experiment)."""
    # random rows repeated along the context: real values (never zeros) without minutes of RNG
    base = torch.randn(batch, NUM_KV_HEADS, 4096, HEAD_DIM).to(dtype)
    return _fill_store(base, batch, context, dtype, huge, interleaved)


def make_row_store(batch: int, context: int, row_format: str, huge: bool = False):
    """(k, v, scales) in a host row format: float rows as `make_store` (scales {}), or the host tier's 8-bit rows,
    k / v [batch, NUM_KV_HEADS, context, HEAD_DIM] int8 / float8_e4m3fn codes and scales {"k_scale", "v_scale"}
    [batch, NUM_KV_HEADS, context // PHYSICAL_BLOCK] float32, the keywords `HostTier.scales()` hands the kernels."""
    if row_format not in QUANT_DTYPES:
        return (*make_store(batch, context, getattr(torch, row_format), huge), {})
    base = torch.randn(batch, NUM_KV_HEADS, 4096, HEAD_DIM)
    valid = torch.ones(batch, 4096, dtype=torch.bool)
    k_codes, k_scale = quantize_blocks(base, valid, PHYSICAL_BLOCK, row_format)
    v_codes, v_scale = quantize_blocks(base.flip(-1), valid, PHYSICAL_BLOCK, row_format)
    dtype = QUANT_DTYPES[row_format]
    k = _fill_rows(k_codes, host_zeros((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype, pin=False, huge=huge))
    v = _fill_rows(v_codes, host_zeros((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype, pin=False, huge=huge))
    num_blocks = context // PHYSICAL_BLOCK
    scales = {
        name: _fill_rows(
            scale, host_zeros((batch, NUM_KV_HEADS, num_blocks), torch.float32, pin=False, huge=huge)
        )
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale))
    }
    return k, v, scales


def _fill_rows(base: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    """`store` with `base` repeated along dim 2."""
    period = base.shape[2]
    for start in range(0, store.shape[2], period):
        n = min(period, store.shape[2] - start)
        store[:, :, start : start + n] = base[:, :, :n]
    return store


def _fill_store(base, batch, context, dtype, huge, interleaved):
    if interleaved:
        kv = host_zeros((batch, NUM_KV_HEADS, context, 2, HEAD_DIM), dtype, pin=False, huge=huge)
        k, v = kv[:, :, :, 0], kv[:, :, :, 1]
    else:
        k = host_zeros((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype, pin=False, huge=huge)
        v = host_zeros((batch, NUM_KV_HEADS, context, HEAD_DIM), dtype, pin=False, huge=huge)
    for start in range(0, context, 4096):
        n = min(4096, context - start)
        k[:, :, start : start + n] = base[:, :, :n]
        v[:, :, start : start + n] = base[:, :, :n].flip(-1)
    return k, v


def make_selections(
    batch: int, units: int, count: int, sets: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """`sets` selections of `count` sorted distinct ids per (request, KV head), as the selection policies make
    them, pairwise disjoint where `sets * count <= units` (each [batch, NUM_KV_HEADS, count])."""
    sets = max(1, min(sets, units // count))
    picks = [
        torch.randperm(units, generator=gen)[: sets * count].view(sets, count)
        for _ in range(batch * NUM_KV_HEADS)
    ]
    return [
        torch.stack([p[i].sort().values for p in picks]).view(batch, NUM_KV_HEADS, count) for i in range(sets)
    ]


class ReadProbe:
    """The host's read bandwidth around one row: other tenants of a VM move it within minutes (docs/cpu-kernels.md
    § How it is measured), so each row is compared with the best of a read just before and one just after it
    (1 GiB, the kernels' thread count, best of 3 each)."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.data = torch.ones(PROBE_BYTES // 4)
        self.seen: list[float] = []

    def read(self) -> float:
        self.seen.append(read_bandwidth(self.data, self.threads, reps=3))
        return self.seen[-1]

    def around(self, fn):
        before = self.read()
        result = fn()
        return result, max(before, self.read())


def store_budget(args) -> float:
    if args.store_gib is not None:
        return args.store_gib * 2**30
    return min(16 * 2**30, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 3)


def attention_rows(args, threads, probe, flush, gen, row_format=None) -> list[dict]:
    """Kernel 1's rows at one thread count and host row format (default: --dtype)."""
    row_format = row_format or args.dtype
    row_bytes = HEAD_DIM * (
        QUANT_DTYPES[row_format].itemsize
        if row_format in QUANT_DTYPES
        else getattr(torch, row_format).itemsize
    )
    scale_bytes = 4 if row_format in QUANT_DTYPES else 0  # per K (and per V) block of PHYSICAL_BLOCK rows
    rows = []
    for context, batch in args.shape_list:
        store_bytes = 2 * batch * NUM_KV_HEADS * context * row_bytes
        smallest_call = (
            max(1, round(min(map(float, args.budgets.split(","))) * context)) * store_bytes // context
        )
        num_stores, sets = (1, 1) if flush else rotation(store_bytes, smallest_call, store_budget(args))
        stores = [make_row_store(batch, context, row_format, args.pages == "huge") for _ in range(num_stores)]
        q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
        scale = HEAD_DIM**-0.5
        for budget in map(float, args.budgets.split(",")):
            for selection in args.selections.split(","):
                block = None if selection == "token" else int(selection.removeprefix("block"))
                units = context // (block or 1)
                count = max(1, round(budget * units))
                selections = make_selections(batch, units, count, sets, gen)
                lengths = torch.full((batch, NUM_KV_HEADS), count)
                row_count = count * (block or 1)
                kv_bytes = batch * NUM_KV_HEADS * row_count * row_bytes * 2
                # a token row reads its block's K and V scale; a block reads them once
                scales_read = (
                    2 * scale_bytes * (count if block is None else count * math.ceil(block / PHYSICAL_BLOCK))
                )
                nbytes = kv_bytes + batch * NUM_KV_HEADS * (count * 8 + scales_read)
                # call i: store i % S, selection (i // S) % len(selections)
                calls = [
                    (q, k, v, idx, lengths, scale, scales)
                    for idx, (k, v, scales) in itertools.product(selections, stores)
                ]
                native = [
                    functools.partial(
                        cpu.sparse_attention_lse, *c[:6], block_size=block, num_threads=threads, **c[6]
                    )
                    for c in calls
                ]
                prepared = prepared_calls(calls, block, threads)
                baseline = [
                    functools.partial(reference.sparse_attention_lse, *c[:6], block_size=block, **c[6])
                    for c in calls
                ]
                (native_s, prepared_s), bandwidth = probe.around(
                    lambda native=native, prepared=prepared: (
                        timed(native, args.reps, flush),
                        timed(prepared, args.reps, flush),
                    )
                )
                torch_s = None if args.no_torch else timed(baseline, args.torch_reps, flush)
                label = (context, batch, budget, selection, row_count, nbytes)
                rows.append(row("attention", *label, native_s, torch_s, bandwidth, prepared_s))
                rows[-1].update(
                    rotation=[len(stores), len(selections)],
                    row_format=row_format,
                    threads=threads,
                    kv_gbps=round(kv_bytes / prepared_s / 1e9, 2),
                )
                print_row(rows[-1])
        del stores
    return rows


def prepared_calls(calls, block, threads) -> list:
    """The same calls through `cpu.PreparedAttention`, laid out once as the decode path lays out hgca's: a few us
    of Python per call instead of the general launcher's checks, copies and allocations (their cost is in
    docs/cpu-kernels.md § How it is measured), so the row shows the kernel's own speed too."""
    out = {}
    prepared = []
    for q, k, v, idx, lengths, scale, *scales in calls:
        q3 = q[:, :, 0].contiguous()
        if q3.shape not in out:
            out[q3.shape] = (torch.empty(q3.shape), torch.empty(q3.shape[:2]))
        prepared.append(
            cpu.PreparedAttention(
                q3,
                k,
                v,
                idx,
                lengths,
                scale,
                *out[q3.shape],
                None,
                block,
                threads,
                **(scales[0] if scales else {}),
            )
        )
    return prepared


def make_digests(batch: int, num_blocks: int, dtype: torch.dtype, huge: bool, gen: torch.Generator):
    # per-block key min / max, allocated as the host tier allocates its digests
    shape = (batch, NUM_KV_HEADS, num_blocks, HEAD_DIM)
    center = torch.randn(shape, generator=gen)
    key_min, key_max = (host_zeros(shape, dtype, pin=False, huge=huge) for _ in range(2))
    key_min.copy_(center - 0.5)
    key_max.copy_(center + 0.5)
    return key_min, key_max


def scoring_rows(args, threads, probe, flush, gen) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    rows = []
    for context, batch in args.shape_list:
        num_blocks = context // PHYSICAL_BLOCK
        nbytes = 2 * batch * NUM_KV_HEADS * num_blocks * HEAD_DIM * dtype.itemsize
        copies = 1 if flush else max(2, math.ceil(2 * last_level_cache_bytes() / nbytes) + 1)
        digests = [make_digests(batch, num_blocks, dtype, args.pages == "huge", gen) for _ in range(copies)]
        q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
        for logical in (16, 64):
            factor = logical // PHYSICAL_BLOCK
            top = max(1, round(0.05 * num_blocks / factor))
            calls = [(q, key_min, key_max, top, factor) for key_min, key_max in digests]
            native = [functools.partial(cpu.score_topk, *c, num_threads=threads) for c in calls]
            native_s, bandwidth = probe.around(functools.partial(timed, native, args.reps, flush))
            baseline = [functools.partial(torch_score_topk, *c) for c in calls]
            torch_s = None if args.no_torch else timed(baseline, args.torch_reps, flush)
            label = (context, batch, None, f"block{logical}", num_blocks // factor, nbytes)
            rows.append(row("score+top5%", *label, native_s, torch_s, bandwidth))
            rows[-1].update(rotation=[copies, 1], threads=threads)
            print_row(rows[-1])
    return rows


def torch_score_topk(q, key_min, key_max, k, factor):
    scores = reference.block_scores(q, *reference.coarsen_digest(key_min, key_max, factor))
    return reference.topk_blocks(scores, k)


def row(
    kernel, context, batch, budget, selection, units, nbytes, native_s, torch_s, bandwidth, prepared_s=None
):
    gbps = nbytes / native_s / 1e9
    prepared_gbps = None if prepared_s is None else nbytes / prepared_s / 1e9
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
        "read_bw_gbps": round(bandwidth, 1),
        "pct_read_bw": round(100 * gbps / bandwidth, 1),
        "torch_ms": None if torch_s is None else round(torch_s * 1e3, 3),
        "speedup": None if torch_s is None else round(torch_s / native_s, 1),
        "prepared_ms": None if prepared_s is None else round(prepared_s * 1e3, 4),
        "prepared_pct_read_bw": None if prepared_s is None else round(100 * prepared_gbps / bandwidth, 1),
        "prepared_speedup": None if prepared_s is None or torch_s is None else round(torch_s / prepared_s, 1),
    }


HEADER = (
    "| format | threads | kernel | context | batch | budget | selection | rows/head | MB | ms | GB/s | read BW GB/s | % read BW "
    "| torch ms | speedup | prepared ms | % read BW | speedup | KV GB/s |"
)


def format_row(r: dict) -> str:
    budget = "all" if r["budget"] is None else f"{100 * r['budget']:g}%"
    torch_ms = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.2f}"
    speedup = "-" if r["speedup"] is None else f"{r['speedup']:.1f}x"
    if r.get("prepared_ms") is None:
        prepared = "- | - | -"
    else:
        fast = "-" if r["prepared_speedup"] is None else f"{r['prepared_speedup']:.1f}x"
        prepared = f"{r['prepared_ms']:.3f} | {r['prepared_pct_read_bw']:.0f}% | {fast}"
    kv = "-" if r.get("kv_gbps") is None else f"{r['kv_gbps']:.1f}"
    return (
        f"| {r.get('row_format', '-')} | {r.get('threads', '-')} | {r['kernel']} | {r['context'] // 1024}K | {r['batch']} | {budget} | {r['selection']} | "
        f"{r['rows_per_head']} | {r['mbytes']:.1f} | {r['ms']:.3f} | {r['gbps']:.1f} | {r['read_bw_gbps']:.0f} | "
        f"{r['pct_read_bw']:.0f}% | {torch_ms} | {speedup} | {prepared} | {kv} |"
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
            idx = make_selections(batch, context, count, 1, gen)[0]
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
    thread_counts = args.thread_counts or [_library.default_num_threads()]
    threads = thread_counts[0]
    torch.set_num_threads(threads)  # the torch baseline gets the same cores
    info = machine_info(threads)
    print(json.dumps(info), flush=True)
    bandwidth = host_read_bandwidth(threads)
    print(f"measured read bandwidth ({threads} threads, 2 GiB): {bandwidth:.1f} GB/s", flush=True)
    flush_buffer = torch.ones(FLUSH_BYTES // 4) if args.sweep or args.cold == "flush" else None

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
    each_call = flush if args.cold == "flush" else None
    kernels = args.kernels.split(",")
    rows, seen = [], []
    for count in thread_counts:  # each count against a read probe of its own threads
        torch.set_num_threads(count)
        probe = ReadProbe(count)
        if "attention" in kernels:
            for row_format in args.row_formats:
                rows += attention_rows(args, count, probe, each_call, gen, row_format)
        if "score" in kernels:
            rows += scoring_rows(args, count, probe, each_call, gen)
        seen += probe.seen
    low, high = min(seen), max(seen)

    suffix = ("-4k" if args.pages == "4k" else "") + ("-flush" if args.cold == "flush" else "")
    name = args.name or machine_slug(info) + suffix
    out_dir = Path(args.out_dir)
    manifest.write(out_dir, name=f"cpu_attention_{name}.manifest.json")
    result = {"machine": info, "read_bandwidth_gbps": round(bandwidth, 2),
              "probe_range_gbps": [round(low, 1), round(high, 1)], "dtype": args.dtype,
              "row_formats": args.row_formats, "thread_counts": thread_counts, "pages": args.pages, "cold": args.cold, "note": args.note, "rows": rows}  # fmt: skip
    (out_dir / f"cpu_attention_{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# CPU kernels on {info['cpu_model']} ({info['cores']} cores, host `{info['hostname']}`)",
        "",
        f"Threads {', '.join(map(str, thread_counts))}, ISA `{info['isa']}`, prefetch {info['prefetch']}, {args.dtype} KV (rows in {', '.join(args.row_formats)}) "
        f"({'transparent huge pages' if args.pages == 'huge' else '4 KiB pages'}), torch "
        f"{info['torch']}, {info['compiler']}. Read bandwidth at the start: **{bandwidth:.1f} GB/s** (2 GiB read, "
        "same threads); `read BW` is the best of a 1 GiB read just before and one just after each row (this "
        f"run: {low:.0f}-{high:.0f} GB/s) and `% read BW` compares the row with it. Llama-3.1-8B layer: 32 q / 8 KV "
        f"heads, head_dim 128; {COLD_TEXT[args.cold]}; medians. MB = K+V rows (+ ids) read for attention, all "
        "min+max digests for scoring. Speedup is over the torch-gather reference (`tandem.kernels.reference`). "
        "`ms` times the general call (`cpu.sparse_attention_lse`: argument checks, copies, new outputs); the "
        "`prepared` columns time the same rows through `cpu.PreparedAttention`, laid out once as the decode path "
        "does, i.e. the kernel with a few us of Python; `KV GB/s` is the K+V row bytes in the row format (no ids or "
        "scales) per second of the prepared call.",
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
