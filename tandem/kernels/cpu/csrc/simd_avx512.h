// 16-lane AVX-512F vector. Included by isa_avx512.cpp and isa_avx512bf16.cpp inside their target pragmas.
#pragma once

#include <immintrin.h>

#include "tandem_cpu.h"

namespace tandem {
namespace {

struct VAvx512 {
  static constexpr int W = 16;
  using reg = __m512;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  // 2W storage elements as two vectors. bf16 widens without a shuffle: the even elements shifted up, the
  // odd ones masked in place, so registers hold [even | odd] (perm gives that order); fp16/fp32 natural.
  static void load2(const float* p, reg& lo, reg& hi) {
    lo = _mm512_loadu_ps(p);
    hi = _mm512_loadu_ps(p + W);
  }
  static void load2(const f16_t* p, reg& lo, reg& hi) {
    lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + W)));
  }
  static void load2(const bf16_t* p, reg& lo, reg& hi) {
    const __m512i x = _mm512_loadu_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  // 8-bit codes widen in natural order. e4m3fn: the sign-extended byte shifted left by 20 puts the exponent and
  // mantissa at their fp32 places and the sign at bit 31 (bits 27-30, copies of the sign, are masked off);
  // times 2^120 that is the value (see f8_to_f32).
  static void load2(const int8_t* p, reg& lo, reg& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W))));
  }
  static reg f8_widen(__m128i bytes) {
    const __m512i x = _mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20);
    const __m512i bits = _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0x87f00000u)));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  }
  static void load2(const f8_t* p, reg& lo, reg& hi) {
    lo = f8_widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    hi = f8_widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + W)));
  }
  template <class T>
  static int perm(int i) {
    return is_bf16<T>::value ? (i < W ? 2 * i : 2 * (i - W) + 1) : i;
  }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  static float reduce_add(reg a) {
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void reduce4(reg a, reg b, reg c, reg d, float* out) {
    // pair the vectors while halving across 128-bit lanes: lane k ends up holding 4 partials of vector k
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xb1));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4e));
    const __m512 first = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), x);
    _mm_storeu_ps(out, _mm512_castps512_ps128(first));
  }
  static float reduce_max(reg a) { return _mm512_reduce_max_ps(a); }
  static reg exp2(reg x) {
    // 2^x = 2^round(x) * 2^f, |f| <= 1/2, 2^f by its degree-7 Taylor series (error < 1e-8);
    // clamping at -160 makes -inf give exactly 0 through scalef's underflow
    x = _mm512_max_ps(x, _mm512_set1_ps(-160.f));
    const __m512 xi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, xi);
    __m512 p = _mm512_set1_ps(1.5252733e-5f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530e-4f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, xi);
  }
};

}  // namespace
}  // namespace tandem
