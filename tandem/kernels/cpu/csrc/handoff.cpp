// The host's side of a decode step recorded as one CUDA graph, served without Python.
//
// The graph hands each layer's query to the host by writing `ready[i] = 1` into pinned memory and waits for
// `done[i] = 1` before it merges the layer's CPU result (tandem/engine/handoff.py). Served from Python, every
// hand-off paid tens of microseconds of interpreter time between the flag and the kernel and again after it,
// on the step's critical path: the GPU waits for `done`. Here one call serves consecutive hand-offs whose CPU
// parts are compiled calls laid out beforehand (`HandoffTask`), spinning on the flags in C++. The engine passes
// one hand-off per call and lays out the next one while the GPU computes its query: laying out all of a step's
// hand-offs first delayed the first one by that time (benchmarks/results/2026-11-26_h100_host_side_ab/).
#include <chrono>
#include <cmath>
#include <cstdint>

#include "tandem_cpu.h"

extern "C" int64_t tandem_ranked_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                                           const int64_t* ranked, int64_t ranked_width, int64_t skip,
                                           int64_t count, int64_t* indices, int64_t* lengths,
                                           const int64_t* available, int64_t* stats, float* out, float* lse,
                                           int num_threads);
extern "C" int64_t tandem_ranked_rows_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                                                const int64_t* ranked, int64_t ranked_width, const int64_t* skips,
                                                const int64_t* counts, int64_t rank_stride, int64_t* indices,
                                                int64_t* lengths, const int64_t* available, int64_t* row_stats,
                                                int64_t stats_stride, float* out, float* lse, int num_threads);
extern "C" int64_t tandem_queue_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                                          const int32_t* control, int64_t capacity, int64_t pieces_max,
                                          int64_t piece_blocks, int64_t* lengths, int8_t* owner, int64_t* stats,
                                          float* out, float* lse, int num_threads, double timeout_s);

namespace tandem {

// One hand-off's CPU part. Mirrored by a ctypes Structure in tandem/kernels/cpu/_library.py (same order).
struct HandoffTask {
  int64_t kind;            // kEmpty: nothing to attend; kRanked: tandem_ranked_attention with the fields below;
                           // kQueue: tandem_queue_attention, with ranked = the plan (int32), ranked_width = its
                           // capacity, skip = pieces_max, count = piece_blocks; kRankedRows:
                           // tandem_ranked_rows_attention with skips / counts (one pair per request) and stats
                           // per request (3 each)
  const AttendArgs* args;  // kRanked: the prepared call's arguments (RankedAttention)
  int64_t isa, dtype, q_dtype, num_threads;
  const int64_t* ranked;
  int64_t ranked_width, skip, count;
  int64_t* indices;
  int64_t* lengths;
  const int64_t* available;
  int64_t* stats;          // 3 counters, as tandem_ranked_attention's
  float* out;              // both kinds: written (kEmpty: zeros and -inf)
  float* lse;
  int64_t out_numel, lse_numel;
  int64_t result;          // set by the server: the call's return value (0 = fine)
  int64_t nanoseconds;     // set by the server: time spent in the CPU part, flags excluded
  const int64_t* skips;    // kRankedRows: [B] each
  const int64_t* counts;
};

enum : int64_t { kEmpty = 0, kRanked = 1, kQueue = 2, kRankedRows = 3 };
// how long the CPU's side of a queue waits for one decision of the GPU's (it comes within microseconds)
constexpr double kQueueDecisionTimeout = 10.0;
enum : int64_t { kServed = 0, kTaskFailed = 1, kTimedOut = 2, kAborted = 3 };

namespace {

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t run(HandoffTask& t) {
  if (t.kind == kEmpty) {
    for (int64_t i = 0; i < t.out_numel; ++i) t.out[i] = 0.f;
    for (int64_t i = 0; i < t.lse_numel; ++i) t.lse[i] = -INFINITY;
    return 0;
  }
  if (t.kind == kQueue) {
    return tandem_queue_attention(static_cast<int>(t.isa), static_cast<int>(t.dtype), t.args,
                                  static_cast<int>(t.q_dtype), reinterpret_cast<const int32_t*>(t.ranked),
                                  t.ranked_width, t.skip, t.count, t.lengths, nullptr, t.stats, t.out, t.lse,
                                  static_cast<int>(t.num_threads), kQueueDecisionTimeout);
  }
  if (t.kind == kRankedRows) {
    return tandem_ranked_rows_attention(static_cast<int>(t.isa), static_cast<int>(t.dtype), t.args,
                                        static_cast<int>(t.q_dtype), t.ranked, t.ranked_width, t.skips, t.counts, 1,
                                        t.indices, t.lengths, t.available, t.stats, 1, t.out, t.lse,
                                        static_cast<int>(t.num_threads));
  }
  if (t.kind != kRanked) return -3;
  return tandem_ranked_attention(static_cast<int>(t.isa), static_cast<int>(t.dtype), t.args,
                                 static_cast<int>(t.q_dtype), t.ranked, t.ranked_width, t.skip, t.count,
                                 t.indices, t.lengths, t.available, t.stats, t.out, t.lse,
                                 static_cast<int>(t.num_threads));
}

}  // namespace
}  // namespace tandem

extern "C" {

// Serve hand-offs 0..n-1 in order (tasks: n pointers): wait until ready[i * stride] != 0, run task i, then set
// done[i * stride] = 1 (after the task's stores: the OpenMP team has joined, and the store is a release).
// Waiting gives up after `timeout_s` seconds per hand-off, or as soon as *abort != 0 (the graph's launch
// failed). Returns kServed, or kTaskFailed with *at = the task (its `result` says why; its done flag and the
// later ones are left unset), kTimedOut or kAborted with *at = the hand-off waited for.
int64_t tandem_serve_handoffs(tandem::HandoffTask* const* tasks, int64_t n, int32_t* ready, int32_t* done,
                              int64_t stride, const int32_t* abort, double timeout_s, int64_t* at) {
  using namespace tandem;
  const int64_t limit_ns = static_cast<int64_t>(timeout_s * 1e9);
  for (int64_t i = 0; i < n; ++i) {
    int32_t* flag = ready + i * stride;
    if (__atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0) {
      const int64_t start = now_ns();
      for (uint64_t spin = 1; __atomic_load_n(flag, __ATOMIC_ACQUIRE) == 0; ++spin) {
        pause();
        if ((spin & 1023) == 0) {
          if (abort != nullptr && __atomic_load_n(abort, __ATOMIC_ACQUIRE) != 0) {
            *at = i;
            return kAborted;
          }
          if (now_ns() - start > limit_ns) {
            *at = i;
            return kTimedOut;
          }
        }
      }
    }
    const int64_t start = now_ns();
    HandoffTask& task = *tasks[i];
    task.result = run(task);
    task.nanoseconds = now_ns() - start;
    if (task.result != 0) {
      *at = i;
      return kTaskFailed;
    }
    __atomic_store_n(done + i * stride, 1, __ATOMIC_RELEASE);
  }
  return kServed;
}

}  // extern "C"
