"""Triton helpers shared by the kernel files (`attention_kernels`, `selection_kernels`, `recall_kernels`): the
fp32-accumulating dot, the online softmax (its empty state, one step, the normalisation), and the decode of
8-bit KV rows.

Only `@triton.jit` functions live here; a kernel that calls one imports it by name (Triton resolves a helper
through the calling kernel's module globals).
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with fp32 accumulation. UPCAST (interpreter only) multiplies in fp32: the interpreter's dot would
    multiply bfloat16 bit patterns as integers. Products of 16-bit values are exact in fp32, so this matches."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _empty_state(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax before any key: m_i = -inf, l_i = 0 ([ROWS] fp32), acc = 0 ([ROWS, BLOCK_D] fp32)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def _attend_tile(q, k, v, live, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step.

    q: [GROUP_PAD, D]; k, v: [N, D] (q's dtype); live: [1, N] or [GROUP_PAD, N] bool.
    m_i, l_i: [GROUP_PAD] fp32 running max / sum; acc: [GROUP_PAD, D] fp32 unnormalised output.
    """
    qk = _dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale
    qk = tl.where(live, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    # a row that has seen no live key keeps m = -inf; shifting by 0 instead avoids (-inf) - (-inf) = NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(qk - m_safe[:, None])
    correction = tl.exp(m_i - m_safe)
    l_i = l_i * correction + tl.sum(p, axis=1)
    # half-precision V: P is rounded to V's dtype for the tensor-core dot (as flash attention does)
    acc = acc * correction[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _finish(m_i, l_i, acc):
    """Normalise: returns out [GROUP_PAD, D] fp32 and lse [GROUP_PAD] fp32 (-inf, out 0 where l_i = 0)."""
    empty = l_i == 0.0
    norm = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i + tl.log(norm))
    return acc / norm[:, None], lse


# 2**120: a float8 e4m3fn code's bits moved into fp32's fields carry an exponent 120 (= 127 - 7) too small
FP8_E4M3_SHIFT: tl.constexpr = tl.constexpr(2.0**120)


@triton.jit
def _e4m3_to_f32(code):
    """float8 e4m3fn codes read as uint8 -> fp32, exactly (0x7F / 0xFF, NaN, are never stored). Pure integer
    work and a multiply, so it runs in the interpreter and on every GPU (no native fp8 type needed)."""
    code = code.to(tl.uint32)
    bits = ((code & 0x80) << 24) | ((code & 0x7F) << 20)
    normal = bits.to(tl.float32, bitcast=True) * FP8_E4M3_SHIFT
    # exponent field 0 would be an fp32 subnormal, which a GPU may flush to zero: decode those as m * 2**-9
    tiny = ((code & 0x07).to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    tiny = (tiny | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)  # the sign by its bit: -0 stays -0
    return tl.where((code & 0x78) == 0, tiny, normal)


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bfloat16 (ties to even), still in fp32: Triton 3.9's interpreter converts by
    truncation, a GPU rounds. Finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(
    base,
    row,
    stride,
    d,
    live,
    d_ok,
    scale_base,
    scale_group,
    DTYPE: tl.constexpr,
    QUANT: tl.constexpr,
    RNE_BF16: tl.constexpr,
):
    """Rows `row` [N] of one head of a KV store -> [N, BLOCK_D] (0 where not live or past HEAD_DIM).

    QUANT 0: the store's own values. QUANT 1 (int8 codes) and 2 (float8 e4m3fn codes, read as uint8): codes times
    the row's float32 scale scale_base[row // scale_group], in fp32, rounded to DTYPE (RNE_BF16, interpreter
    only: rounded to bfloat16 by `_round_bf16` first, so the conversion is exact).
    """
    ptrs = base + row[:, None] * stride + d[None, :]
    if QUANT == 0:
        rows = tl.load(ptrs, mask=live[:, None] & d_ok[None, :], other=0.0)
    else:
        codes = tl.load(ptrs, mask=live[:, None] & d_ok[None, :], other=0)
        if QUANT == 1:
            decoded = codes.to(tl.float32)
        else:
            decoded = _e4m3_to_f32(codes)
        row_scale = tl.load(scale_base + row // scale_group, mask=live, other=0.0)
        rows = decoded * row_scale[:, None]
        if RNE_BF16:
            rows = _round_bf16(rows)
        rows = rows.to(DTYPE)
    return rows
