// Selection drivers: Quest block scoring (+ top-k), HGCA threshold selection, and the read-bandwidth probe.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tandem_cpu.h"

namespace tandem {
namespace {

constexpr int64_t kMinBlocksPerThread = 64;
constexpr int64_t kThresholdChunk = 4096;  // rows per threshold work item

inline int64_t split(int64_t total, int t, int nt) {
  return static_cast<int64_t>((static_cast<__int128>(total) * t) / nt);
}

inline int threads_for(int requested, int64_t work, int64_t min_work_per_thread) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::max(requested, 1), work / min_work_per_thread)));
}

// Logical blocks [lo, hi) of the concatenation of all segments' score rows.
void score_range(const KernelTable* table, int dtype, const ScoreArgs& a, int64_t nlb, int64_t lo, int64_t hi,
                 float* scores) {
  for (int64_t pos = lo; pos < hi;) {
    const int64_t seg = pos / nlb, lb0 = pos % nlb;
    const int64_t lb1 = std::min(nlb, lb0 + (hi - pos));
    table->score[dtype](a, seg, lb0, lb1, scores + seg * nlb);
    pos += lb1 - lb0;
  }
}

// Order-preserving key of a score as the top-k ranks it: NaN as +inf (torch.topk ranks NaN highest), -0 as +0.
inline uint32_t rank_key(float x) {
  if (std::isnan(x)) x = INFINITY;
  if (x == 0.f) x = 0.f;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Top-k of one segment in the reference's order: ranked by score (ties by lower id, NaN ranks highest as in
// torch.topk), then the finite picks in ascending id, then the non-finite ones in ascending id.
// A radix select over the keys' top 12 bits (sign, exponent, 3 mantissa bits: a score's top byte alone puts a
// third of N(0, 1) scores in one bin) finds the bin of the k-th key, and one more pass collects the ids at or
// above that bin in id order: about k of them. Two 10-bit passes over that bin's ids finish the k-th key, and
// one pass over the collected ids keeps every key above it and the lowest ids of those equal to it. Three short
// passes over all n, several times faster than the nth_element over an id array it replaced (docs/cpu-kernels.md
// § How the attention kernel works, kernel 2).
int64_t topk_segment(const float* scores, int64_t n, int64_t k, int64_t* out, std::vector<uint32_t>& keys,
                     std::vector<int64_t>& work) {
  if (k <= 0) return 0;
  constexpr int top_bits = 12, low_bits = 10;
  int32_t hist[1 << top_bits] = {};
  keys.resize(n);
  for (int64_t i = 0; i < n; ++i) keys[i] = rank_key(scores[i]);  // a loop of its own: vectorized
  for (int64_t i = 0; i < n; ++i) ++hist[keys[i] >> (32 - top_bits)];
  int64_t need = k;  // keys still to take among those matching the bits of the threshold found so far
  int b = (1 << top_bits) - 1;
  while (b > 0 && hist[b] < need) need -= hist[b--];
  uint32_t threshold = static_cast<uint32_t>(b) << (32 - top_bits);
  work.resize(n);
  int64_t kept = 0;
  for (int64_t i = 0; i < n; ++i) {  // branch-free: which ids pass is random
    work[kept] = i;
    kept += (keys[i] >> (32 - top_bits)) >= static_cast<uint32_t>(b);
  }
  work.resize(kept);
  for (int shift = 32 - top_bits - low_bits; shift >= 0; shift -= low_bits) {
    const uint32_t mask = ~0u << (shift + low_bits);
    std::fill(hist, hist + (1 << low_bits), 0);
    for (const int64_t i : work) {
      if ((keys[i] & mask) == threshold) ++hist[(keys[i] >> shift) & ((1 << low_bits) - 1)];
    }
    b = (1 << low_bits) - 1;
    while (b > 0 && hist[b] < need) need -= hist[b--];
    threshold |= static_cast<uint32_t>(b) << shift;
  }
  int64_t taken = 0, tail = 0;
  for (const int64_t i : work) {  // ascending ids; non-finite picks are moved to the front of work
    const uint32_t key = keys[i];
    if (key < threshold || (key == threshold && need-- <= 0)) continue;
    if (std::isfinite(scores[i])) {
      out[taken++] = i;
    } else {
      work[tail++] = i;
    }
    if (taken + tail == k) break;
  }
  std::copy(work.begin(), work.begin() + tail, out + taken);
  return taken;
}

}  // namespace
}  // namespace tandem

extern "C" {

// scores: [B, Hkv, ceil(nblk / factor)] fp32, or null with k >= 0 (scored into internal scratch). With k >= 0
// also writes the top-k of each (request, KV head) into topk_ids [B, Hkv, k] and topk_lengths [B, Hkv].
// Returns 0, or -1 if isa / dtype is unavailable (8-bit digests included: no score worker) or scores is null
// with k < 0.
int64_t tandem_score_topk(int isa, int dtype, const tandem::ScoreArgs* args, float* scores, int64_t k,
                          int64_t* topk_ids, int64_t* topk_lengths, int num_threads) {
  using namespace tandem;
  const KernelTable* table = table_for(isa);
  if (table == nullptr || dtype < 0 || dtype >= kNumDtypes || table->score[dtype] == nullptr) return -1;
  ScoreArgs a = *args;
  const int64_t nseg = a.batch * a.num_kv_heads, qsize = nseg * a.nq * a.head_dim;
  // the bound max(q*min, q*max) is q_pos*max + q_neg*min: split q once, not per block
  std::vector<float> q_pos(qsize), q_neg(qsize);
  for (int64_t i = 0; i < qsize; ++i) {
    q_pos[i] = std::max(args->q_pos[i], 0.f);
    q_neg[i] = std::min(args->q_pos[i], 0.f);
  }
  table->layout[dtype](q_pos.data(), nseg * a.nq, a.head_dim, 0);
  table->layout[dtype](q_neg.data(), nseg * a.nq, a.head_dim, 0);
  a.q_pos = q_pos.data();
  a.q_neg = q_neg.data();
  const int64_t nlb = (a.num_blocks + a.factor - 1) / a.factor;
  const int64_t total = nseg * nlb;
  // scores == null (only the top-k wanted): a grow-only buffer of the calling thread instead of a fresh
  // tensor page-faulted in on every call (8 KV heads x 8192 blocks: 256 KB)
  static thread_local std::vector<float> own_scores;
  if (scores == nullptr) {
    if (k < 0) return -1;
    if (own_scores.size() < static_cast<size_t>(total)) own_scores.resize(total);
    scores = own_scores.data();
  }
  const int nt = threads_for(num_threads, total, kMinBlocksPerThread);
  // a few chunks per thread, taken dynamically: a preempted thread does not stall the call
  const int64_t chunk = std::max(kMinBlocksPerThread, (total + 4 * nt - 1) / (4 * nt));
  const int64_t nchunks = (total + chunk - 1) / chunk;
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < nchunks; ++c) {
      score_range(table, dtype, a, nlb, c * chunk, std::min(total, (c + 1) * chunk), scores);
    }
    if (k >= 0) {
      // per OpenMP thread and grow-only: fresh buffers each call were page-faulted in each call
      static thread_local std::vector<uint32_t> keys;
      static thread_local std::vector<int64_t> work;
#pragma omp for schedule(dynamic, 1)
      for (int64_t seg = 0; seg < nseg; ++seg) {
        topk_lengths[seg] = topk_segment(scores + seg * nlb, nlb, k, topk_ids + seg * k, keys, work);
      }
    }
  }
  return 0;
}

// Top-k of precomputed scores [nseg, n]; k <= n.
void tandem_topk(const float* scores, int64_t nseg, int64_t n, int64_t k, int64_t* topk_ids,
                 int64_t* topk_lengths, int num_threads) {
  const int nt = tandem::threads_for(num_threads, nseg * n, 4096);
#pragma omp parallel num_threads(nt)
  {
    static thread_local std::vector<uint32_t> keys;
    static thread_local std::vector<int64_t> work;
#pragma omp for schedule(dynamic, 1)
    for (int64_t seg = 0; seg < nseg; ++seg) {
      topk_lengths[seg] = tandem::topk_segment(scores + seg * n, n, k, topk_ids + seg * k, keys, work);
    }
  }
}

// Rows r < num_rows where any query head of a KV group has maw[b, hq, r] > threshold[b, hq].
// maw: rows contiguous, strides (in floats) per batch and head; threshold: [B, Hq].
// out needs room for B * Hkv * num_rows entries: it receives [B, Hkv, width] ascending ids padded with 0,
// width = max length, which is returned; lengths: [B, Hkv].
int64_t tandem_threshold_select(const float* maw, int64_t batch, int64_t num_q_heads, int64_t stride_b,
                                int64_t stride_h, int64_t num_rows, int64_t num_kv_heads,
                                const float* threshold, int64_t* out, int64_t* lengths, int num_threads) {
  using tandem::kThresholdChunk;
  const int64_t group = num_q_heads / num_kv_heads, nseg = batch * num_kv_heads;
  const int64_t nchunks = (num_rows + kThresholdChunk - 1) / kThresholdChunk;
  const int64_t items = nseg * nchunks;
  std::vector<uint8_t> keep(static_cast<size_t>(nseg * num_rows));
  std::vector<int64_t> counts(items + 1, 0);  // per item, then exclusive offsets within each segment
  int64_t width = 0;
  const int nt = tandem::threads_for(num_threads, nseg * group * num_rows, 16384);
#pragma omp parallel num_threads(nt)
  {
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t seg = it / nchunks, r0 = (it % nchunks) * kThresholdChunk;
      const int64_t r1 = std::min(num_rows, r0 + kThresholdChunk);
      const int64_t b = seg / num_kv_heads, h = seg % num_kv_heads;
      uint8_t* k = keep.data() + seg * num_rows;
      std::fill(k + r0, k + r1, 0);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = h * group + g;
        const float* m = maw + b * stride_b + hq * stride_h;
        const float thr = threshold[b * num_q_heads + hq];
        for (int64_t r = r0; r < r1; ++r) k[r] |= m[r] > thr;
      }
      int64_t c = 0;
      for (int64_t r = r0; r < r1; ++r) c += k[r];
      counts[it] = c;
    }
#pragma omp single
    {
      for (int64_t seg = 0; seg < nseg; ++seg) {
        int64_t run = 0;
        for (int64_t c = 0; c < nchunks; ++c) {
          const int64_t n = counts[seg * nchunks + c];
          counts[seg * nchunks + c] = run;
          run += n;
        }
        lengths[seg] = run;
        width = std::max(width, run);
      }
    }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t seg = it / nchunks, c = it % nchunks, r0 = c * kThresholdChunk;
      const int64_t r1 = std::min(num_rows, r0 + kThresholdChunk);
      const uint8_t* k = keep.data() + seg * num_rows;
      int64_t* o = out + seg * width + counts[it];
      for (int64_t r = r0; r < r1; ++r) {
        if (k[r]) *o++ = r;
      }
      if (c == nchunks - 1) std::fill(out + seg * width + lengths[seg], out + (seg + 1) * width, 0);
    }
  }
  return width;
}

// Sum of n floats read by num_threads threads with the chosen ISA's widest loads (bandwidth probe).
double tandem_read_sum(int isa, const float* data, int64_t n, int num_threads) {
  const tandem::KernelTable* table = tandem::table_for(isa);
  if (table == nullptr) return NAN;
  double total = 0.0;
#pragma omp parallel num_threads(std::max(num_threads, 1)) reduction(+ : total)
  {
    const int team = omp_get_num_threads(), t = omp_get_thread_num();
    // 64-byte aligned split points keep every thread's loads on whole cache lines
    const int64_t lo = tandem::split(n / 16, t, team) * 16;
    const int64_t hi = t + 1 == team ? n : tandem::split(n / 16, t + 1, team) * 16;
    total += table->read_sum(data + lo, hi - lo);
  }
  return total;
}

}  // extern "C"
