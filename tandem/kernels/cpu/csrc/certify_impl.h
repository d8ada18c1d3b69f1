// ISA-generic workers of the certified row selection (certify.cpp): the key sketch's dot products and the float64
// exponentials and buckets of its histogram. Like attend_impl.h, compiled once per ISA: included after the ISA's
// `#pragma GCC target` and its V struct (isa_avx2.cpp, isa_avx512.cpp; certify.cpp for the portable
// path), with internal linkage throughout so that per-ISA copies never merge at link time.
#pragma once

#include <cstdint>

#include "attend_impl.h"
#include "tandem_cpu.h"

namespace tandem {
namespace {

// Queries per pass of sketch_dots: 4 rows x QB accumulators, QB q vector pairs and one code row pair must fit
// the registers (AVX-512: 26 of 32 at 4; AVX2: 14 of 16 at 2).
template <class V>
constexpr int dot_queries() {
  return vector_registers<V>() >= 32 ? 4 : 2;
}

// dots[j * ld + r] = q_j . codes_r for RB rows (RB = 4 or 1) and QB queries. Per step of 2W dimensions the QB
// q vector pairs are loaded once for the RB rows, and each code row widens once for the QB queries. With four
// rows, one reduce4 per query sums the rows' accumulators and stores them in the caller's [query][row] layout:
// a quarter of the horizontal reductions of one per (row, query) in the attention kernel's [row][query] layout.
template <class V, int QB, int RB>
[[gnu::always_inline]] inline void dot_block(const float* q, int64_t D, const int8_t* codes, int64_t row_stride,
                                             float* dots, int64_t ld) {
  const int64_t d2 = D / (2 * V::W) * (2 * V::W);
  typename V::reg s[RB][QB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < QB; ++j) s[r][j] = V::zero();
  for (int64_t d = 0; d < d2; d += 2 * V::W) {
    typename V::reg qlo[QB], qhi[QB];
    for (int j = 0; j < QB; ++j) qlo[j] = V::load(q + j * D + d), qhi[j] = V::load(q + j * D + d + V::W);
    for (int r = 0; r < RB; ++r) {
      typename V::reg lo, hi;
      V::load2(codes + r * row_stride + d, lo, hi);
      for (int j = 0; j < QB; ++j) s[r][j] = V::fma(qhi[j], hi, V::fma(qlo[j], lo, s[r][j]));
    }
  }
  for (int j = 0; j < QB; ++j) {
    float* out = dots + j * ld;
    if constexpr (RB == 4) {
      V::reduce4(s[0][j], s[1][j], s[2][j], s[3][j], out);
    } else {
      for (int r = 0; r < RB; ++r) out[r] = V::reduce_add(s[r][j]);
    }
    for (int r = 0; r < RB; ++r)
      for (int64_t e = d2; e < D; ++e) out[r] += q[j * D + e] * to_f32(codes[r * row_stride + e]);
  }
}

// QB queries over `rows` code rows, four at a time.
template <class V, int QB>
void dot_rows(const float* q, int64_t D, const int8_t* codes, int64_t row_stride, int64_t rows, float* dots,
              int64_t ld) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) dot_block<V, QB, 4>(q, D, codes + r * row_stride, row_stride, dots + r, ld);
  for (; r < rows; ++r) dot_block<V, QB, 1>(q, D, codes + r * row_stride, row_stride, dots + r, ld);
}

// dots[j * ld + r] = q_j . codes_r in fp32 (the codes are exact in fp32) for nq queries q [nq, D].
template <class V>
void sketch_dots(const float* q, int64_t nq, int64_t D, const int8_t* codes, int64_t row_stride, int64_t rows,
                 float* dots, int64_t ld) {
  constexpr int most = dot_queries<V>();
  int64_t j = 0;
  for (; j + most <= nq; j += most) dot_rows<V, most>(q + j * D, D, codes, row_stride, rows, dots + j * ld, ld);
  if constexpr (most == 4) {
    if (nq - j == 3) dot_rows<V, 3>(q + j * D, D, codes, row_stride, rows, dots + j * ld, ld), j += 3;
    if (nq - j >= 2) dot_rows<V, 2>(q + j * D, D, codes, row_stride, rows, dots + j * ld, ld), j += 2;
  }
  if (nq - j == 1) dot_rows<V, 1>(q + j * D, D, codes, row_stride, rows, dots + j * ld, ld);
}

// exp(x) in float64 to within a few ulp, branch-free so that a loop of it vectorises: x = k ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts, so r is exact to float64), exp(r) by its Taylor series to r^13 (remainder
// < 5e-18), times 2^k built in the exponent field. Below -708 it gives 0 (exp is under 4e-308 there: against
// a histogram normalised to its best unit, nothing), above 709 +inf, and NaN stays NaN.
[[gnu::always_inline]] inline double exp_f64(double x) {
  const double xc = x < -708.0 ? -708.0 : x > 709.0 ? 709.0 : x;
  // adding 1.5 * 2^52 rounds to an integer k held in the low mantissa bits
  const double shifted = xc * 1.4426950408889634 + 0x1.8p52;
  const uint64_t k_bits = __builtin_bit_cast(uint64_t, shifted);
  const double k = shifted - 0x1.8p52;
  const double r = (xc - k * 0x1.62e42fee00000p-1) - k * 0x1.a39ef35793c76p-33;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // the low 11 bits of k_bits + 1023 are k's biased exponent (k in [-1022, 1023] here)
  const double two_k = __builtin_bit_cast(double, (k_bits + 1023) << 52);
  const double e = p * two_k;
  return x < -708.0 ? 0.0 : x > 709.0 ? __builtin_inf() : e;
}

// sketch_logit_bounds' fp32 operations in its order for m rows of one head: (dot * row_scale) * scale +- (||q|| *
// error) * scale, widened by slack_abs + slack_rel |bound|, -inf for a padding row. Built without contraction
// so that its rounding is torch's whatever the ISA (and without trapping math, so that the padding select
// vectorises).
template <class V>
[[gnu::optimize("fp-contract=off", "no-trapping-math")]] void bound_rows(
    const float* __restrict dot, float q_norm, const float* __restrict row_scale, const float* __restrict error,
    const uint8_t* __restrict valid, int64_t m, float scale, float slack_abs, float slack_rel, float* __restrict upper,
    float* __restrict lower) {
  for (int64_t r = 0; r < m; ++r) {
    const float centre = dot[r] * row_scale[r] * scale;
    const float reach = q_norm * error[r] * scale;
    const float u = centre + reach, l = centre - reach;
    upper[r] = valid[r] ? u + slack_abs + slack_rel * __builtin_fabsf(u) : -__builtin_inff();
    lower[r] = valid[r] ? l - slack_abs - slack_rel * __builtin_fabsf(l) : -__builtin_inff();
  }
}

// The loops below are built without trapping math: the range checks of exp_f64 and the clamps become selects only
// if both arms may be computed, and nothing reads the floating-point exception flags. With them as branches the
// loops did not vectorise without AVX-512.

template <class V>
[[gnu::optimize("no-trapping-math")]] void exp_shifted(const float* x, int64_t n, double top, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = exp_f64(static_cast<double>(x[i]) - top);
}

// One head's rows for its histogram: e_up = exp(upper - top) in float64 and the bucket ((top - upper) /
// bucket_nats).clamp(0, last), truncated, or `unranked` where the upper bound is not finite; per_nat = 1 /
// bucket_nats when that is exact (a power of two), else 0 and the division runs.
template <class V>
[[gnu::optimize("no-trapping-math")]] void rank_rows(const float* upper, int64_t n, double top, double bucket_nats,
                                                     double per_nat, double last, uint8_t unranked, double* e_up,
                                                     uint8_t* bucket) {
  for (int64_t i = 0; i < n; ++i) e_up[i] = exp_f64(static_cast<double>(upper[i]) - top);
  if (per_nat > 0.0) {
    for (int64_t i = 0; i < n; ++i) {
      const double x = (top - static_cast<double>(upper[i])) * per_nat;
      const uint8_t k = static_cast<uint8_t>(static_cast<int32_t>(x >= 0.0 ? (x < last ? x : last) : 0.0));
      bucket[i] = __builtin_fabsf(upper[i]) < __builtin_inff() ? k : unranked;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const double x = (top - static_cast<double>(upper[i])) / bucket_nats;
      const uint8_t k = static_cast<uint8_t>(static_cast<int32_t>(x >= 0.0 ? (x < last ? x : last) : 0.0));
      bucket[i] = __builtin_fabsf(upper[i]) < __builtin_inff() ? k : unranked;
    }
  }
}

template <class V>
CertifyTable make_certify_table() {
  CertifyTable t;
  t.sketch_dots = &sketch_dots<V>;
  t.exp_shifted = &exp_shifted<V>;
  t.bound_rows = &bound_rows<V>;
  t.rank_rows = &rank_rows<V>;
  return t;
}

}  // namespace
}  // namespace tandem
