"""Claims from one task counter in pinned host memory, by CPU threads and by GPU programs at once.

The priority queue (`tandem.attention.queue`) hands out a step's tasks through one int32 counter in pinned memory:
CPU threads take the next task with an atomic fetch-add, and the GPU's programs with a system-scope atomic add over
the zero-copy mapping. This program checks, on the machine it runs on, that the two kinds of claims are atomic with
respect to each other (every index claimed exactly once), and prints and saves how many claims per second each side
makes alone and together. It also prints the device's `CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED`.

    python benchmarks/bench_queue_claims.py --out benchmarks/results/<date>_<machine>_queue_claims
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import time

import torch

HOST_NATIVE_ATOMIC_SUPPORTED = 86  # CUdevice_attribute


def host_native_atomics(device: int) -> int | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int(-1)
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), HOST_NATIVE_ATOMIC_SUPPORTED, device) != 0:
        return None
    return value.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--claims", type=int, default=200_000)
    parser.add_argument("--programs", default="1,8,32,132")
    parser.add_argument("--cpu-threads", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from tandem.kernels.cpu import ops as cpu_ops
    from tandem.kernels.gpu import queue as gpu_queue

    device = torch.device("cuda")
    rows = []
    record = {
        "machine": platform.node(),
        "gpu": torch.cuda.get_device_name(device),
        "host_native_atomic_supported": host_native_atomics(0),
        "claims": args.claims,
        "rows": rows,
    }
    print(
        f"# {record['gpu']}: CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED = {record['host_native_atomic_supported']}"
    )
    n = args.claims
    counter = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    owner = torch.zeros(n, dtype=torch.int32, pin_memory=True)

    def run(programs: int, cpu_threads: int) -> dict:
        counter.zero_()
        owner.zero_()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if programs:
            gpu_queue.claim_probe(counter, owner, n, programs)
        cpu_claims = cpu_ops.claim_probe(counter, owner, n, cpu_threads) if cpu_threads else 0
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        marks = owner.clone()
        gpu_claims = int((marks > 0).sum()) - int((marks >= 1 << 20).sum())
        row = {
            "gpu_programs": programs, "cpu_threads": cpu_threads, "seconds": seconds,
            "claims_per_s": n / seconds, "gpu_claims": gpu_claims, "cpu_claims": cpu_claims,
            "unclaimed": int((marks == 0).sum()), "counter_end": int(counter.item()),
            "exactly_once": bool((marks != 0).all()) and gpu_claims + cpu_claims == n,
        }  # fmt: skip
        print(json.dumps(row))
        return row

    for programs in [int(p) for p in args.programs.split(",")]:
        rows.append(run(programs, 0))
        rows.append(run(programs, args.cpu_threads))
    rows.append(run(0, args.cpu_threads))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "claims.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
