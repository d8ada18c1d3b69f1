// ISA-generic block-scoring worker and the bandwidth probe (see attend_impl.h for the V interface).
#pragma once

#include <cmath>

#include "attend_impl.h"
#include "tandem_cpu.h"

namespace tandem {
namespace {

// best = max(best, max_j sum_d max(q_jd * min_d, q_jd * max_d)), written as q_pos . max + q_neg . min,
// which equals the bound for min <= max and takes two FMAs instead of two products and a max.
// The min/max of `nphys` physical blocks are combined on the fly (a logical block = factor physical ones).
// Each query keeps two accumulators (the max and the min terms): one chain of 2 * D / W dependent FMAs per
// query was latency-bound. Forced inline: GCC called it out of line, which was slower.
// Tried and dropped: two blocks per load of q (GCC folded the loads back into the FMAs and spilled) and software
// prefetch of the digests (they stream in order). Both measured in docs/cpu-kernels.md § Measured and not kept.
template <class V, class T, int QB>
[[gnu::always_inline]] inline void score_queries(const float* q_pos, const float* q_neg, int64_t D, const T* kmin,
                                                 const T* kmax, int64_t nphys, int64_t min_stride,
                                                 int64_t max_stride, float* best) {
  typename V::reg s[QB], t[QB];
  for (int j = 0; j < QB; ++j) s[j] = V::zero(), t[j] = V::zero();
  const int64_t d2 = D / (2 * V::W) * (2 * V::W);
  for (int64_t d = 0; d < d2; d += 2 * V::W) {
    typename V::reg lo_a, lo_b, hi_a, hi_b;
    V::load2(kmin + d, lo_a, lo_b);
    V::load2(kmax + d, hi_a, hi_b);
    for (int64_t p = 1; p < nphys; ++p) {
      typename V::reg x_a, x_b, y_a, y_b;
      V::load2(kmin + p * min_stride + d, x_a, x_b);
      V::load2(kmax + p * max_stride + d, y_a, y_b);
      lo_a = V::min(lo_a, x_a), lo_b = V::min(lo_b, x_b);
      hi_a = V::max(hi_a, y_a), hi_b = V::max(hi_b, y_b);
    }
    for (int j = 0; j < QB; ++j) {
      const float* qp = q_pos + j * D + d;
      const float* qn = q_neg + j * D + d;
      s[j] = V::fma(V::load(qp + V::W), hi_b, V::fma(V::load(qp), hi_a, s[j]));
      t[j] = V::fma(V::load(qn + V::W), lo_b, V::fma(V::load(qn), lo_a, t[j]));
    }
  }
  for (int j = 0; j < QB; ++j) s[j] = V::add(s[j], t[j]);
  float sums[QB];
  reduce_rows<V, QB>(s, sums);
  for (int j = 0; j < QB; ++j) {
    for (int64_t e = d2; e < D; ++e) {
      float lo = to_f32(kmin[e]), hi = to_f32(kmax[e]);
      for (int64_t p = 1; p < nphys; ++p) {
        lo = min_num(lo, to_f32(kmin[p * min_stride + e]));
        hi = max_num(hi, to_f32(kmax[p * max_stride + e]));
      }
      sums[j] += q_pos[j * D + e] * hi + q_neg[j * D + e] * lo;
    }
    *best = max_num(*best, sums[j]);
  }
}

template <class V, class T>
void score_piece(const ScoreArgs& a, int64_t seg, int64_t lb0, int64_t lb1, float* scores) {
  const int64_t b = seg / a.num_kv_heads, h = seg % a.num_kv_heads;
  const T* min_base = static_cast<const T*>(a.key_min) + b * a.min_stride_b + h * a.min_stride_h;
  const T* max_base = static_cast<const T*>(a.key_max) + b * a.max_stride_b + h * a.max_stride_h;
  const int64_t nq = a.nq, D = a.head_dim, smin = a.min_stride_blk, smax = a.max_stride_blk;
  const float* q_pos = a.q_pos + seg * nq * D;
  const float* q_neg = a.q_neg + seg * nq * D;
  const int64_t nq8 = nq / 8 * 8, rest = nq - nq8;
  for (int64_t lb = lb0; lb < lb1; ++lb) {
    const int64_t p0 = lb * a.factor;
    const int64_t nphys = clamp64(a.num_blocks - p0, 0, a.factor);
    const T* kmin = min_base + p0 * smin;
    const T* kmax = max_base + p0 * smax;
    // an empty digest (min > max, e.g. +inf / -inf) bounds nothing: never select it
    float lo0 = to_f32(kmin[0]), hi0 = to_f32(kmax[0]);
    for (int64_t p = 1; p < nphys; ++p) {
      lo0 = min_num(lo0, to_f32(kmin[p * smin]));
      hi0 = max_num(hi0, to_f32(kmax[p * smax]));
    }
    if (!(lo0 <= hi0)) {
      scores[lb] = kNegInf;
      continue;
    }
    float best = kNegInf;
    for (int64_t j = 0; j < nq8; j += 8) {
      // 8 queries' 16 accumulators fit 32 registers; with 16 (AVX2), two passes of 4
      if constexpr (vector_registers<V>() >= 32) {
        score_queries<V, T, 8>(q_pos + j * D, q_neg + j * D, D, kmin, kmax, nphys, smin, smax, &best);
      } else {
        for (int64_t h = j; h < j + 8; h += 4) {
          score_queries<V, T, 4>(q_pos + h * D, q_neg + h * D, D, kmin, kmax, nphys, smin, smax, &best);
        }
      }
    }
    int64_t j = nq8;
    if (rest & 4) score_queries<V, T, 4>(q_pos + j * D, q_neg + j * D, D, kmin, kmax, nphys, smin, smax, &best);
    j += rest & 4;
    if (rest & 2) score_queries<V, T, 2>(q_pos + j * D, q_neg + j * D, D, kmin, kmax, nphys, smin, smax, &best);
    j += rest & 2;
    if (rest & 1) score_queries<V, T, 1>(q_pos + j * D, q_neg + j * D, D, kmin, kmax, nphys, smin, smax, &best);
    scores[lb] = best;
  }
}

template <class V>
double read_sum(const float* data, int64_t n) {
  // four independent accumulators so the adds never limit the read rate
  auto s0 = V::zero(), s1 = V::zero(), s2 = V::zero(), s3 = V::zero();
  int64_t i = 0;
  for (; i + 4 * V::W <= n; i += 4 * V::W) {
    s0 = V::add(s0, V::load(data + i));
    s1 = V::add(s1, V::load(data + i + V::W));
    s2 = V::add(s2, V::load(data + i + 2 * V::W));
    s3 = V::add(s3, V::load(data + i + 3 * V::W));
  }
  double total = V::reduce_add(V::add(V::add(s0, s1), V::add(s2, s3)));
  for (; i < n; ++i) total += data[i];
  return total;
}

// Rows of D floats from natural order to V's layout for storage type T (inverse: back), in place.
template <class V, class T>
void layout_rows(float* data, int64_t rows, int64_t D, int inverse) {
  const int64_t d2 = D / (2 * V::W) * (2 * V::W);
  float tmp[2 * V::W];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < d2; d += 2 * V::W) {
      float* x = data + r * D + d;
      for (int i = 0; i < 2 * V::W; ++i) tmp[i] = x[i];
      for (int i = 0; i < 2 * V::W; ++i) {
        if (inverse) {
          x[V::template perm<T>(i)] = tmp[i];
        } else {
          x[i] = tmp[V::template perm<T>(i)];
        }
      }
    }
  }
}

template <class V>
KernelTable make_table() {
  KernelTable t;
  t.attend[kF32] = &attend_piece<V, float>;
  t.attend[kBF16] = &attend_piece<V, bf16_t>;
  t.attend[kF16] = &attend_piece<V, f16_t>;
  t.score[kF32] = &score_piece<V, float>;
  t.score[kBF16] = &score_piece<V, bf16_t>;
  t.score[kF16] = &score_piece<V, f16_t>;
  // 8-bit stores: attention only; their digests stay in the model's dtype (tandem_score_topk refuses a null entry)
  t.attend[kI8] = &attend_piece<V, int8_t>;
  t.attend[kF8] = &attend_piece<V, f8_t>;
  t.score[kI8] = nullptr;
  t.score[kF8] = nullptr;
  t.layout[kF32] = &layout_rows<V, float>;
  t.layout[kBF16] = &layout_rows<V, bf16_t>;
  t.layout[kF16] = &layout_rows<V, f16_t>;
  t.layout[kI8] = &layout_rows<V, int8_t>;
  t.layout[kF8] = &layout_rows<V, f8_t>;
  t.read_sum = &read_sum<V>;
  return t;
}

}  // namespace
}  // namespace tandem
