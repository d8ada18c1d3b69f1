"""Same-process A/B timing of versions of the CPU kernels (two or more csrc trees): attention, or scoring + top-k.

The GPU host's memory bandwidth moves with other tenants within minutes (docs/cpu-kernels.md § How it is
measured), so two versions timed in two processes a minute apart cannot be told apart at a few percent. This builds each tree as a separate
library, loads them all, and alternates their calls (order rotated every iteration) over rotated 128K-token
Llama-3.1-8B layer stores (each call reads rows no recent call read), at 5% and batch 1 and 8. With
`--kernel score` it times Quest's scoring + top-5% over rotated 128K-token digests (16-token physical blocks,
logical 16 and 64) instead, allocated like the host tier's.

    cp -r tandem/kernels/cpu/csrc /tmp/csrc_old     # before editing the kernel
    PYTHONPATH=. python benchmarks/bench_cpu_attention_ab.py /tmp/csrc_old tandem/kernels/cpu/csrc
    PYTHONPATH=. python benchmarks/bench_cpu_attention_ab.py /tmp/csrc_old tandem/kernels/cpu/csrc --kernel score

Prints median ms per call and its ratio to the first version's, per configuration. A diagnostic, not a test.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_cpu_attention import (  # this folder is on sys.path when run as a script
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_Q_HEADS,
    PHYSICAL_BLOCK,
    make_digests,
    make_selections,
    make_store,
)

from tandem.kernels import cpu
from tandem.kernels.cpu import _library
from tandem.kernels.cpu._library import DTYPE_CODES, AttendArgs, ScoreArgs

CONTEXT = 131072


def build(source_dir: str, target: Path) -> ctypes.CDLL:
    _library._SOURCE_DIR = Path(source_dir).resolve()
    _library._compile(_library._compiler(), target)
    lib = ctypes.CDLL(str(target))
    _library._declare(lib)
    return lib


def alternate(libs: dict, calls: list, num_calls: int, invoke) -> dict[str, float]:
    """Median ms per call of each version. The versions take turns in an order rotated every iteration, and in
    one iteration each reads another part of `calls` than the others (another store or selection)."""
    names = list(libs)
    times = {n: [] for n in names}
    for i in range(num_calls):
        for j in range(len(names)):
            v = (i + j) % len(names)  # version v reads the v-th part of `calls`
            name, call = names[v], calls[(i + v * len(calls) // len(names)) % len(calls)]
            start = time.perf_counter()
            invoke(libs[name], call)
            times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t[4:]) * 1e3 for n, t in times.items()}


def report(label: str, ms: dict[str, float], mb: float) -> None:
    first = next(iter(ms.values()))
    parts = [f"{n} {t:.3f} ms ({mb / t:.0f} GB/s, {t / first:.3f}x)" for n, t in ms.items()]
    print(f"{label}: " + "  ".join(parts), flush=True)


def attention(libs: dict, num_calls: int) -> None:
    threads, isa, prefetch = cpu.default_num_threads(), _library.isa_code(), _library.prefetch_config()
    gen = torch.Generator().manual_seed(0)
    for batch, num_stores in ((1, 24), (8, 3)):
        stores = [make_store(batch, CONTEXT, torch.bfloat16, huge=True) for _ in range(num_stores)]
        q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
        out, lse = torch.empty(batch, NUM_Q_HEADS, 1, HEAD_DIM), torch.empty(batch, NUM_Q_HEADS, 1)

        def invoke(lib, call, out=out, lse=lse):
            code = DTYPE_CODES[torch.bfloat16]
            lib.tandem_sparse_attention(
                isa, code, ctypes.byref(call), out.data_ptr(), lse.data_ptr(), threads
            )

        for selection, block in (("token", 1), ("block16", 16), ("block64", 64)):
            units = CONTEXT // block
            count = round(0.05 * units)
            # disjoint selections per store, one per version: in one iteration no two versions read the same rows
            picks = make_selections(batch, units, count, max(2, len(libs)), gen)
            lengths = torch.full((batch, NUM_KV_HEADS), count)
            calls = [
                AttendArgs(
                    q.data_ptr(),
                    0.1,
                    k.data_ptr(),
                    v.data_ptr(),
                    *k.stride()[:3],
                    *v.stride()[:3],
                    idx.data_ptr(),
                    lengths.data_ptr(),
                    None,
                    batch,
                    NUM_KV_HEADS,
                    4,
                    HEAD_DIM,
                    count,
                    CONTEXT,
                    block,
                    *prefetch,
                )  # fmt: skip
                for idx in picks
                for k, v in stores
            ]
            ms = alternate(libs, calls, num_calls, invoke)
            report(
                f"attention batch {batch} {selection:8s}",
                ms,
                batch * NUM_KV_HEADS * count * block * HEAD_DIM * 4 / 1e6,
            )
        del stores


def score(libs: dict, num_calls: int) -> None:
    threads, isa = cpu.default_num_threads(), _library.isa_code()
    gen = torch.Generator().manual_seed(0)
    num_blocks = CONTEXT // PHYSICAL_BLOCK
    for batch, num_stores in ((1, 24), (8, 3)):
        stores = [make_digests(batch, num_blocks, torch.bfloat16, True, gen) for _ in range(num_stores)]
        q = torch.randn(batch, NUM_Q_HEADS, 1, HEAD_DIM)
        scores = torch.empty(batch, NUM_KV_HEADS, num_blocks)
        for factor in (1, 4):
            k = round(0.05 * num_blocks / factor)
            top_ids = torch.empty(batch, NUM_KV_HEADS, k, dtype=torch.int64)
            top_len = torch.empty(batch, NUM_KV_HEADS, dtype=torch.int64)

            def invoke(lib, call, k=k, top_ids=top_ids, top_len=top_len, scores=scores):
                code = DTYPE_CODES[torch.bfloat16]
                lib.tandem_score_topk(
                    isa, code, ctypes.byref(call), scores.data_ptr(), k, top_ids.data_ptr(), top_len.data_ptr(),
                    threads,
                )  # fmt: skip

            calls = [
                ScoreArgs(
                    q.data_ptr(),
                    None,
                    key_min.data_ptr(),
                    key_max.data_ptr(),
                    *key_min.stride()[:3],
                    *key_max.stride()[:3],
                    batch,
                    NUM_KV_HEADS,
                    NUM_Q_HEADS // NUM_KV_HEADS,
                    HEAD_DIM,
                    num_blocks,
                    factor,
                )  # fmt: skip
                for key_min, key_max in stores
            ]
            ms = alternate(libs, calls, num_calls, invoke)
            report(
                f"score+top5% batch {batch} block{PHYSICAL_BLOCK * factor:<3d}",
                ms,
                2 * stores[0][0].nbytes / 1e6,
            )
        del stores


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "versions", nargs="+", help="csrc directories of the versions (2 or more; ratios to the first)"
    )
    p.add_argument("--kernel", choices=["attention", "score"], default="attention")
    p.add_argument("--calls", type=int, default=60, help="calls per version and configuration")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    if len(args.versions) < 2:
        p.error(f"need at least 2 csrc directories to compare, got {len(args.versions)}")
    names = [chr(ord("a") + i) for i in range(len(args.versions))]
    libs = {n: build(d, tmp / f"{n}.so") for n, d in zip(names, args.versions, strict=True)}
    (attention if args.kernel == "attention" else score)(libs, args.calls)


if __name__ == "__main__":
    main()
