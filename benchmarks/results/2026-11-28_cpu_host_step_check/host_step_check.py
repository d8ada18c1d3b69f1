"""How close a plain host-step model gets to the committed H100 bench rows when it is fed each row's measured
bytes: floor + layers x round trip + max(CPU bytes / the CPU benchmark's attention rate, PCIe bytes / PCIe,
all host bytes / host read) + recall-cache bytes / HBM. The floor is the same run's streaming row where there is
one, else the weights' time x 1.44 (the streaming / weights ratio of the 1-GPU 8B runs). The CPU rate is the
committed CPU-kernel benchmark's `attention` row (16-token blocks, 15 threads, bf16) nearest in context, batch
and budget. Run from the repository root: python benchmarks/results/2026-11-28_cpu_host_step_check/host_step_check.py
"""

import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent
RATES = json.loads((RESULTS / "2026-11-27_xeon16_cpu_attention_eight_chunks/cpu_attention_intel-xeon-16c.json").read_text())["rows"]
BENCHES = [
    "2026-11-27_h100_host_dtype/bench/bench.json",
    "2026-11-27_h100_host_dtype/bench_b16/bench.json",
    "2026-11-27_h100x2_tp70b/bench.json",
    "2026-11-26_h100_bench_8b_serial_bound/b1/bench.json",
]
SYNC_S = 50e-6  # a layer's round trip with nothing to attend (2026-11-27_h100_decode_forward/)
FLOOR_FACTOR = 1.44


def cpu_rate_gbps(context: int, batch: int, budget: float) -> float:
    rows = [r for r in RATES if r["kernel"] == "attention" and r["selection"] == "block16"]
    best = min(rows, key=lambda r: (abs(math.log(r["context"] / context)), abs(math.log(r["batch"] / batch)),
                                    abs(r["budget"] - budget)))  # fmt: skip
    return best["gbps"]


def main() -> None:
    print("| bench | model x GPUs | system | context | batch | measured ms | predicted ms | error | floor from |")
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for name in BENCHES:
        data = json.loads((RESULTS / name).read_text())
        bw, model = data["bandwidth"], data["model"]
        gpus = model.get("gpus") or 1
        floors = {(r["context"], r["batch"]): r["tpot_median_ms"] for r in data["rows"]
                  if r["system"] == "tandem-streaming" and r["status"] == "ok"}  # fmt: skip
        for row in data["rows"]:
            if not row["system"].startswith("tandem-quest") or row["status"] != "ok":
                continue
            key = (row["context"], row["batch"])
            weights_ms = model["weight_bytes"] / gpus / (bw["hbm_gbps"] * 1e9) * 1e3
            floor, source = (floors[key], "streaming row") if key in floors else (weights_ms * FLOOR_FACTOR, "weights x 1.44")
            cpu, pcie, cache = (row[k] / gpus for k in ("cpu_bytes_per_step", "pcie_bytes_per_step", "cache_bytes_per_step"))
            rate = cpu_rate_gbps(row["context"], row["batch"], row["attended_fraction"] or 0.05)
            host_ms = max(cpu / rate, pcie / bw["pcie_h2d_gbps"], (cpu + pcie) / bw["host_read_gbps"]) / 1e6
            predicted = floor + model["layers"] * SYNC_S * 1e3 + host_ms + cache / bw["hbm_gbps"] / 1e6
            measured = row["tpot_median_ms"]
            print(f"| {name.split('/')[0]} | {model['name']} x {gpus} | {row['system']} | {row['context']} | {row['batch']} "
                  f"| {measured:.2f} | {predicted:.2f} | {predicted / measured - 1:+.0%} | {source} |")


if __name__ == "__main__":
    main()
