"""Quest's selection inside a decode step, on the GPU: the block bounds over the digest mirror and the top-k.

For Llama-3.1-8B layer shapes (32 query / 8 KV heads, head_dim 128, 16-token blocks, 5% of the blocks kept) at
batch 1 x 64K / 128K and batch 16 x 32K, times each candidate the same way (10 calls per CUDA graph replay, 50
replays) and prints and saves (JSON + markdown) microseconds per layer:

- bounds: `reference.block_scores_matmul` (two cuBLAS matmuls + elementwise) against `gpu.block_scores` (Triton),
  with the digest bytes read per microsecond as a fraction of the HBM read bandwidth measured in the same run;
- top-k: `torch.topk(sorted=True)` (ranked), `torch.topk(sorted=False)` then a sort of the picks, and
  `gpu.top_blocks` (a set, k read on the device) with each of its kernels: the row in registers (up to 16K
  blocks), the row read in tiles by one program, and the row split over one program per tile (1024, 2048 or
  4096 blocks), checking each equals `reference.top_blocks`. Shapes: batch 1 x 64K / 128K / 1M, batch 16 x 32K.

    python benchmarks/bench_quest_selection.py --out benchmarks/results/2026-11-26_h200_quest_selection
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch

from tandem import manifest
from tandem.kernels import gpu, reference
from tandem.kernels.gpu import selection as gpu_selection
from tandem.tools.bench.bandwidth import hbm_bandwidth


def per_call_us(fn, replays: int = 50, per_graph: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / per_graph * 1e3


def ranked_then_sorted(scores, k):
    best, ids = torch.topk(scores, k, dim=-1, sorted=False)
    best, order = best.sort(dim=-1, descending=True)
    return ids.gather(-1, order)


def measure(batch: int, context: int, budget: float, hbm: float) -> dict:
    num_blocks = context // 16 + 64  # the host tier's capacity blocks (a few decode steps' room)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    center = torch.randn(batch, 8, num_blocks, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    key_min, key_max = center - 0.5, center + 0.5
    valid = torch.ones(batch, num_blocks, dtype=torch.bool, device="cuda")
    k = math.ceil(budget * num_blocks)
    k_dev = torch.tensor([k], device="cuda")
    scores = gpu.block_scores(q, key_min, key_max, valid)
    row = {"batch": batch, "context": context, "blocks": num_blocks, "k": k}
    row["bounds_matmul_us"] = per_call_us(lambda: reference.block_scores_matmul(q, key_min, key_max, valid))
    row["bounds_triton_us"] = per_call_us(lambda: gpu.block_scores(q, key_min, key_max, valid))
    digest_bytes = 2 * key_min.numel() * key_min.element_size()
    row["bounds_triton_pct_hbm"] = 100 * digest_bytes / (row["bounds_triton_us"] * 1e3) / hbm  # hbm in GB/s
    row["topk_sorted_us"] = per_call_us(lambda: torch.topk(scores, k, dim=-1, sorted=True))
    row["topk_unsorted_then_sort_us"] = per_call_us(lambda: ranked_then_sorted(scores, k))
    expected = reference.top_blocks(scores, k, k)
    saved = {name: getattr(gpu_selection, name) for name in SETTINGS}
    kinds = [("registers", {"REGISTER_TOP_BLOCKS": 1 << 20})] if num_blocks <= 16384 else []
    kinds += [
        ("tiles", {"REGISTER_TOP_BLOCKS": 0, "LONG_ROWS": "tiles"}),
        ("split1024", {"REGISTER_TOP_BLOCKS": 0, "LONG_ROWS": "split", "SPLIT_TOP_BLOCKS_TILE": 1024}),
        ("split2048", {"REGISTER_TOP_BLOCKS": 0, "LONG_ROWS": "split", "SPLIT_TOP_BLOCKS_TILE": 2048}),
        ("split4096", {"REGISTER_TOP_BLOCKS": 0, "LONG_ROWS": "split", "SPLIT_TOP_BLOCKS_TILE": 4096}),
    ]
    for kind, settings in kinds:
        # each kernel at every shape (the launcher picks the register one up to REGISTER_TOP_BLOCKS)
        for name, value in settings.items():
            setattr(gpu_selection, name, value)
        try:
            row[f"top_blocks_{kind}_us"] = per_call_us(lambda: gpu.top_blocks(scores, k_dev, k))
            row[f"top_blocks_{kind}_equal"] = bool(torch.equal(gpu.top_blocks(scores, k_dev, k), expected))
        finally:
            for name, value in saved.items():
                setattr(gpu_selection, name, value)
    return {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}


SETTINGS = ("REGISTER_TOP_BLOCKS", "LONG_ROWS", "SPLIT_TOP_BLOCKS_TILE")


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=0.05)
    p.add_argument("--out", default=None, help="folder for quest_selection.json / .md")
    args = p.parse_args()
    hbm = hbm_bandwidth("cuda", mode="read")
    machine = {
        "gpu": torch.cuda.get_device_name(),
        "hbm_read_GBps": round(hbm, 1),
        "torch": torch.__version__,
    }
    print(json.dumps(machine), flush=True)
    rows = []
    for batch, context in ((1, 65536), (1, 131072), (16, 32768), (1, 1 << 20)):
        row = measure(batch, context, args.budget, hbm)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        manifest.write(args.out)
        with open(os.path.join(args.out, "quest_selection.json"), "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)
        head = list(dict.fromkeys(key for r in rows for key in r))
        lines = [f"# Quest selection on {machine['gpu']} (HBM read {machine['hbm_read_GBps']} GB/s)", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(r.get(h, "")) for h in head) + " |" for r in rows]
        with open(os.path.join(args.out, "quest_selection.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
