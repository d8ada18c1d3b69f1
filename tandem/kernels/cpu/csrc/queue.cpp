// The CPU's side of a decode step's task queue (tandem/attention/queue.py): the CPU threads and the GPU's
// programs share one step's sparse attention, cut into pieces of at most `piece_blocks` blocks of one (request,
// KV head) segment's list and listed largest segment first.
//
// The GPU cannot take pieces with atomics on a pinned counter here: an H100 over PCIe has no native host atomics
// (CU_DEVICE_ATTRIBUTE_HOST_NATIVE_ATOMIC_SUPPORTED = 0), and its system-scope atomic adds lost the CPU's
// increments (benchmarks/results/2026-11-27_h100_queue_claims/). So the two sides walk the list from its two
// ends, each with its own cursor (the GPU's in device memory, the CPU's here), and settle each piece with a
// handshake of plain stores and loads around sequentially consistent fences:
//   side X: mine[i] = 1; fence; look at theirs[i].
// Both cannot see 0 (store buffering is forbidden under the fences), so a piece both reach is settled thus:
//   GPU saw 0: the GPU takes it and writes decided[i] = TAKEN; the CPU (which saw 1) waits for that and stops.
//   GPU saw 1: the GPU writes decided[i] = YIELDED and stops; the CPU takes the piece whatever it saw (it waits
//   for decided[i] where it saw the GPU's flag).
// A side that stops has met the other, whose cursor has handed out every piece beyond, so every piece is taken
// exactly once; the CPU never waits on anything but a decision the GPU writes right after its own load.
// With `split` < n the sides keep to [0, split) and [split, n) without handshakes (the static assignments).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "tandem_cpu.h"

namespace tandem {
void merge_slots(const float* scratch, int64_t slot_floats, int64_t slot0, int64_t slot1, int64_t nq,
                 int64_t head_dim, float* out, float* lse);
const float* prepare_query(const KernelTable* table, int dtype, const AttendArgs& a, int q_dtype);
}  // namespace tandem

extern "C" {

// The GPU's side of the protocol, for a thread that stands in for the GPU on a machine without one (tests, CI):
// takes the next piece from the front of the plan in `control` (laid out as tandem_queue_attention reads it) with
// the GPU kernel's steps (its flag, a fence, the CPU's flag, its decision). Returns the piece taken, or -1 once
// this side is done (the list's end, its split, or a piece the CPU reached first).
int32_t tandem_queue_gpu_claim(int32_t* control, int64_t capacity, int64_t nseg, int32_t* cursor) {
  const int32_t n = control[0], split = control[1];
  const bool shared = split >= n;
  const int32_t end = shared ? n : split;
  const int32_t u = __atomic_fetch_add(cursor, 1, __ATOMIC_RELAXED);
  if (u >= end || u < 0) return -1;
  if (!shared) return u;
  int32_t* const gpu_flags = control + 2 + capacity + nseg;
  int32_t* const cpu_flags = gpu_flags + capacity;
  int32_t* const decided = cpu_flags + capacity;
  __atomic_store_n(gpu_flags + u, 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  const bool take = __atomic_load_n(cpu_flags + u, __ATOMIC_ACQUIRE) == 0;
  __atomic_store_n(decided + u, take ? 1 : 2, __ATOMIC_RELEASE);
  if (!take) __atomic_store_n(cursor, static_cast<int32_t>(end), __ATOMIC_RELAXED);  // this side stops
  return take ? u : -1;
}

// Claims indices from `counter` with `threads` threads until they reach n, marking owner[i] = (1 << 20) + thread.
// Returns how many this call claimed (benchmarks/bench_queue_claims.py runs it against the GPU's claims).
int64_t tandem_claim_probe(int32_t* counter, int32_t* owner, int64_t n, int threads) {
  std::vector<int64_t> claimed(threads, 0);
  std::vector<std::thread> team;
  for (int t = 0; t < threads; ++t) {
    team.emplace_back([=, &claimed] {
      for (;;) {
        const int32_t i = __atomic_fetch_add(counter, 1, __ATOMIC_ACQ_REL);
        if (i >= n) break;
        __atomic_store_n(owner + i, (1 << 20) + t, __ATOMIC_RELAXED);
        ++claimed[t];
      }
    });
  }
  int64_t total = 0;
  for (int t = 0; t < threads; ++t) {
    team[t].join();
    total += claimed[t];
  }
  return total;
}

enum : int32_t { kTaken = 1, kYielded = 2 };

// The CPU worker of one step's queue. `args` describes the store and q (as `q_dtype` data [B, Hkv, NQ, D]); its
// indices are the segments' block lists [B, Hkv, width] int64, valid ids first (its lengths are set here).
// control: the step's plan, int32 in pinned memory, written by the GPU before the hand-off (capacity P pieces,
// nseg = B * Hkv segments):
//   [0] n pieces, [1] split, [2, 2 + P) the pieces largest segment first (piece p of segment s is
//   s * pieces_max + p: list entries [p * piece_blocks, min((p + 1) * piece_blocks, length)), then each
//   segment's length [nseg], then the GPU's flags [P], the CPU's flags [P] and the GPU's decisions [P] (zero).
// The CPU takes pieces from the end: with split == n down to the front, settling each with the GPU (see above),
// else [split, n) alone. lengths: [nseg] int64 scratch. owner (nullable, P int8): 1 for the pieces this call
// took, else 0. stats (nullable): [0] rows of valid blocks in all n pieces, [1] those the CPU took.
// Returns the out-of-range row ids met, -1 if isa / dtype is unavailable, -2 for a malformed plan, -3 if a
// decision of the GPU did not come within timeout_s.
int64_t tandem_queue_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                               const int32_t* control, int64_t capacity, int64_t pieces_max, int64_t piece_blocks,
                               int64_t* lengths, int8_t* owner, int64_t* stats, float* out, float* lse,
                               int num_threads, double timeout_s) {
  using namespace tandem;
  const KernelTable* table = table_for(isa);
  if (table == nullptr || dtype < 0 || dtype >= kNumDtypes || q_dtype < 0 || q_dtype > kF16) return -1;
  AttendArgs a = *args;
  const int64_t nseg = a.batch * a.num_kv_heads, nq = a.nq, head_dim = a.head_dim;
  const int64_t n_units = __atomic_load_n(control, __ATOMIC_ACQUIRE), split = control[1];
  const int32_t* const units = control + 2;
  const int32_t* const lengths32 = units + capacity;
  const int32_t* const gpu_flags = lengths32 + nseg;
  int32_t* const cpu_flags = const_cast<int32_t*>(gpu_flags + capacity);
  const int32_t* const decided = cpu_flags + capacity;
  if (n_units < 0 || n_units > capacity || pieces_max < 1 || piece_blocks < 1) return -2;
  for (int64_t s = 0; s < nseg; ++s) lengths[s] = std::min<int64_t>(std::max<int32_t>(lengths32[s], 0), a.width);
  a.lengths = lengths;
  std::vector<int8_t> seen(nseg, 0);  // a segment's pieces must be consecutive
  for (int64_t u = 0; u < n_units; ++u) {
    if (units[u] < 0 || units[u] / pieces_max >= nseg) return -2;
    const int64_t seg = units[u] / pieces_max;
    if (u > 0 && units[u - 1] / pieces_max != seg && seen[seg]) return -2;
    seen[seg] = 1;
  }
  a.q = prepare_query(table, dtype, a, q_dtype);
  const AttendFn attend = table->attend[dtype];
  const int64_t slot_floats = nq * (head_dim + 2);
  static thread_local std::vector<float> scratch_buffer;
  static thread_local std::vector<int8_t> mine_buffer;
  scratch_buffer.resize(static_cast<size_t>(std::max<int64_t>(n_units, 1) * slot_floats));
  mine_buffer.assign(static_cast<size_t>(std::max<int64_t>(n_units, 1)), 0);
  float* const scratch = scratch_buffer.data();
  int8_t* const mine = mine_buffer.data();
  for (int64_t u = 0; u < n_units; ++u) std::fill(scratch + u * slot_floats, scratch + u * slot_floats + nq, -INFINITY);
  int64_t bad_rows = 0;
  const int64_t rows_per_piece = piece_blocks * a.block_size;
  const int nt = static_cast<int>(std::max<int64_t>(1, num_threads));
  const bool shared = split >= n_units;  // the GPU may reach any piece: settle each with it
  const int64_t front = shared ? 0 : std::max<int64_t>(split, 0);
  int64_t cursor = n_units;  // the next piece is cursor - 1; handed out downwards
  int stop = 0, late = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);

#pragma omp parallel num_threads(nt) reduction(+ : bad_rows)
  {
    while (__atomic_load_n(&stop, __ATOMIC_RELAXED) == 0) {
      const int64_t u = __atomic_sub_fetch(&cursor, 1, __ATOMIC_RELAXED);
      if (u < front) break;
      if (shared) {
        __atomic_store_n(cpu_flags + u, 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(gpu_flags + u, __ATOMIC_ACQUIRE) != 0) {
          int32_t d;
          while ((d = __atomic_load_n(decided + u, __ATOMIC_ACQUIRE)) == 0) {
            if (std::chrono::steady_clock::now() > deadline) {
              __atomic_store_n(&late, 1, __ATOMIC_RELAXED);
              break;
            }
          }
          if (d != kYielded) {  // the GPU took it (or never said): it has every piece below too
            __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
            break;
          }
        }
      }
      const int64_t seg = units[u] / pieces_max, piece = units[u] % pieces_max;
      const int64_t len = a.lengths[seg] * a.block_size;
      const int64_t lo = piece * rows_per_piece, hi = std::min(len, lo + rows_per_piece);
      if (hi > lo) attend(a, seg, lo, hi, scratch + u * slot_floats, &bad_rows);
      mine[u] = 1;
    }
  }
  if (late) return -3;
  // every segment's pieces are consecutive in the table: merge those the CPU took
  std::vector<int64_t> first(nseg, -1), last(nseg, -2);
  for (int64_t u = 0; u < n_units; ++u) {
    const int64_t seg = units[u] / pieces_max;
    if (first[seg] < 0) first[seg] = u;
    last[seg] = u;
  }
  int64_t rows_all = 0, rows_cpu = 0;
  for (int64_t u = 0; u < n_units; ++u) {
    const int64_t seg = units[u] / pieces_max, piece = units[u] % pieces_max;
    const int64_t len = a.lengths[seg];
    const int64_t blocks = std::max<int64_t>(0, std::min(len, (piece + 1) * piece_blocks) - piece * piece_blocks);
    rows_all += blocks * a.block_size;
    if (mine[u]) rows_cpu += blocks * a.block_size;
  }
  if (owner != nullptr) {
    for (int64_t u = 0; u < capacity; ++u) owner[u] = u < n_units ? mine[u] : 0;
  }
  if (stats != nullptr) {
    stats[0] = rows_all;
    stats[1] = rows_cpu;
  }
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t seg = 0; seg < nseg; ++seg) {
    float* o = out + seg * nq * head_dim;
    float* l = lse + seg * nq;
    if (first[seg] < 0) {
      std::fill(o, o + nq * head_dim, 0.f);
      std::fill(l, l + nq, -INFINITY);
      continue;
    }
    merge_slots(scratch, slot_floats, first[seg], last[seg], nq, head_dim, o, l);
    table->layout[dtype](o, nq, head_dim, 1);
  }
  return bad_rows;
}

}  // extern "C"
