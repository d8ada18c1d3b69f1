"""Decode-step floors on the GPU: Llama-3.1-8B shapes, batch 1, random bf16 weights, each step one CUDA graph.

- `matmuls_only`: 32 layers of the four weight matmuls alone (q/k/v as one, gate/up as one): their floor;
- `separate` / `fused_qkv_gateup`: with the torch RMSNorms, SiLU and residual adds, q, k, v and gate, up as
  separate matmuls or as one each;
- `*_with_handoffs`: the same with a flag hand-off per layer (`tandem.engine.handoff`) that the host answers
  with a no-op.

Weight bytes / measured HBM read bandwidth is the bound all of these are compared with. Prints JSON; a result:
benchmarks/results/2026-11-26_h100_profile_8b/floor_h100.json.

    python benchmarks/bench_decode_floor.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tandem.engine import handoff

LAYERS, HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN = 32, 4096, 32, 8, 128, 14336
Q_WIDTH, KV_WIDTH = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    bf16 = torch.bfloat16

    def weights(rows, cols):
        return [torch.randn(rows, cols, device=device, dtype=bf16) * 0.02 for _ in range(LAYERS)]

    qkv, o = weights(Q_WIDTH + 2 * KV_WIDTH, HIDDEN), weights(HIDDEN, Q_WIDTH)
    gate_up, down = weights(2 * FFN, HIDDEN), weights(HIDDEN, FFN)
    weight_bytes = sum(t.numel() * t.element_size() for ts in (qkv, o, gate_up, down) for t in ts)
    norm_weight = torch.ones(HIDDEN, device=device, dtype=bf16)
    x0 = torch.randn(1, 1, HIDDEN, device=device, dtype=bf16)

    def norm(x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return norm_weight * (x.float() * torch.rsqrt(variance + 1e-5)).to(bf16)

    def hand_off(flags, layer):
        if flags is not None:
            flags.signal_ready(layer)
            flags.wait_done(layer)

    def separate(x, layer, flags=None):
        h = norm(x)
        attended = F.linear(h, qkv[layer][:Q_WIDTH])
        F.linear(h, qkv[layer][Q_WIDTH : Q_WIDTH + KV_WIDTH])  # k and v: launched (and recorded) all the same
        F.linear(h, qkv[layer][Q_WIDTH + KV_WIDTH :])
        hand_off(flags, layer)
        x = x + F.linear(attended, o[layer])
        h = norm(x)
        g, u = F.linear(h, gate_up[layer][:FFN]), F.linear(h, gate_up[layer][FFN:])
        return x + F.linear(F.silu(g) * u, down[layer])

    def fused(x, layer, flags=None):
        h = norm(x)
        attended = F.linear(h, qkv[layer])[..., :Q_WIDTH]
        hand_off(flags, layer)
        x = x + F.linear(attended, o[layer])
        y = F.linear(norm(x), gate_up[layer])
        return x + F.linear(F.silu(y[..., :FFN]) * y[..., FFN:], down[layer])

    def matmuls_only(x, layer, flags=None):
        y = F.linear(x, qkv[layer])[..., :HIDDEN]
        y = F.linear(F.linear(y, o[layer]), gate_up[layer])
        return F.linear(y[..., :FFN], down[layer])

    def graph_of(body, flags=None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture
                y = x0
                for layer in range(LAYERS):
                    y = body(y, layer)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x0
            for layer in range(LAYERS):
                y = body(y, layer, flags)
        return graph

    def median_ms(graph, flags=None, reps=50):
        times = []
        for _ in range(reps + 5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            if flags is None:
                graph.replay()
            else:
                flags.reset()
                graph.replay()
                handoff.run_host_side(flags, [lambda: None] * LAYERS)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[5:]) * 1e3

    result = {"gpu": torch.cuda.get_device_name(), "weight_gb": weight_bytes / 1e9}
    buffer = torch.empty(2_000_000_000, device=device, dtype=bf16)  # 4 GB: HBM read bandwidth
    for _ in range(3):
        buffer.sum()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        buffer.sum()
    torch.cuda.synchronize()
    result["hbm_gbs"] = 10 * buffer.numel() * 2 / (time.perf_counter() - start) / 1e9
    del buffer
    result["weights_over_hbm_ms"] = weight_bytes / 1e9 / result["hbm_gbs"] * 1e3
    for name, body in (("matmuls_only", matmuls_only), ("separate", separate), ("fused_qkv_gateup", fused)):
        result[name + "_ms"] = median_ms(graph_of(body))
    for name, body in (("separate", separate), ("fused_qkv_gateup", fused)):
        flags = handoff.HostFlags(LAYERS, device)
        result[name + "_with_handoffs_ms"] = median_ms(graph_of(body, flags), flags)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args()  # no options; --help prints the docstring
    main()
