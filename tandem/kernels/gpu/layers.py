"""Launchers of the fused model-layer kernels (`layers_kernels`): RMSNorm and rotary embedding, each one
kernel where the model's own code launches several small ones (seven for an RMSNorm, ten for RoPE on q and k).

At batch 1 these layers move a few kilobytes, so each of those launches costs more than its work: ~20 of a decode
step's ~63 kernels per layer on a Llama-3.1-8B shape. `tandem.engine.fused` swaps these in for the model's
own functions when they reproduce them, and only on the engine's (Tandem's) forward passes.

Both follow the model's order of operations and rounding (each elementwise product rounded to the output dtype,
as torch rounds it), so they match the model to rounding of the fp32 reductions; the references are
`tandem.kernels.reference.rms_norm` and `.rotary`.
"""

from __future__ import annotations

import torch

from ._common import FLOAT_DTYPES, _check, _check_on, _check_tensor, _guard, _run_device, _unit_last_stride

try:
    import triton

    from . import layers_kernels as _kernels
except ImportError:
    triton = None
    _kernels = None

MAX_HIDDEN = 1 << 16  # one row per program, held in registers
MAX_ROPE_HEADS = 256


def _check_norm(x, weight, eps) -> tuple[torch.device, int]:
    """(device, N) of an RMSNorm's row tensor x [..., N] and weight [N], checked."""
    device = _run_device("x", x)
    _check(x.dim() >= 1 and x.dtype in FLOAT_DTYPES, f"x must be a float tensor [..., N], got {x.dtype}")
    n = x.shape[-1]
    _check(1 <= n <= MAX_HIDDEN, f"x.shape[-1] must lie in [1, {MAX_HIDDEN}], got {n}")
    _check_tensor("weight", weight, "[N]", (n,), FLOAT_DTYPES)
    _check_on("weight", weight, device)
    _check(isinstance(eps, float) and eps > 0, f"eps must be a Python float > 0, got {eps!r}")
    return device, n


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`, computed in fp32.

    x: [..., N] float; weight: [N] float on x's device; eps: a Python float > 0.
    Returns [..., N] contiguous, of dtype promote(weight.dtype, x.dtype).
    """
    device, n = _check_norm(x, weight, eps)
    rows = _unit_last_stride("x", x.reshape(-1, n), may_copy=True)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    if rows.shape[0] == 0:
        return out
    with _guard(device):
        _kernels.rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), n, eps, BLOCK=triton.next_power_of_2(n), num_warps=4
        )
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`(x * cos) + (rotate_half(x) * sin)` for x = q and k, cos / sin broadcast over the heads.

    q: [B, Hq, L, D], k: [B, Hkv, L, D], same float dtype, last dim contiguous (any other strides, e.g. the
    transposed view a projection gives); cos, sin: [B, L, D]; D even.
    Returns (q_embed, k_embed), contiguous, of dtype promote(q.dtype, cos.dtype).
    """
    device = _run_device("q", q)
    _check_tensor("q", q, "[B, Hq, L, D]", (None, None, None, None), FLOAT_DTYPES)
    batch, num_q_heads, length, head_dim = q.shape
    _check(head_dim % 2 == 0, f"q.shape[-1] (head_dim) must be even, got {head_dim}")
    _check_tensor("k", k, "[B, Hkv, L, D]", (batch, None, length, head_dim), (q.dtype,))
    _check_tensor("cos", cos, "[B, L, D]", (batch, length, head_dim), FLOAT_DTYPES)
    _check_tensor("sin", sin, "[B, L, D]", (batch, length, head_dim), (cos.dtype,))
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        _check_on(name, t, device)
    num_kv_heads = k.shape[1]
    _check(
        1 <= num_q_heads <= MAX_ROPE_HEADS and 1 <= num_kv_heads <= MAX_ROPE_HEADS,
        f"q and k must have 1 to {MAX_ROPE_HEADS} heads, got {num_q_heads} and {num_kv_heads}",
    )
    q, k = _unit_last_stride("q", q, may_copy=True), _unit_last_stride("k", k, may_copy=True)
    cos, sin = _unit_last_stride("cos", cos, may_copy=True), _unit_last_stride("sin", sin, may_copy=True)
    dtype = torch.promote_types(q.dtype, cos.dtype)
    q_out = torch.empty(q.shape, dtype=dtype, device=device)
    k_out = torch.empty(k.shape, dtype=dtype, device=device)
    if q.numel() == 0:
        return q_out, k_out
    half = head_dim // 2
    with _guard(device):
        _kernels.rope_kernel[(batch * length,)](
            q, k, cos, sin, q_out, k_out, length, num_q_heads, num_kv_heads,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            HALF=half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=triton.next_power_of_2(half),
            num_warps=4,
        )  # fmt: skip
    return q_out, k_out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h, rms_norm(h, weight, eps)) with h = x + residual rounded to x's dtype, in one kernel: a decoder layer's
    residual add followed by the next RMSNorm.

    x, residual: [..., N], same float dtype and shape; weight: [N] float; eps: a Python float > 0.
    Returns (h [..., N] of x's dtype, normed [..., N] of dtype promote(weight.dtype, x.dtype)), contiguous.
    """
    device, n = _check_norm(x, weight, eps)
    _check_tensor("residual", residual, "[..., N]", tuple(x.shape), (x.dtype,))
    _check_on("residual", residual, device)
    rows = _unit_last_stride("x", x.reshape(-1, n), may_copy=True)
    res = _unit_last_stride("residual", residual.reshape(-1, n), may_copy=True)
    weight = weight.contiguous()
    h = torch.empty(x.shape, dtype=x.dtype, device=device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=device)
    if rows.shape[0] == 0:
        return h, out
    with _guard(device):
        _kernels.add_rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, h, out, rows.stride(0), res.stride(0), n, eps,
            BLOCK=triton.next_power_of_2(n), num_warps=4,
        )  # fmt: skip
    return h, out


SILU_BLOCK = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a [..., 2 N] tensor holding gate then up (the concatenated gate / up projection), in
    one kernel, rounded as torch's two ops round. Returns [..., N] contiguous, of gate_up's dtype."""
    device = _run_device("gate_up", gate_up)
    _check(
        gate_up.dim() >= 1 and gate_up.dtype in FLOAT_DTYPES and gate_up.shape[-1] % 2 == 0,
        f"gate_up must be a float tensor [..., 2 N], got {gate_up.dtype} {tuple(gate_up.shape)}",
    )
    n = gate_up.shape[-1] // 2
    rows = _unit_last_stride("gate_up", gate_up.reshape(-1, 2 * n), may_copy=True)
    out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=device)
    if rows.shape[0] == 0 or n == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(n))
    with _guard(device):
        _kernels.silu_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), n, BLOCK=block, num_warps=4
        )
    return out
