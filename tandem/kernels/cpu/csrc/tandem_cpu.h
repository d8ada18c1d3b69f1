// Shared declarations of Tandem's CPU kernels.
//
// The library is plain C++ (no torch headers) so that it compiles in seconds. Each ISA lives in its own
// translation unit (isa_*.cpp) compiled for that ISA by a `#pragma GCC target`; the OpenMP drivers
// (attention.cpp, select.cpp) are compiled for the baseline ISA and call the per-ISA workers through a
// KernelTable picked at run time from the CPU's flags.
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem {

// kI8 / kF8: 8-bit codes of the compressed host tier (int8, float8_e4m3fn), one fp32 scale per group of rows
enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2, kI8 = 3, kF8 = 4, kNumDtypes = 5 };
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kNumIsas = 4 };

// Storage element tags, so that loaders overload on the pointer type.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
struct f8_t {  // float8_e4m3fn (int8 codes are plain int8_t)
  uint8_t bits;
};

// One request's host store, for a call over requests that each keep their own (`AttendArgs::stores`): its K / V
// (element strides of a head and a row; rows contiguous), mask, capacity and 8-bit scales, as AttendArgs has them
// for one store. Mirrored in _library.py.
struct RowStore {
  const void* k;
  const void* v;
  int64_t k_stride_h, k_stride_row, v_stride_h, v_stride_row;
  const uint8_t* key_mask;  // [cap] 0 = never attend, or null
  int64_t cap;
  const float* k_scale;     // 8-bit stores only: [Hkv, G] at the strides below
  const float* v_scale;
  int64_t ks_stride_h, vs_stride_h;
};

// Arguments of sparse attention, shared by the driver and the workers. Mirrored by a ctypes Structure
// in tandem/kernels/cpu/_library.py: keep the field order in sync.
struct AttendArgs {
  const float* q;           // [B, Hkv, NQ, D] fp32, NQ = group * Lq (the driver pre-scales a copy)
  float q_scale;            // softmax scale * log2(e): the workers compute in base 2
  const void* k;            // K store, element strides below; rows are contiguous
  const void* v;            // V store
  int64_t k_stride_b, k_stride_h, k_stride_row;
  int64_t v_stride_b, v_stride_h, v_stride_row;
  const int64_t* indices;   // [B, Hkv, width] row ids (block ids when block_size > 1)
  const int64_t* lengths;   // [B, Hkv] valid entries of `indices`
  const uint8_t* key_mask;  // [B, cap] 0 = never attend, or null
  int64_t batch, num_kv_heads, nq, head_dim, width, cap, block_size;
  int64_t prefetch_rows;    // rows prefetched ahead of the row a pass computes (at most a span)
  int64_t prefetch_hint;    // locality 0..3 as __builtin_prefetch (3 = into L1, 1 = L2/L3), -1 = none
  int64_t prefetch_step;    // bytes between prefetched lines: 64, or 128 to leave the pair line to the
                            // L2 spatial prefetcher (half the line-fill buffers per row)
  // 8-bit stores only (null otherwise): row r of segment (b, h) is codes * k_scale[b * ks_stride_b +
  // h * ks_stride_h + r / scale_rows] (V likewise)
  const float* k_scale;
  const float* v_scale;
  int64_t ks_stride_b, ks_stride_h, vs_stride_b, vs_stride_h;
  int64_t scale_rows;       // rows per scale (G)
  // [B] one store per request (requests that each keep their own host tier), or null: every request's rows are in
  // k / v / key_mask / k_scale / v_scale above at their batch strides, with capacity `cap`
  const RowStore* stores;
};

// Request b's store of a call: stores[b], or the shared store's slice of request b.
inline RowStore store_of(const AttendArgs& a, int64_t b) {
  if (a.stores != nullptr) return a.stores[b];
  RowStore s;
  s.k = static_cast<const char*>(a.k);  // offset by the worker, which knows the element size
  s.v = static_cast<const char*>(a.v);
  s.k_stride_h = a.k_stride_h;
  s.k_stride_row = a.k_stride_row;
  s.v_stride_h = a.v_stride_h;
  s.v_stride_row = a.v_stride_row;
  s.key_mask = a.key_mask ? a.key_mask + b * a.cap : nullptr;
  s.cap = a.cap;
  s.k_scale = a.k_scale ? a.k_scale + b * a.ks_stride_b : nullptr;
  s.v_scale = a.v_scale ? a.v_scale + b * a.vs_stride_b : nullptr;
  s.ks_stride_h = a.ks_stride_h;
  s.vs_stride_h = a.vs_stride_h;
  return s;
}

// Arguments of block scoring. Mirrored in _library.py.
struct ScoreArgs {
  const float* q_pos;       // [B, Hkv, NQ, D] fp32, max(q, 0) (the driver builds both from q)
  const float* q_neg;       // [B, Hkv, NQ, D] fp32, min(q, 0)
  const void* key_min;      // [B, Hkv, nblk, D] per-block digests, element strides below
  const void* key_max;
  int64_t min_stride_b, min_stride_h, min_stride_blk;
  int64_t max_stride_b, max_stride_h, max_stride_blk;
  int64_t batch, num_kv_heads, nq, head_dim, num_blocks, factor;  // factor: logical / physical block size
};

// Arguments of the certified row selection (certify.cpp), the semantics of `certified_rows_reference` in
// tandem/policies/certify.py. Mirrored in _library.py. Row-indexed inputs are read in place through their
// strides (in elements; the last dim contiguous): the caller passes slices of capacity-wide buffers.
struct CertifyArgs {
  const float* q;                    // [B, Hq, D] fp32, contiguous
  const int8_t* codes;               // [B, Hkv, n, D] the key sketch's codes
  int64_t codes_stride_b, codes_stride_h, codes_stride_row;
  const float* row_scale;            // [B, Hkv, n]
  int64_t row_scale_stride_b, row_scale_stride_h;
  const float* error;                // [B, Hkv, n]
  int64_t error_stride_b, error_stride_h;
  const uint8_t* row_valid;          // [B, n] bool
  int64_t row_valid_stride_b;
  const float* known_lse;            // [B, Hq] fp32, contiguous
  const int64_t* max_units;          // [B, Hq] (strides may be 0: a broadcast)
  int64_t max_units_stride_b, max_units_stride_h;
  const float* value_norm;           // [B, Hkv, n / block_size]
  int64_t value_norm_stride_b, value_norm_stride_h;
  const uint8_t* forced;             // [B, Hkv, n] bool, or null
  int64_t forced_stride_b, forced_stride_h;
  int64_t batch, num_q_heads, num_kv_heads, n, head_dim, block_size;
  float scale;                       // softmax scale of the logits
  float slack_abs, slack_rel;        // the bounds' widening (SLACK_ABS, SLACK_REL)
  double epsilon;
  double bucket_nats, tail_margin;   // the histogram (BUCKET_NATS, TAIL_MARGIN)
  int64_t buckets;                   // BUCKETS, at most kMaxBuckets
};

constexpr int64_t kMaxBuckets = 254;  // a row's bucket is one byte, with two more marks (certify.cpp)

// Per-ISA workers of the certified selection (certify_impl.h). sketch_dots: dots[j * ld + r] = q_j . codes_r
// for nq rows of q [nq, D] and `rows` code rows `row_stride` elements apart; exp_shifted: out[r] =
// exp(double(x[r]) - top) in float64; bound_rows: a head's upper / lower logit bounds from its dots;
// rank_rows: a head's rows for its histogram.
struct CertifyTable {
  void (*sketch_dots)(const float* q, int64_t nq, int64_t D, const int8_t* codes, int64_t row_stride,
                      int64_t rows, float* dots, int64_t ld);
  void (*bound_rows)(const float* dot, float q_norm, const float* row_scale, const float* error,
                     const uint8_t* valid, int64_t m, float scale, float slack_abs, float slack_rel, float* upper,
                     float* lower);
  void (*exp_shifted)(const float* x, int64_t n, double top, double* out);
  void (*rank_rows)(const float* upper, int64_t n, double top, double bucket_nats, double per_nat, double last,
                    uint8_t unranked, double* e_up, uint8_t* bucket);
};

// Attend the rows at expanded positions [lo, hi) of segment `seg` (= b * Hkv + h) and leave the
// unnormalised partial result in `state`: m[NQ] (running max, log2 domain), l[NQ] (sum of exp2),
// acc[NQ][D] (layout order). `bad_rows` counts row ids outside [0, cap).
using AttendFn = void (*)(const AttendArgs&, int64_t seg, int64_t lo, int64_t hi, float* state,
                          int64_t* bad_rows);
// Score logical blocks [lb0, lb1) of segment `seg` into scores[lb0:lb1].
using ScoreFn = void (*)(const ScoreArgs&, int64_t seg, int64_t lb0, int64_t lb1, float* scores);
// Sum of n floats (used by the bandwidth probe so that it reads with the same vector width).
using ReadFn = double (*)(const float* data, int64_t n);
// Rows [rows, D] of fp32 from natural order into the worker's register layout for a storage dtype
// (inverse = 1: back). The workers read q in that layout and leave acc in it.
using LayoutFn = void (*)(float* data, int64_t rows, int64_t D, int inverse);

struct KernelTable {
  AttendFn attend[kNumDtypes];
  ScoreFn score[kNumDtypes];
  LayoutFn layout[kNumDtypes];
  ReadFn read_sum;
};

// Defined by each isa_*.cpp; null where the ISA cannot be compiled (non-x86 hosts).
const KernelTable* table_scalar();
const KernelTable* table_avx2();
const KernelTable* table_avx512();
const KernelTable* table_avx512bf16();

// Defined by certify.cpp (portable) and isa_avx2.cpp / isa_avx512.cpp; null where the ISA cannot be compiled.
const CertifyTable* certify_table_scalar();
const CertifyTable* certify_table_avx2();
const CertifyTable* certify_table_avx512();

bool isa_supported(int isa);
const KernelTable* table_for(int isa);  // null if the ISA is not supported on this CPU

template <class T>
struct is_bf16 {
  static constexpr bool value = false;
};
template <>
struct is_bf16<bf16_t> {
  static constexpr bool value = true;
};

// 8-bit codes with per-group scales: the workers apply the scales to the logits and the softmax weights
template <class T>
struct is_quantized {
  static constexpr bool value = false;
};
template <>
struct is_quantized<int8_t> {
  static constexpr bool value = true;
};
template <>
struct is_quantized<f8_t> {
  static constexpr bool value = true;
};

inline float bf16_to_f32(bf16_t x) {
  uint32_t bits = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float f16_to_f32(f16_t x) {
  // portable IEEE half -> float, subnormals and inf/nan included
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1f;
  uint32_t mant = x.bits & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    // subnormal half: normalise the mantissa
    exp = 113;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// e4m3fn -> float: sign, exponent and mantissa moved to their fp32 places give the value times 2^-120 (the
// exponent biases differ by 120), normals and subnormals alike; the multiply is exact. 0x7f / 0xff (NaN in
// e4m3fn) decode to a finite value: stores never hold them.
inline float f8_to_f32(f8_t x) {
  const uint32_t bits = (uint32_t(x.bits & 0x80) << 24) | (uint32_t(x.bits & 0x7f) << 20);
  float f;
  std::memcpy(&f, &bits, 4);
  return f * 0x1p120f;
}

inline float to_f32(float x) { return x; }
inline float to_f32(bf16_t x) { return bf16_to_f32(x); }
inline float to_f32(f16_t x) { return f16_to_f32(x); }
inline float to_f32(int8_t x) { return static_cast<float>(x); }
inline float to_f32(f8_t x) { return f8_to_f32(x); }

// std::fmax / std::fmin (a NaN operand yields the other) as inline compares: without -ffinite-math-only GCC
// calls libm's fmaxf / fminf through the PLT. In the inlined scoring loop those calls made kernel 2 3-8x
// slower on the GPU host's Xeon (the vector registers do not survive a call).
inline float max_num(float a, float b) { return (b > a || a != a) ? b : a; }
inline float min_num(float a, float b) { return (b < a || a != a) ? b : a; }

}  // namespace tandem
