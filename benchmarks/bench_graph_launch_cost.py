"""Host cost of launching a CUDA graph, by node kind: 32 "layers" of 36 small kernels each, with 4 copies to or
from pinned memory per layer and / or a flag hand-off (2 stream memory operations, `tandem.engine.handoff`), as a
decode step records them. Prints the median host time of `CUDAGraph.replay()` as JSON; a result:
benchmarks/results/2026-11-26_h100_profile_8b/graph_launch_cost_h100.json.

    python benchmarks/bench_graph_launch_cost.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandem.engine import handoff

LAYERS, KERNELS_PER_LAYER = 32, 36


def build(kind: str, device: torch.device):
    flags = handoff.HostFlags(LAYERS, device)
    x = torch.zeros(1024, device=device)
    pinned = torch.zeros(1024, pin_memory=True)
    x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            for _ in range(KERNELS_PER_LAYER):
                x.add_(1)
            if "copies" in kind:
                for _ in range(2):
                    pinned.copy_(x, non_blocking=True)
                    x.copy_(pinned, non_blocking=True)
            if "memops" in kind:
                flags.signal_ready(layer)
                flags.wait_done(layer)
    torch.cuda.synchronize()
    return graph, flags


def main() -> None:
    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name()}
    for kind in ("kernels", "kernels+copies", "kernels+memops", "kernels+copies+memops"):
        graph, flags = build(kind, device)
        times = []
        for _ in range(20):
            flags.memory.fill_(1)  # every wait is already satisfied
            torch.cuda.synchronize()
            start = time.perf_counter()
            graph.replay()
            times.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
        result[kind] = sorted(times[3:])[len(times[3:]) // 2]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()  # no options; --help prints the docstring
    main()
