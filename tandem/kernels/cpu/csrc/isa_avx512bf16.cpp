// Workers for CPUs with AVX512-BF16 (Cooper Lake, Sapphire Rapids and later, Zen 4): the AVX-512F code,
// compiled where bf16 instructions are allowed.
//
// On the GPU host's Xeon a vdpbf16ps q.k (q split into hi + lo bf16 halves, which fp32-grade logits need)
// ran slower per row than the shift-and-FMA widening of the AVX-512F path (docs/cpu-kernels.md § Build and
// dispatch), so this level runs that path. A version with plain bf16 q and bf16 softmax weights (one
// vdpbf16ps per 32 products in q.k and p.V) measured no faster there either: vdpbf16ps costs about the
// two FMAs it replaces. An AMX tile kernel was no faster either (docs/cpu-kernels.md).
#include <cmath>
#include <cstring>

#include "tandem_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
// standard headers come before the pragma: their inline functions must not pick up the ISA
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#endif

#include "simd_avx512.h"
#include "score_impl.h"

namespace tandem {

const KernelTable* table_avx512bf16() {
  static const KernelTable table = make_table<VAvx512>();
  return &table;
}

}  // namespace tandem

#if defined(__clang__)
#pragma clang attribute pop
#endif
#pragma GCC pop_options
#else
namespace tandem {
const KernelTable* table_avx512bf16() { return nullptr; }
}  // namespace tandem
#endif
