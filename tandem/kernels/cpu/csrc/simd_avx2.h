// 8-lane AVX2 + FMA + F16C vector. Included only by isa_avx2.cpp, inside its target pragma.
#pragma once

#include <immintrin.h>

#include "tandem_cpu.h"

namespace tandem {
namespace {

struct VAvx2 {
  static constexpr int W = 8;
  using reg = __m256;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  // 2W storage elements as two vectors. bf16 widens without a shuffle: the even elements shifted up, the
  // odd ones masked in place, so registers hold [even | odd] (perm gives that order); fp16/fp32 natural.
  static void load2(const float* p, reg& lo, reg& hi) {
    lo = _mm256_loadu_ps(p);
    hi = _mm256_loadu_ps(p + W);
  }
  static void load2(const f16_t* p, reg& lo, reg& hi) {
    lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W)));
  }
  static void load2(const bf16_t* p, reg& lo, reg& hi) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  // 8-bit codes widen in natural order. e4m3fn: the sign-extended byte shifted left by 20 puts the exponent and
  // mantissa at their fp32 places and the sign at bit 31 (bits 27-30, copies of the sign, are masked off);
  // times 2^120 that is the value (see f8_to_f32).
  static void load2(const int8_t* p, reg& lo, reg& hi) {
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + W))));
  }
  static reg f8_widen(__m128i bytes) {
    const __m256i x = _mm256_slli_epi32(_mm256_cvtepi8_epi32(bytes), 20);
    const __m256i bits = _mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0x87f00000u)));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
  }
  static void load2(const f8_t* p, reg& lo, reg& hi) {
    lo = f8_widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    hi = f8_widen(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + W)));
  }
  template <class T>
  static int perm(int i) {
    return is_bf16<T>::value ? (i < W ? 2 * i : 2 * (i - W) + 1) : i;
  }
  static void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static float reduce_add(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void reduce4(reg a, reg b, reg c, reg d, float* out) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
  static float reduce_max(reg a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static reg exp2(reg x) {
    // 2^x = 2^round(x) * 2^f, |f| <= 1/2, 2^f by its degree-7 Taylor series (error < 1e-8);
    // inputs below -126 (the exponent field's range) flush to 0, which also covers -inf
    const __m256 dead = _mm256_cmp_ps(x, _mm256_set1_ps(-126.f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
    const __m256 xi = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, xi);
    __m256 p = _mm256_set1_ps(1.5252733e-5f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530e-4f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(xi), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
};

}  // namespace
}  // namespace tandem
