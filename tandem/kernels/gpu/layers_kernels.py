"""The model's own small layers, fused (`tandem.engine.fused` swaps them in): RMSNorm, residual add +
RMSNorm, rotary embedding and SiLU * up. Only `@triton.jit` functions live here; `layers.py` validates and
launches.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [rows, N], last dim contiguous
    w_ptr,  # [N]
    out_ptr,  # [rows, N] contiguous, the dtype torch would give `w * x.to(x.dtype)`
    stride_x,
    N,
    eps,
    BLOCK: tl.constexpr,
):
    """One row: x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then times the weight (rounded to the
    output dtype), the order of operations of Llama's RMSNorm, so one kernel gives what its seven give."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    normed = _rms_norm_row(x_raw, w_ptr, cols, live, N, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, normed, mask=live)


@triton.jit
def _rms_norm_row(x_raw, w_ptr, cols, live, N, eps, OUT: tl.constexpr):
    """Llama's RMSNorm of one row held in registers: normalized in fp32, rounded to the row's dtype, then times
    the weight, rounded to OUT."""
    x = x_raw.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / N
    normed = (x * (1.0 / tl.sqrt(variance + eps))).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)
    return (w * normed).to(OUT)


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, OUT: tl.constexpr):
    """(x * cos) + (rotate_half(x) * sin) with each product and the sum rounded to OUT, as torch's three
    elementwise ops round; rotate_half(x) = cat(-x2, x1)."""
    a1 = (x1 * c1).to(OUT).to(tl.float32)
    b1 = (-x2 * s1).to(OUT).to(tl.float32)
    a2 = (x2 * c2).to(OUT).to(tl.float32)
    b2 = (x1 * s2).to(OUT).to(tl.float32)
    return (a1 + b1).to(OUT), (a2 + b2).to(OUT)


@triton.jit
def rope_kernel(
    q_ptr,  # [B, Hq, L, D], last dim contiguous
    k_ptr,  # [B, Hkv, L, D]
    cos_ptr,  # [B, L, D]
    sin_ptr,
    q_out_ptr,  # [B, Hq, L, D] contiguous
    k_out_ptr,  # [B, Hkv, L, D] contiguous
    L,
    num_q_heads,
    num_kv_heads,
    stride_qb,
    stride_qh,
    stride_ql,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_cb,
    stride_cl,
    stride_sb,
    stride_sl,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (B * L,): every query and key head of one token, rotated by that token's cos / sin."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // L
    pos = pid % L
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    c_base = cos_ptr + b * stride_cb + pos * stride_cl
    s_base = sin_ptr + b * stride_sb + pos * stride_sl
    c1 = tl.load(c_base + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c_base + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s_base + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s_base + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    q_src = q_ptr + b * stride_qb + pos * stride_ql
    k_src = k_ptr + b * stride_kb + pos * stride_kl
    _rope_heads(
        q_src, stride_qh, q_out_ptr, b, pos, L, num_q_heads, c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_HALF
    )
    _rope_heads(
        k_src, stride_kh, k_out_ptr, b, pos, L, num_kv_heads, c1, c2, s1, s2, HALF, BLOCK_HKV, BLOCK_HALF
    )


@triton.jit
def _rope_heads(
    src, stride_h, out_ptr, b, pos, L, num_heads, c1, c2, s1, s2,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rotate every head of one token (src: its head 0), into the contiguous [B, H, L, 2 * HALF] output."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    ok = (h < num_heads)[:, None] & (d < HALF)[None, :]
    x1 = tl.load(src + h[:, None] * stride_h + d[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + h[:, None] * stride_h + HALF + d[None, :], mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, out_ptr.dtype.element_ty)
    dst = out_ptr + ((b * num_heads + h[:, None]) * L + pos) * (2 * HALF) + d[None, :]
    tl.store(dst, o1, mask=ok)
    tl.store(dst + HALF, o2, mask=ok)


@triton.jit
def add_rms_norm_kernel(
    x_ptr,  # [rows, N], last dim contiguous: the sublayer's output
    r_ptr,  # [rows, N], last dim contiguous: the residual stream
    w_ptr,  # [N]
    sum_ptr,  # [rows, N] contiguous, x's dtype: the new residual x + r
    out_ptr,  # [rows, N] contiguous: RMSNorm of the new residual
    stride_x,
    stride_r,
    N,
    eps,
    BLOCK: tl.constexpr,
):
    """One row: h = x + r rounded to x's dtype (as torch's add rounds), then Llama's RMSNorm of h, so the
    residual add and the next norm are one kernel."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    live = cols < N
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
    r = tl.load(r_ptr + row * stride_r + cols, mask=live, other=0.0).to(tl.float32)
    h_raw = (x_raw.to(tl.float32) + r).to(x_raw.dtype)
    tl.store(sum_ptr + row * N + cols, h_raw, mask=live)
    normed = _rms_norm_row(h_raw, w_ptr, cols, live, N, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * N + cols, normed, mask=live)


@triton.jit
def silu_mul_kernel(
    gu_ptr,  # [rows, 2 * N], last dim contiguous: gate then up
    out_ptr,  # [rows, N] contiguous
    stride_gu,
    N,
    BLOCK: tl.constexpr,
):
    """Grid (rows, cdiv(N, BLOCK)): silu(gate) rounded to the input dtype, times up, rounded again: what
    `act_fn(gate_proj(x)) * up_proj(x)` computes in two kernels."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < N
    g_raw = tl.load(gu_ptr + row * stride_gu + cols, mask=live, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + N + cols, mask=live, other=0.0).to(tl.float32)
    g = g_raw.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(g_raw.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (act * u).to(out_ptr.dtype.element_ty), mask=live)
