// Portable workers: the path on non-x86 hosts and the last resort on x86.
#include <cmath>
#include <cstring>

#include "tandem_cpu.h"
#include "simd_scalar.h"
#include "score_impl.h"

namespace tandem {

const KernelTable* table_scalar() {
  static const KernelTable table = make_table<VScalar>();
  return &table;
}

}  // namespace tandem
