// Selection drivers: Quest block scoring (+ top-k), HGCA threshold selection, and the read-bandwidth probe.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>
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

// Top-k of one segment in the reference's order: ranked by score (ties by lower id, NaN ranks highest as in
// torch.topk), then the finite picks in ascending id, then the non-finite ones in ascending id.
int64_t topk_segment(const float* scores, int64_t n, int64_t k, int64_t* out, std::vector<int64_t>& ids) {
  auto rank = [&](int64_t i) { return std::isnan(scores[i]) ? INFINITY : scores[i]; };
  auto better = [&](int64_t x, int64_t y) {
    const float rx = rank(x), ry = rank(y);
    return rx > ry || (rx == ry && x < y);
  };
  ids.resize(n);
  std::iota(ids.begin(), ids.end(), 0);
  if (k < n) std::nth_element(ids.begin(), ids.begin() + k, ids.end(), better);
  auto finite = [&](int64_t i) { return std::isfinite(scores[i]); };
  std::sort(ids.begin(), ids.begin() + k, [&](int64_t x, int64_t y) {
    const bool fx = finite(x), fy = finite(y);
    return fx != fy ? fx : x < y;
  });
  std::copy(ids.begin(), ids.begin() + k, out);
  return std::count_if(ids.begin(), ids.begin() + k, finite);
}

}  // namespace
}  // namespace tandem

extern "C" {

// scores: [B, Hkv, ceil(nblk / factor)] fp32. With k >= 0 also writes the top-k of each (request, KV head)
// into topk_ids [B, Hkv, k] and topk_lengths [B, Hkv]. Returns 0, or -1 if isa / dtype is unavailable.
int64_t tandem_score_topk(int isa, int dtype, const tandem::ScoreArgs* args, float* scores, int64_t k,
                          int64_t* topk_ids, int64_t* topk_lengths, int num_threads) {
  using namespace tandem;
  const KernelTable* table = table_for(isa);
  if (table == nullptr || dtype < 0 || dtype >= kNumDtypes) return -1;
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
      std::vector<int64_t> ids;
#pragma omp for schedule(dynamic, 1)
      for (int64_t seg = 0; seg < nseg; ++seg) {
        topk_lengths[seg] = topk_segment(scores + seg * nlb, nlb, k, topk_ids + seg * k, ids);
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
    std::vector<int64_t> ids;
#pragma omp for schedule(dynamic, 1)
    for (int64_t seg = 0; seg < nseg; ++seg) {
      topk_lengths[seg] = tandem::topk_segment(scores + seg * n, n, k, topk_ids + seg * k, ids);
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
