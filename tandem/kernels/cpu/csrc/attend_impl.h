// ISA-generic sparse-attention worker, written once against a small SIMD interface `V` and compiled
// once per ISA (included by each isa_*.cpp after its `#pragma GCC target` and its `V` struct). All of it
// has internal linkage, so per-ISA copies never merge at link time (a merged AVX-512 copy would crash
// on an AVX2-only host).
//
// V provides: W (lanes), reg, zero, set1, load(const float*), store, add, sub, mul, fma(a, b, c) = a*b + c,
// max, min, reduce_add, reduce_max, reduce4 (four sums at once), exp2 (inputs <= 0, -inf -> 0),
// load2<T>(p, lo, hi): 2W storage elements as two fp32 vectors in V's layout for T, and
// perm<T>(i): the natural index of layout position i within a 2W block (see layout_rows in score_impl.h).
// Rows of q (and of the output) are kept in that layout, so a bf16 row widens with one shift or one mask
// per 16 values instead of a cross-lane shuffle.
//
// A piece of selected rows is attended in spans of up to kSpan rows, two passes per span: the logits of
// every row of the span (K rows only, streamed and prefetched), one softmax step over the whole span, then
// p @ V (V rows only, streamed and prefetched). Each K and V byte is read once, the softmax bookkeeping
// (max, rescale of the accumulators) runs once per span instead of once per few rows, and each pass keeps
// its accumulators in registers.
//
// 8-bit stores (int8, e4m3fn) carry one fp32 scale per group of rows: a row's K scale multiplies its logits
// before the softmax step and its V scale its weights after it (the running sum l takes the weights before),
// so the codes widen in registers like bf16 and no dequantized copy is ever written.
#pragma once

#include <cmath>

#include "tandem_cpu.h"

namespace tandem {
namespace {

constexpr float kNegInf = -__builtin_inff();
// Rows per span: logits [kSpan][QB <= 8] fp32 is 32 KiB, and the span's K and V (256 KiB each for bf16,
// d=128) stay in L2 for the other query blocks and column strips.
constexpr int kSpan = 1024;

// (std::min/max would instantiate shared templates in every ISA's translation unit)
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// out[j] = sum of s[j] for QB accumulators, four at a time where possible.
template <class V, int QB>
inline void reduce_rows(const typename V::reg* s, float* out) {
  int j = 0;
  for (; j + 4 <= QB; j += 4) V::reduce4(s[j], s[j + 1], s[j + 2], s[j + 3], out + j);
  for (; j < QB; ++j) out[j] = V::reduce_add(s[j]);
}

// Vector registers of the ISA (AVX-512: 32, AVX2 and the scalar model: 16): the register blocks below are
// sized from it so that accumulators never spill.
template <class V>
constexpr int vector_registers() {
  return V::W >= 16 ? 32 : 16;
}

// Rows per register block of the logits: RB rows x QB queries of accumulators, RB rows of K (two vectors
// each) and one q (two vectors) must fit.
template <class V, int QB>
constexpr int logit_rows() {
  return 4 * QB + 8 + 2 <= vector_registers<V>() ? 4 : 2 * QB + 4 + 2 <= vector_registers<V>() ? 2 : 1;
}

// Column strips (2W columns each) per p @ V pass: two where 4 * QB accumulators, two strips of a V row
// (four vectors) and a broadcast weight fit.
template <class V, int QB>
constexpr int pv_strips_per_pass() {
  return 4 * QB + 4 + 1 <= vector_registers<V>() ? 2 : 1;
}

template <int Hint>
inline void prefetch_lines(const char* p, int64_t bytes, int64_t step) {
  for (int64_t off = 0; off < bytes; off += step) {
#if defined(__x86_64__) || defined(__i386__)
    // inline asm, not __builtin_prefetch: GCC 12 deletes a loop whose body is only prefetch builtins
    // once it is inlined (no side effects), silently removing every prefetch of this kernel
    if (Hint == 3) {
      asm volatile("prefetcht0 %0" ::"m"(p[off]));
    } else if (Hint == 2) {
      asm volatile("prefetcht1 %0" ::"m"(p[off]));
    } else if (Hint == 1) {
      asm volatile("prefetcht2 %0" ::"m"(p[off]));
    } else {
      asm volatile("prefetchnta %0" ::"m"(p[off]));
    }
#else
    __builtin_prefetch(p + off, 0, Hint);
    asm volatile("");  // keeps the loop (see above)
#endif
  }
}

// How a pass prefetches the rows it will read: `ahead` rows ahead, locality `hint` (-1: none), one
// prefetch every `step` bytes of a row.
struct Prefetch {
  int hint;
  int64_t ahead, row_bytes, step;
  // An if-chain, not a switch: GCC 12 at -O2 also drops the prefetches of the switch form.
  void row(const void* p) const {
    const char* c = static_cast<const char*>(p);
    if (hint == 3) {
      prefetch_lines<3>(c, row_bytes, step);
    } else if (hint == 1) {
      prefetch_lines<1>(c, row_bytes, step);
    } else if (hint == 2) {
      prefetch_lines<2>(c, row_bytes, step);
    } else if (hint == 0) {
      prefetch_lines<0>(c, row_bytes, step);
    }
  }
};

// logits[(r0 + r) * QB + j] = q_j . k_{r0 + r} for RB rows: each q vector loaded once serves RB rows, and
// the RB * QB accumulator chains are independent (the FMA latency is hidden).
template <class V, class T, int QB, int RB>
inline void logit_block(const float* q, int64_t D, const T* const* krows, int r0, float* logits) {
  const int64_t d2 = D / (2 * V::W) * (2 * V::W);
  typename V::reg s[RB][QB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < QB; ++j) s[r][j] = V::zero();
  for (int64_t d = 0; d < d2; d += 2 * V::W) {
    typename V::reg lo[RB], hi[RB];
    for (int r = 0; r < RB; ++r) V::load2(krows[r0 + r] + d, lo[r], hi[r]);
    for (int j = 0; j < QB; ++j) {
      const auto qlo = V::load(q + j * D + d);
      const auto qhi = V::load(q + j * D + d + V::W);
      for (int r = 0; r < RB; ++r) {
        s[r][j] = V::fma(qlo, lo[r], s[r][j]);
        s[r][j] = V::fma(qhi, hi[r], s[r][j]);
      }
    }
  }
  for (int r = 0; r < RB; ++r) {
    float* dot = logits + (r0 + r) * QB;
    reduce_rows<V, QB>(s[r], dot);
    const T* k = krows[r0 + r];
    for (int64_t e = d2; e < D; ++e)
      for (int j = 0; j < QB; ++j) dot[j] += q[j * D + e] * to_f32(k[e]);
  }
}

// Pass 1 of a span: the logits of its n rows for QB queries. One prefetch stream runs `ahead` rows in front of
// the row being read: K rows, then on into the V rows that pass 2 starts with, so neither pass begins with a
// burst of misses (pf null: the rows are in cache already).
template <class V, class T, int QB>
inline void logits_pass(const float* q, int64_t D, const T* const* krows, const T* const* vrows, int n,
                        float* logits, const Prefetch* pf) {
  constexpr int RB = logit_rows<V, QB>();
  int r = 0;
  for (; r + RB <= n; r += RB) {
    if (pf != nullptr) {
      for (int i = 0; i < RB; ++i) {
        const int64_t j = r + i + pf->ahead;
        if (j < n) {
          pf->row(krows[j]);
        } else if (j < 2 * static_cast<int64_t>(n)) {
          pf->row(vrows[j - n]);
        }
      }
    }
    logit_block<V, T, QB, RB>(q, D, krows, r, logits);
  }
  for (; r < n; ++r) logit_block<V, T, QB, 1>(q, D, krows, r, logits);
}

// One online-softmax step over a span: logits [n][QB] (log2 domain) become weights p = 2^(logit - m_new)
// in place; m, l: [QB] running max and sum; alpha[j] = 2^(m_old - m_new) rescales what came before.
// Lanes of a vector hold consecutive (row, query) pairs, so lane i of vector v is query (v * W + i) % QB:
// `phases` running vectors cover that pattern (1 when QB divides W).
template <class V, int QB>
inline void softmax_span(float* logits, int n, float* m, float* l, float* alpha) {
  constexpr int phases = QB > V::W ? QB / V::W : 1;
  constexpr int period = phases * V::W;
  const int total = n * QB;
  const int padded = (total + period - 1) / period * period;
  for (int i = total; i < padded; ++i) logits[i] = kNegInf;  // weight 0, no effect on the max
  typename V::reg vmax[phases];
  for (int ph = 0; ph < phases; ++ph) vmax[ph] = V::set1(kNegInf);
  for (int i = 0; i < padded; i += period)
    for (int ph = 0; ph < phases; ++ph) vmax[ph] = V::max(vmax[ph], V::load(logits + i + ph * V::W));
  alignas(64) float lanes[period];
  for (int ph = 0; ph < phases; ++ph) V::store(lanes + ph * V::W, vmax[ph]);
  float m_new[QB];
  for (int j = 0; j < QB; ++j) m_new[j] = m[j];
  for (int t = 0; t < period; ++t) m_new[t % QB] = max_num(m_new[t % QB], lanes[t]);
  alignas(64) float shift_lanes[period];
  for (int t = 0; t < period; ++t) shift_lanes[t] = m_new[t % QB];
  typename V::reg shift[phases], sum[phases];
  for (int ph = 0; ph < phases; ++ph) {
    shift[ph] = V::load(shift_lanes + ph * V::W);
    sum[ph] = V::zero();
  }
  for (int i = 0; i < padded; i += period) {
    for (int ph = 0; ph < phases; ++ph) {
      const auto e = V::exp2(V::sub(V::load(logits + i + ph * V::W), shift[ph]));
      V::store(logits + i + ph * V::W, e);
      sum[ph] = V::add(sum[ph], e);
    }
  }
  for (int ph = 0; ph < phases; ++ph) V::store(lanes + ph * V::W, sum[ph]);
  float span_sum[QB] = {};
  for (int t = 0; t < period; ++t) span_sum[t % QB] += lanes[t];
  for (int j = 0; j < QB; ++j) {
    // m_new = -inf only if every weight so far is 0 (all rows masked): keep alpha finite then
    alpha[j] = m_new[j] == kNegInf ? 1.f : std::exp2(m[j] - m_new[j]);
    l[j] = l[j] * alpha[j] + span_sum[j];
    m[j] = m_new[j];
  }
}

// acc[:, d : d + CB * 2W] = acc * alpha + p @ V over the n rows of a span (p: [n][QB]).
template <class V, class T, int QB, int CB>
inline void pv_strips(int64_t D, int64_t d, const T* const* vrows, int n, const float* p, const float* alpha,
                      float* acc, const Prefetch* pf) {
  typename V::reg o[CB][2][QB];
  for (int c = 0; c < CB; ++c) {
    for (int j = 0; j < QB; ++j) {
      const auto a = V::set1(alpha[j]);
      o[c][0][j] = V::mul(V::load(acc + j * D + d + c * 2 * V::W), a);
      o[c][1][j] = V::mul(V::load(acc + j * D + d + c * 2 * V::W + V::W), a);
    }
  }
  for (int r = 0; r < n; ++r) {
    if (pf != nullptr && r + pf->ahead < n) pf->row(vrows[r + pf->ahead]);
    typename V::reg lo[CB], hi[CB];
    for (int c = 0; c < CB; ++c) V::load2(vrows[r] + d + c * 2 * V::W, lo[c], hi[c]);
    for (int j = 0; j < QB; ++j) {
      const auto w = V::set1(p[r * QB + j]);
      for (int c = 0; c < CB; ++c) {
        o[c][0][j] = V::fma(w, lo[c], o[c][0][j]);
        o[c][1][j] = V::fma(w, hi[c], o[c][1][j]);
      }
    }
  }
  for (int c = 0; c < CB; ++c) {
    for (int j = 0; j < QB; ++j) {
      V::store(acc + j * D + d + c * 2 * V::W, o[c][0][j]);
      V::store(acc + j * D + d + c * 2 * V::W + V::W, o[c][1][j]);
    }
  }
}

// Pass 2 of a span: acc = acc * alpha + p @ V in column strips; the first strip pass prefetches V rows
// ahead (whole rows), the later ones find them in cache.
template <class V, class T, int QB>
inline void pv_pass(int64_t D, const T* const* vrows, int n, const float* p, const float* alpha, float* acc,
                    const Prefetch* pf) {
  constexpr int CB = pv_strips_per_pass<V, QB>();
  const int64_t strip = 2 * V::W;
  const int64_t d2 = D / strip * strip;
  int64_t d = 0;
  for (; d + CB * strip <= d2; d += CB * strip)
    pv_strips<V, T, QB, CB>(D, d, vrows, n, p, alpha, acc, d == 0 ? pf : nullptr);
  for (; d < d2; d += strip) pv_strips<V, T, QB, 1>(D, d, vrows, n, p, alpha, acc, d == 0 ? pf : nullptr);
  for (int64_t e = d2; e < D; ++e) {
    for (int j = 0; j < QB; ++j) {
      float o = acc[j * D + e] * alpha[j];
      for (int r = 0; r < n; ++r) o += p[r * QB + j] * to_f32(vrows[r][e]);
      acc[j * D + e] = o;
    }
  }
}

// x[r * QB + j] *= row_scale[r] for the n rows of a span.
template <int QB>
inline void scale_span_rows(float* x, const float* row_scale, int n) {
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < QB; ++j) x[r * QB + j] *= row_scale[r];
}

// Both passes of one span for queries [0, QB) of q (m, l, acc offset to them by the caller).
// `first`: the span's first query block, the one that streams its rows in (later blocks find them in cache).
// k_scales / v_scales: [n] per-row scales of an 8-bit store (unused otherwise).
template <class V, class T, int QB>
inline void span_queries(const float* q, int64_t D, const T* const* krows, const T* const* vrows,
                         const float* k_scales, const float* v_scales, int n, float* m, float* l, float* acc,
                         float* logits, const Prefetch& pf, bool first) {
  float alpha[QB];
  logits_pass<V, T, QB>(q, D, krows, vrows, n, logits, first ? &pf : nullptr);
  if constexpr (is_quantized<T>::value) scale_span_rows<QB>(logits, k_scales, n);
  softmax_span<V, QB>(logits, n, m, l, alpha);
  // after the softmax step: l sums the weights themselves, p @ V takes each times its row's V scale
  if constexpr (is_quantized<T>::value) scale_span_rows<QB>(logits, v_scales, n);
  pv_pass<V, T, QB>(D, vrows, n, logits, alpha, acc, first ? &pf : nullptr);
}

template <class V, class T>
void attend_piece(const AttendArgs& a, int64_t seg, int64_t lo, int64_t hi, float* state, int64_t* bad_rows) {
  const int64_t b = seg / a.num_kv_heads, h = seg % a.num_kv_heads;
  const RowStore st = store_of(a, b);
  const int64_t shared_b = a.stores != nullptr ? 0 : b;  // a shared store's request offset
  const T* k_base = static_cast<const T*>(st.k) + shared_b * a.k_stride_b + h * st.k_stride_h;
  const T* v_base = static_cast<const T*>(st.v) + shared_b * a.v_stride_b + h * st.v_stride_h;
  const int64_t k_stride_row = st.k_stride_row, v_stride_row = st.v_stride_row;
  const int64_t* idx = a.indices + seg * a.width;
  const uint8_t* mask = st.key_mask;
  const int64_t nq = a.nq, D = a.head_dim, bs = a.block_size, cap = st.cap;
  const float* q = a.q + seg * nq * D;
  float* m = state;
  float* l = state + nq;
  float* acc = state + 2 * nq;
  for (int64_t j = 0; j < nq; ++j) m[j] = kNegInf, l[j] = 0.f;
  std::memset(acc, 0, sizeof(float) * nq * D);

  const Prefetch pf{static_cast<int>(a.prefetch_hint), clamp64(a.prefetch_rows, 0, kSpan),
                    D * static_cast<int64_t>(sizeof(T)), clamp64(a.prefetch_step, 64, 4096)};
  const T* krows[kSpan];
  const T* vrows[kSpan];
  alignas(64) float logits[kSpan * 8 + 64];  // [rows][QB <= 8], padded to whole vectors
  // 8-bit stores: the scales of the span's rows, and the scale rows of this segment
  constexpr int kScaled = is_quantized<T>::value ? kSpan : 1;
  float k_scales[kScaled], v_scales[kScaled];
  const float* ks_base = nullptr;
  const float* vs_base = nullptr;
  if constexpr (is_quantized<T>::value) {
    ks_base = st.k_scale + h * st.ks_stride_h;
    vs_base = st.v_scale + h * st.vs_stride_h;
  }
  int64_t pos = lo;
  while (pos < hi) {
    // resolve the span's rows: out-of-range ids are counted and skipped, masked rows skipped
    int n = 0;
    for (; n < kSpan && pos < hi; ++pos) {
      // the id is range-checked before it is scaled: a huge id times bs would overflow int64 (undefined)
      const int64_t id = idx[bs == 1 ? pos : pos / bs];
      const int64_t row = static_cast<uint64_t>(id) < static_cast<uint64_t>((cap + bs - 1) / bs) ? id * bs + pos % bs : -1;
      if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(cap)) {
        ++*bad_rows;
        continue;
      }
      if (mask && !mask[row]) continue;
      krows[n] = k_base + row * k_stride_row;
      vrows[n] = v_base + row * v_stride_row;
      if constexpr (is_quantized<T>::value) {
        k_scales[n] = ks_base[row / a.scale_rows];
        v_scales[n] = vs_base[row / a.scale_rows];
      }
      if (n < pf.ahead) pf.row(krows[n]);  // the lead of the prefetch stream (the rest: inside the passes)
      ++n;
    }
    if (n == 0) continue;
    // a span shorter than the lead: the stream's lead reaches into its V rows as well
    for (int r = 0; r < n && n + r < pf.ahead; ++r) pf.row(vrows[r]);
    // query blocks of 8/4/2/1 keep each block's accumulators in registers
    int64_t j = 0;
    for (; j + 8 <= nq; j += 8)
      span_queries<V, T, 8>(q + j * D, D, krows, vrows, k_scales, v_scales, n, m + j, l + j,
                            acc + j * D, logits, pf, j == 0);
    if (nq - j >= 4) {
      span_queries<V, T, 4>(q + j * D, D, krows, vrows, k_scales, v_scales, n, m + j, l + j,
                            acc + j * D, logits, pf, j == 0);
      j += 4;
    }
    if (nq - j >= 2) {
      span_queries<V, T, 2>(q + j * D, D, krows, vrows, k_scales, v_scales, n, m + j, l + j,
                            acc + j * D, logits, pf, j == 0);
      j += 2;
    }
    if (nq - j >= 1)
      span_queries<V, T, 1>(q + j * D, D, krows, vrows, k_scales, v_scales, n, m + j, l + j,
                            acc + j * D, logits, pf, j == 0);
  }
}

}  // namespace
}  // namespace tandem
