// AVX2 + FMA + F16C workers (Haswell and later, Zen). Only called when the CPU reports these flags.
#include <cmath>
#include <cstring>

#include "tandem_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
// standard headers come before the pragma: their inline functions must not pick up the ISA
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#endif

#include "simd_avx2.h"
#include "score_impl.h"
#include "certify_impl.h"

namespace tandem {

const KernelTable* table_avx2() {
  static const KernelTable table = make_table<VAvx2>();
  return &table;
}

const CertifyTable* certify_table_avx2() {
  static const CertifyTable table = make_certify_table<VAvx2>();
  return &table;
}

}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options
#else
namespace tandem {
const KernelTable* table_avx2() { return nullptr; }
const CertifyTable* certify_table_avx2() { return nullptr; }
}  // namespace tandem
#endif
