// AVX-512F workers (Skylake-SP and later, Zen 4). Only called when the CPU reports AVX-512F.
#include <cmath>
#include <cstring>

#include "tandem_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
// standard headers come before the pragma: their inline functions must not pick up the ISA
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#endif

#include "simd_avx512.h"
#include "score_impl.h"
#include "certify_impl.h"

namespace tandem {

const KernelTable* table_avx512() {
  static const KernelTable table = make_table<VAvx512>();
  return &table;
}

const CertifyTable* certify_table_avx512() {
  static const CertifyTable table = make_certify_table<VAvx512>();
  return &table;
}

}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options
#else
namespace tandem {
const KernelTable* table_avx512() { return nullptr; }
const CertifyTable* certify_table_avx512() { return nullptr; }
}  // namespace tandem
#endif
