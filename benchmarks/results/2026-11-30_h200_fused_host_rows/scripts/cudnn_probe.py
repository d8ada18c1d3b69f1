"""cuDNN fused attention (with its LSE) at fixed piece sizes against Tandem's Triton prefill kernel: the plan cost
of a new shape or stride layout, the steady rate, the error against float32. 8B heads, a 2K chunk of queries."""
import math, time, torch
from tandem.kernels import gpu
from tandem.tools.bench.bandwidth import event_seconds, matmul_rate

dev = torch.device("cuda")
rate = matmul_rate("cuda", torch.bfloat16)
print("GPU", torch.cuda.get_device_name(), "cudnn", torch.backends.cudnn.version(), "matmul", round(rate), flush=True)
Hq, Hkv, D, Lq = 32, 8, 128, 2048
op = torch.ops.aten._scaled_dot_product_cudnn_attention
scale = D ** -0.5
base = torch.randn(1, Lq, Hq, D, device=dev, dtype=torch.bfloat16)
q = base.transpose(1, 2)  # the model's layout: a transposed view
qc = q.contiguous()

def cudnn(qq, k, v):
    r = op(qq, k, v, None, True, 0.0, False, False, scale=scale)
    return r[0], r[1]

def first_and_median(call):
    torch.cuda.synchronize(); t = time.perf_counter(); call(); torch.cuda.synchronize()
    first = time.perf_counter() - t
    ts = sorted(event_seconds(call, 10, dev, warmups=1))
    return first, ts[len(ts) // 2]

def ref(qq, k, v, rows=64):
    qf = qq[:, :, :rows].float(); kf = k.repeat_interleave(Hq // Hkv, 1).float(); vf = v.repeat_interleave(Hq // Hkv, 1).float()
    lg = torch.einsum("bhqd,bhkd->bhqk", qf, kf) * scale
    return torch.einsum("bhqk,bhkd->bhqd", lg.softmax(-1), vf), torch.logsumexp(lg, -1)

for P in (2048, 4096, 8192, 16384):
    store_k = torch.randn(1, Hkv, 40000, D, device=dev, dtype=torch.bfloat16)
    store_v = torch.randn(1, Hkv, 40000, D, device=dev, dtype=torch.bfloat16)
    k, v = store_k[:, :, :P].contiguous(), store_v[:, :, :P].contiguous()
    flops = 4 * Lq * P * D * Hq
    for label, qq in (("q contiguous", qc), ("q transposed view", q)):
        try:
            f, m = first_and_median(lambda: cudnn(qq, k, v))
            o, l = cudnn(qq, k, v); ro, rl = ref(qq, k, v)
            err = max((o[:, :, :64].float() - ro).abs().max().item(), (l.reshape(1, Hq, Lq)[:, :, :64] - rl).abs().max().item())
            print(f"P={P:6d} cudnn {label:18s} first {f*1e3:8.1f} ms  median {m*1e3:6.3f} ms  {flops/m/1e12:6.1f} TFLOP/s  err {err:.2e} lse {tuple(l.shape)}", flush=True)
        except Exception as e:
            print(f"P={P} cudnn {label}: {type(e).__name__} {str(e)[:100]}", flush=True)
    # strided views of stores of another capacity: a new plan?
    for cap in (33024, 36000):
        sk = torch.randn(1, Hkv, cap, D, device=dev, dtype=torch.bfloat16); sv = torch.randn_like(sk)
        try:
            f, m = first_and_median(lambda: cudnn(qc, sk[:, :, :P], sv[:, :, :P]))
            print(f"P={P:6d} cudnn strided view cap {cap}: first {f*1e3:8.1f} ms median {m*1e3:6.3f} ms", flush=True)
        except Exception as e:
            print(f"P={P} cudnn strided view: {type(e).__name__} {str(e)[:100]}", flush=True)
    valid = torch.ones(1, P, device=dev, dtype=torch.bool)
    def tri():
        out = torch.zeros(1, Hq, Lq, D, device=dev); lse = torch.full((1, Hq, Lq), float("-inf"), device=dev)
        return gpu.prefill_attention(q, k, v, scale, key_valid=valid, out=out, lse=lse, accumulate=True)
    f, m = first_and_median(tri)
    print(f"P={P:6d} triton                      first {f*1e3:8.1f} ms  median {m*1e3:6.3f} ms  {flops/m/1e12:6.1f} TFLOP/s", flush=True)
# q length other than the chunk: a new plan each?
for lq in (1000, 1500):
    k, v = store_k[:, :, :4096].contiguous(), store_v[:, :, :4096].contiguous()
    qq = torch.randn(1, Hq, lq, D, device=dev, dtype=torch.bfloat16)
    f, m = first_and_median(lambda: cudnn(qq, k, v))
    print(f"Lq={lq} P=4096 cudnn first {f*1e3:8.1f} ms median {m*1e3:6.3f} ms", flush=True)
