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
#pragma once

#include <cmath>

#include "tandem_cpu.h"

namespace tandem {
namespace {

constexpr float kNegInf = -__builtin_inff();
// Rows are resolved into a ring ahead of the tile being computed and prefetched as they enter it, so K/V
// lines stream in while earlier tiles compute: a row is only 4-8 cache lines, and one core needs tens of
// misses in flight to keep up with its share of DRAM bandwidth.
constexpr int64_t kRing = 256;  // power of two, >= kTile + the largest prefetch distance

// (std::min/max would instantiate shared templates in every ISA's translation unit)
inline int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// out[j] = sum of s[j] for QB accumulators, four at a time where possible.
template <class V, int QB>
inline void reduce_rows(const typename V::reg* s, float* out) {
  int j = 0;
  for (; j + 4 <= QB; j += 4) V::reduce4(s[j], s[j + 1], s[j + 2], s[j + 3], out + j);
  for (; j < QB; ++j) out[j] = V::reduce_add(s[j]);
}

// logits[j][r] = q_j . k_r for the n rows of a tile (q: [QB, D] in layout order).
template <class V, class T, int QB>
inline void logits_generic(const float* q, int64_t D, const T* const* krows, int n, float (*logits)[kTile]) {
  const int64_t d2 = D / (2 * V::W) * (2 * V::W);
  for (int r = 0; r < n; ++r) {
    const T* k = krows[r];
    typename V::reg s[QB];
    for (int j = 0; j < QB; ++j) s[j] = V::zero();
    for (int64_t d = 0; d < d2; d += 2 * V::W) {
      typename V::reg lo, hi;
      V::load2(k + d, lo, hi);
      for (int j = 0; j < QB; ++j) {
        s[j] = V::fma(V::load(q + j * D + d), lo, s[j]);
        s[j] = V::fma(V::load(q + j * D + d + V::W), hi, s[j]);
      }
    }
    float dot[QB];
    reduce_rows<V, QB>(s, dot);
    for (int j = 0; j < QB; ++j) {
      for (int64_t e = d2; e < D; ++e) dot[j] += q[j * D + e] * to_f32(k[e]);
      logits[j][r] = dot[j];
    }
  }
}

// An ISA may specialise this (isa_avx512bf16.cpp does, for bf16 keys).
template <class V, class T, int QB>
struct Logits {
  static void run(const float* q, int64_t D, const T* const* krows, int n, float (*logits)[kTile]) {
    logits_generic<V, T, QB>(q, D, krows, n, logits);
  }
};

// One online-softmax step of QB queries over one tile of n <= kTile rows.
// m, l: [QB] running max (log2 domain) and sum; acc: [QB, D] unnormalised output, layout order.
template <class V, class T, int QB>
inline void tile_step(const float* q, int64_t D, const T* const* krows, const T* const* vrows, int n,
                      float* m, float* l, float* acc) {
  alignas(64) float logits[QB][kTile];
  alignas(64) float p[QB][kTile];
  float alpha[QB];
  Logits<V, T, QB>::run(q, D, krows, n, logits);
  for (int j = 0; j < QB; ++j) {
    for (int r = n; r < kTile; ++r) logits[j][r] = kNegInf;
    auto vmax = V::load(&logits[j][0]);
    for (int i = V::W; i < kTile; i += V::W) vmax = V::max(vmax, V::load(&logits[j][i]));
    const float m_new = std::fmax(m[j], V::reduce_max(vmax));
    alpha[j] = std::exp2(m[j] - m_new);  // 0 on the first tile (m = -inf)
    const auto shift = V::set1(m_new);
    auto sum = V::zero();
    for (int i = 0; i < kTile; i += V::W) {
      const auto e = V::exp2(V::sub(V::load(&logits[j][i]), shift));
      V::store(&p[j][i], e);
      sum = V::add(sum, e);
    }
    l[j] = l[j] * alpha[j] + V::reduce_add(sum);
    m[j] = m_new;
  }
  // acc = acc * alpha + p @ V, one 2W-wide column strip at a time so the accumulators stay in registers
  const int64_t d2 = D / (2 * V::W) * (2 * V::W);
  for (int64_t d = 0; d < d2; d += 2 * V::W) {
    typename V::reg o_lo[QB], o_hi[QB];
    for (int j = 0; j < QB; ++j) {
      o_lo[j] = V::mul(V::load(acc + j * D + d), V::set1(alpha[j]));
      o_hi[j] = V::mul(V::load(acc + j * D + d + V::W), V::set1(alpha[j]));
    }
    for (int r = 0; r < n; ++r) {
      typename V::reg lo, hi;
      V::load2(vrows[r] + d, lo, hi);
      for (int j = 0; j < QB; ++j) {
        const auto w = V::set1(p[j][r]);
        o_lo[j] = V::fma(w, lo, o_lo[j]);
        o_hi[j] = V::fma(w, hi, o_hi[j]);
      }
    }
    for (int j = 0; j < QB; ++j) {
      V::store(acc + j * D + d, o_lo[j]);
      V::store(acc + j * D + d + V::W, o_hi[j]);
    }
  }
  for (int64_t d = d2; d < D; ++d) {
    for (int j = 0; j < QB; ++j) {
      float o = acc[j * D + d] * alpha[j];
      for (int r = 0; r < n; ++r) o += p[j][r] * to_f32(vrows[r][d]);
      acc[j * D + d] = o;
    }
  }
}

template <int Hint>
inline void prefetch_row(const char* k, const char* v, int64_t row_bytes, int64_t step) {
  for (int64_t off = 0; off < row_bytes; off += step) {
#if defined(__x86_64__) || defined(__i386__)
    // inline asm, not __builtin_prefetch: GCC 12 deletes a loop whose body is only prefetch builtins
    // once it is inlined (no side effects), silently removing every prefetch of this kernel
    if (Hint == 3) {
      asm volatile("prefetcht0 %0\n\tprefetcht0 %1" ::"m"(k[off]), "m"(v[off]));
    } else if (Hint == 2) {
      asm volatile("prefetcht1 %0\n\tprefetcht1 %1" ::"m"(k[off]), "m"(v[off]));
    } else if (Hint == 1) {
      asm volatile("prefetcht2 %0\n\tprefetcht2 %1" ::"m"(k[off]), "m"(v[off]));
    } else {
      asm volatile("prefetchnta %0\n\tprefetchnta %1" ::"m"(k[off]), "m"(v[off]));
    }
#else
    __builtin_prefetch(k + off, 0, Hint);
    __builtin_prefetch(v + off, 0, Hint);
    asm volatile("");  // keeps the loop (see above)
#endif
  }
}

// An if-chain, not a switch: GCC 12 at -O2 also drops the prefetches of the switch form.
inline void prefetch_row(int hint, const void* k, const void* v, int64_t row_bytes, int64_t step) {
  const char* kc = static_cast<const char*>(k);
  const char* vc = static_cast<const char*>(v);
  if (hint == 1) {
    prefetch_row<1>(kc, vc, row_bytes, step);
  } else if (hint == 3) {
    prefetch_row<3>(kc, vc, row_bytes, step);
  } else if (hint == 2) {
    prefetch_row<2>(kc, vc, row_bytes, step);
  } else if (hint == 0) {
    prefetch_row<0>(kc, vc, row_bytes, step);
  }
}

template <class V, class T, int QB>
inline void tile_queries(const float* q, int64_t nq, int64_t D, const T* const* krows, const T* const* vrows,
                         int n, float* m, float* l, float* acc) {
  for (int64_t j = 0; j < nq; j += QB) tile_step<V, T, QB>(q + j * D, D, krows, vrows, n, m + j, l + j, acc + j * D);
}

template <class V, class T>
void attend_piece(const AttendArgs& a, int64_t seg, int64_t lo, int64_t hi, float* state, int64_t* bad_rows) {
  const int64_t b = seg / a.num_kv_heads, h = seg % a.num_kv_heads;
  const T* k_base = static_cast<const T*>(a.k) + b * a.k_stride_b + h * a.k_stride_h;
  const T* v_base = static_cast<const T*>(a.v) + b * a.v_stride_b + h * a.v_stride_h;
  const int64_t* idx = a.indices + seg * a.width;
  const uint8_t* mask = a.key_mask ? a.key_mask + b * a.cap : nullptr;
  const int64_t nq = a.nq, D = a.head_dim, bs = a.block_size, cap = a.cap;
  const float* q = a.q + seg * nq * D;
  float* m = state;
  float* l = state + nq;
  float* acc = state + 2 * nq;
  for (int64_t j = 0; j < nq; ++j) m[j] = kNegInf, l[j] = 0.f;
  std::memset(acc, 0, sizeof(float) * nq * D);

  const T* ring_k[kRing];
  const T* ring_v[kRing];
  int64_t produced = 0, consumed = 0, pos = lo;
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(T));
  const int hint = static_cast<int>(a.prefetch_hint);
  const int64_t ahead = clamp64(a.prefetch_rows, 0, kRing - kTile);
  const int64_t step = clamp64(a.prefetch_step, 64, 4096);
  // resolve rows until `target` are queued: out-of-range ids are counted and skipped, masked rows skipped
  auto produce = [&](int64_t target) {
    while (produced < target && pos < hi) {
      const int64_t row = bs == 1 ? idx[pos] : idx[pos / bs] * bs + pos % bs;
      ++pos;
      if (static_cast<uint64_t>(row) >= static_cast<uint64_t>(cap)) {
        ++*bad_rows;
        continue;
      }
      if (mask && !mask[row]) continue;
      const T* k = k_base + row * a.k_stride_row;
      const T* v = v_base + row * a.v_stride_row;
      prefetch_row(hint, k, v, row_bytes, step);
      ring_k[produced & (kRing - 1)] = k;
      ring_v[produced & (kRing - 1)] = v;
      ++produced;
    }
  };
  const T* krows[kTile];
  const T* vrows[kTile];
  for (;;) {
    // the rows of this tile and `ahead` more are resolved, and so prefetched, before it computes
    produce(consumed + kTile + ahead);
    const int n = static_cast<int>(clamp64(produced - consumed, 0, kTile));
    if (n == 0) break;
    for (int r = 0; r < n; ++r) {
      krows[r] = ring_k[(consumed + r) & (kRing - 1)];
      vrows[r] = ring_v[(consumed + r) & (kRing - 1)];
    }
    consumed += n;
    // query blocks of 8/4/2/1 keep each block's accumulators in registers
    const int64_t nq8 = nq / 8 * 8, rest = nq - nq8;
    if (nq8) tile_queries<V, T, 8>(q, nq8, D, krows, vrows, n, m, l, acc);
    if (rest & 4) {
      const int64_t j = nq8;
      tile_queries<V, T, 4>(q + j * D, 4, D, krows, vrows, n, m + j, l + j, acc + j * D);
    }
    if (rest & 2) {
      const int64_t j = nq8 + (rest & 4);
      tile_queries<V, T, 2>(q + j * D, 2, D, krows, vrows, n, m + j, l + j, acc + j * D);
    }
    if (rest & 1) {
      const int64_t j = nq - 1;
      tile_queries<V, T, 1>(q + j * D, 1, D, krows, vrows, n, m + j, l + j, acc + j * D);
    }
  }
}

}  // namespace
}  // namespace tandem
