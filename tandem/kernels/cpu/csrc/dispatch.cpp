// Run-time ISA choice from the CPU's flags.
#include "tandem_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace tandem {

#if defined(__x86_64__) || defined(__i386__)
static bool has_f16c() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx & bit_F16C) != 0;
}
#endif

static bool detect(int isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wide registers (XGETBV)
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  switch (isa) {
    case kScalar:
      return true;
    case kAvx2:
      return avx2;
    case kAvx512:
      return avx512;
    case kAvx512Bf16:
      return avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
    default:
      return false;
  }
#else
  return isa == kScalar;
#endif
}

bool isa_supported(int isa) {
  // CPUID traps to the hypervisor in a VM (microseconds): ask once
  static const bool supported[kNumIsas] = {detect(kScalar), detect(kAvx2), detect(kAvx512), detect(kAvx512Bf16)};
  return isa >= 0 && isa < kNumIsas && supported[isa];
}

const KernelTable* table_for(int isa) {
  if (!isa_supported(isa)) return nullptr;
  switch (isa) {
    case kScalar:
      return table_scalar();
    case kAvx2:
      return table_avx2();
    case kAvx512:
      return table_avx512();
    case kAvx512Bf16:
      return table_avx512bf16();
    default:
      return nullptr;
  }
}

}  // namespace tandem

extern "C" {

int tandem_isa_supported(int isa) { return tandem::isa_supported(isa) ? 1 : 0; }

int tandem_abi_version() { return 6; }  // 2: AttendArgs' scale fields, 3: CertifyArgs, 4: stores, 5: ranked rows,
                                        // 6: ranked rows as a hand-off task

}  // extern "C"
