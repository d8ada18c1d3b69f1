"""The attention of a prefill chunk over keys already in GPU memory, per kernel, against the GPU's measured bf16
matmul rate, in one run (GPU host).

This is the inner call of Tandem's exact append path (`attention.hybrid._append_exact_flash`): a chunk of Lq new
queries attends the hot tier and the host rows streamed to the GPU, and each part's (out, log-sum-exp) merges
into the running result. So every kernel here must give the LSE too:

- triton:          Tandem's own `kernels.gpu.prefill_attention` (the path today), grouped-query heads read in place
- sdpa-flash:      torch's FlashAttention kernel (`aten._scaled_dot_product_flash_attention`)
- sdpa-efficient:  torch's memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`)
- sdpa-cudnn:      cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention`)
- sdpa-no-lse:     `F.scaled_dot_product_attention(enable_gqa=True)`, which gives no LSE: the speed a kernel
                   reaches when it need not return one (a reference, not a candidate)

A torch kernel that refuses grouped-query heads runs on keys and values expanded to the query heads, and that
expansion's copy is part of its time (the append path would pay it). Per chunk and key count: milliseconds,
TFLOP/s (4 * Lq * Lk * D * Hq per call: two matmuls), their fraction of the matmul rate measured here, and each
kernel's largest difference from a float32 reference on the first query rows (out and LSE). A kernel that fails
(absent from this torch, or refusing the shape) is a row with its error.

    python benchmarks/bench_prefill_attention.py --chunks 2k,8k --keys 8k,32k,128k --out prefill_attention

Random bf16 inputs (the kernels' speed does not depend on the values); the heads default to Llama-3.1-8B's.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from tandem import manifest
from tandem.kernels import gpu
from tandem.tools.bench.bandwidth import event_seconds, matmul_rate

KERNELS = ("triton", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-no-lse")
CHECK_ROWS = 64  # query rows compared with the float32 reference


def tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def timed(call, repeats: int) -> float:
    """Median seconds of `call()` on the GPU, after two untimed calls."""
    times = sorted(event_seconds(call, repeats, torch.device("cuda"), warmups=2))
    return times[len(times) // 2]


def expanded(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, L, D] keys or values repeated to `heads` heads (what a kernel without grouped-query heads reads)."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def kernel_call(name: str, q, k, v, scale: float):
    """A zero-argument call returning (out [B, Hq, Lq, D], lse [B, Hq, Lq] or None) for kernel `name`, and
    whether it reads keys expanded to the query heads."""
    heads = q.shape[1]
    if name == "triton":
        return (lambda: gpu.prefill_attention(q, k, v, scale)), False
    if name == "sdpa-no-lse":
        return (lambda: (F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True), None)), False
    aten = torch.ops.aten
    if name == "sdpa-flash":
        op = aten._scaled_dot_product_flash_attention

        def run(k, v):
            result = op(q, k, v, 0.0, False, False, scale=scale)
            return result[0], result[1]
    elif name == "sdpa-efficient":
        op = aten._scaled_dot_product_efficient_attention

        def run(k, v):
            result = op(q, k, v, None, True, 0.0, False, scale=scale)
            return result[0], result[1][..., : q.shape[2]]
    elif name == "sdpa-cudnn":
        op = aten._scaled_dot_product_cudnn_attention

        def run(k, v):
            result = op(q, k, v, None, True, 0.0, False, False, scale=scale)
            lse = result[1]
            return result[0], lse.reshape(q.shape[:3]) if lse.numel() == math.prod(q.shape[:3]) else lse
    else:
        raise ValueError(f"unknown kernel {name!r}; choose from {', '.join(KERNELS)}")
    try:  # grouped-query heads in place, where the kernel takes them
        run(k, v)
        torch.cuda.synchronize()
        return (lambda: run(k, v)), False
    except RuntimeError:
        return (lambda: run(expanded(k, heads), expanded(v, heads))), True


def reference(q, k, v, scale: float, rows: int):
    """(out, lse) of the first `rows` queries in float32, keys expanded to the query heads."""
    qf = q[:, :, :rows].float()
    kf, vf = expanded(k, q.shape[1]).float(), expanded(v, q.shape[1]).float()
    logits = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    lse = torch.logsumexp(logits, dim=-1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(logits, dim=-1), vf), lse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunks", default="2k,8k", help="query tokens per chunk, e.g. 2k,8k (k = 1024)")
    p.add_argument("--keys", default="8k,32k,128k", help="keys in GPU memory the chunk attends, e.g. 8k,32k")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32, Llama-3.1-8B's)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list of {', '.join(KERNELS)}")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per kernel and shape (median)")
    p.add_argument("--out", default="prefill_attention", help="output folder (JSON, markdown, manifest)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark times CUDA kernels: it needs a GPU")
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        p.error(f"--kernels: unknown {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    device, dtype = torch.device("cuda"), torch.bfloat16
    machine = manifest.machine()
    limit = matmul_rate(device, dtype)
    print(
        f"machine: {machine.get('gpus')}, {machine.get('cpu')}; bf16 matmul {limit:.0f} TFLOP/s", flush=True
    )
    rows = []
    scale = args.head_dim**-0.5
    for chunk in (tokens(c) for c in args.chunks.split(",")):
        for keys in (tokens(k) for k in args.keys.split(",")):
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(1, args.heads, chunk, args.head_dim, device=device, dtype=dtype, generator=gen)
            k = torch.randn(1, args.kv_heads, keys, args.head_dim, device=device, dtype=dtype, generator=gen)
            v = torch.randn(1, args.kv_heads, keys, args.head_dim, device=device, dtype=dtype, generator=gen)
            ref_out, ref_lse = reference(q, k, v, scale, min(CHECK_ROWS, chunk))
            flops = 4 * chunk * keys * args.head_dim * args.heads
            for name in kernels:
                row = {"kernel": name, "chunk": chunk, "keys": keys}
                try:
                    call, expands = kernel_call(name, q, k, v, scale)
                    out, lse = call()
                    seconds = timed(call, args.repeats)
                except (RuntimeError, AttributeError, NotImplementedError) as err:
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                    rows.append(row)
                    print(row, flush=True)
                    continue
                n = ref_out.shape[2]
                row.update(
                    ms=round(seconds * 1e3, 3),
                    tflops=round(flops / seconds / 1e12, 1),
                    of_matmul=round(flops / seconds / 1e12 / limit, 3),
                    expands_heads=expands,
                    out_diff=float((out[:, :, :n].float() - ref_out).abs().max()),
                    lse_diff=None if lse is None else float((lse[:, :, :n].float() - ref_lse).abs().max()),
                )
                rows.append(row)
                print(row, flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    text = [
        "# Prefill chunk attention over keys in GPU memory, per kernel",
        "",
        f"Machine: {machine.get('gpus')}; {machine.get('cpu')}. torch {torch.__version__}. bf16 inputs, "
        f"{args.heads} query heads, {args.kv_heads} key/value heads, head dim {args.head_dim}. Hardware limit: a "
        f"bf16 matmul at **{limit:.0f} TFLOP/s** measured in this run. FLOPs per call: 4 x Lq x Lk x D x Hq.",
        "",
        "| kernel | chunk | keys | ms | TFLOP/s | of matmul | K/V expanded | out diff | LSE diff |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            text.append(f"| {r['kernel']} | {r['chunk']} | {r['keys']} | {r['error']} | | | | | |")
            continue
        lse = "-" if r["lse_diff"] is None else f"{r['lse_diff']:.2e}"
        text.append(
            f"| {r['kernel']} | {r['chunk']} | {r['keys']} | {r['ms']} | {r['tflops']} | {r['of_matmul']} | "
            f"{'yes' if r['expands_heads'] else 'no'} | {r['out_diff']:.2e} | {lse} |"
        )
    text += [
        "",
        f"Differences: the largest over the first {CHECK_ROWS} query rows against a float32 reference. "
        "sdpa-no-lse returns no LSE: the speed without one, not a candidate for the append path.",
    ]
    out = manifest.save_results(
        args.out,
        "prefill_attention",
        {"matmul_tflops": limit, "args": vars(args), "rows": rows},
        "\n".join(text) + "\n",
    )
    print("\n".join(text))
    print(f"saved {out}/prefill_attention.json, prefill_attention.md, manifest.json")


if __name__ == "__main__":
    main()
