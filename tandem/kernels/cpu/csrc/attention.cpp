// Sparse decode attention driver: splits all selected rows of all (request, KV head) segments into equal
// chunks that threads take dynamically, then merges each segment's partial results by LSE
// (FlashDecoding-style).
//
// The split is over the global row space, not over segments: chunk c holds rows [c * C, (c + 1) * C) of
// the concatenation of all segments, so one request with 8 KV heads keeps every core busy and a batch
// with ragged selections stays balanced. A few chunks per thread, taken dynamically, keep a thread that
// the OS preempts (the GPU-launching thread, another process) from stalling the whole call. Chunk c's
// piece of segment i lands in scratch slot c + i; that map is injective because pieces are ordered both
// by chunk and by segment.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tandem_cpu.h"

namespace tandem {
namespace {

constexpr float kLn2 = 0.69314718055994530942f;
// Fewer rows than this per chunk and the piece set-up and the merge cost more than they save.
constexpr int64_t kMinRowsPerChunk = 64;
constexpr int64_t kChunksPerThread = 8;

}  // namespace

// out[seg] / lse[seg] from the pieces in slots [slot0, slot1]; state layout per slot: m, l, acc. A slot whose
// m is -inf adds nothing (out 0, lse -inf where every slot is so).
void merge_slots(const float* scratch, int64_t slot_floats, int64_t slot0, int64_t slot1, int64_t nq,
                   int64_t head_dim, float* out, float* lse) {
  for (int64_t j = 0; j < nq; ++j) {
    float m_max = -INFINITY;
    for (int64_t s = slot0; s <= slot1; ++s) m_max = max_num(m_max, scratch[s * slot_floats + j]);
    float* o = out + j * head_dim;
    if (m_max == -INFINITY) {  // nothing attended: the merge with the GPU side must ignore this side
      std::fill(o, o + head_dim, 0.f);
      lse[j] = -INFINITY;
      continue;
    }
    float total = 0.f;
    std::fill(o, o + head_dim, 0.f);
    for (int64_t s = slot0; s <= slot1; ++s) {
      const float* st = scratch + s * slot_floats;
      const float w = std::exp2(st[j] - m_max);  // 0 for a piece with only masked rows
      if (w == 0.f) continue;
      total += w * st[nq + j];
      const float* acc = st + 2 * nq + j * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += w * acc[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= inv;
    lse[j] = (m_max + std::log2(total)) * kLn2;
  }
}

namespace {

// The driver of both entry points: `a.q` is the raw fp32 query [B, Hkv, NQ, D] (scaled and laid out here).
int64_t attend_all(const KernelTable* table, int dtype, AttendArgs a, float* out, float* lse, int num_threads) {
  const AttendFn attend = table->attend[dtype];
  const int64_t nseg = a.batch * a.num_kv_heads;
  const int64_t nq = a.nq, head_dim = a.head_dim;
  static thread_local std::vector<float> q_scaled;
  q_scaled.assign(a.q, a.q + nseg * nq * head_dim);
  for (float& x : q_scaled) x *= a.q_scale;
  table->layout[dtype](q_scaled.data(), nseg * nq, head_dim, 0);
  a.q = q_scaled.data();

  static thread_local std::vector<int64_t> offsets;  // expanded-row offsets of each segment
  offsets.assign(nseg + 1, 0);
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t len = std::min(std::max<int64_t>(a.lengths[i], 0), a.width);
    offsets[i + 1] = offsets[i] + len * a.block_size;
  }
  const int64_t total = offsets[nseg];
  const int64_t slot_floats = nq * (head_dim + 2);
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, total / kMinRowsPerChunk)));
  const int64_t per_thread = (total + nt - 1) / nt;
  const int64_t chunk = std::max(kMinRowsPerChunk, (per_thread + kChunksPerThread - 1) / kChunksPerThread);
  const int64_t nchunks = (total + chunk - 1) / chunk;
  // reused across calls (grow-only, per calling thread): a fresh buffer of this size is mmap'ed and
  // page-faulted in on every call, a few percent of a small call
  static thread_local std::vector<float> scratch_buffer;
  const size_t scratch_floats = static_cast<size_t>((nchunks + nseg) * slot_floats);
  if (scratch_buffer.size() < scratch_floats) scratch_buffer.resize(scratch_floats);
  float* const scratch = scratch_buffer.data();
  const int64_t* const offs = offsets.data();
  int64_t bad_rows = 0;

#pragma omp parallel num_threads(nt) reduction(+ : bad_rows)
  {
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < nchunks; ++c) {
      const int64_t lo = c * chunk, hi = std::min(total, lo + chunk);
      int64_t seg = std::upper_bound(offs, offs + nseg + 1, lo) - offs - 1;
      for (; seg < nseg && offs[seg] < hi; ++seg) {
        const int64_t s0 = std::max(lo, offs[seg]) - offs[seg];
        const int64_t s1 = std::min(hi, offs[seg + 1]) - offs[seg];
        if (s1 > s0) attend(a, seg, s0, s1, scratch + (c + seg) * slot_floats, &bad_rows);
      }
    }
#pragma omp for schedule(static)
    for (int64_t seg = 0; seg < nseg; ++seg) {
      float* o = out + seg * nq * head_dim;
      float* l = lse + seg * nq;
      if (offs[seg + 1] == offs[seg]) {
        std::fill(o, o + nq * head_dim, 0.f);
        std::fill(l, l + nq, -INFINITY);
        continue;
      }
      const int64_t c0 = offs[seg] / chunk, c1 = (offs[seg + 1] - 1) / chunk;
      merge_slots(scratch, slot_floats, c0 + seg, c1 + seg, nq, head_dim, o, l);
      table->layout[dtype](o, nq, head_dim, 1);
    }
  }
  return bad_rows;
}

// q of any storage dtype to fp32 (n values).
void query_to_f32(const void* src, int src_dtype, int64_t n, float* dst) {
  if (src_dtype == kF32) {
    std::copy(static_cast<const float*>(src), static_cast<const float*>(src) + n, dst);
  } else if (src_dtype == kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(static_cast<const bf16_t*>(src)[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(static_cast<const f16_t*>(src)[i]);
  }
}

}  // namespace

// q of `q_dtype` data [B, Hkv, NQ, D] as the attend functions read it: fp32, scaled by a.q_scale, laid out for
// `dtype`'s kernels. The result lives in a per-thread buffer until this thread's next call.
const float* prepare_query(const KernelTable* table, int dtype, const AttendArgs& a, int q_dtype) {
  static thread_local std::vector<float> q_prepared;
  const int64_t n = a.batch * a.num_kv_heads * a.nq * a.head_dim;
  q_prepared.resize(static_cast<size_t>(n));
  query_to_f32(static_cast<const void*>(a.q), q_dtype, n, q_prepared.data());
  for (float& x : q_prepared) x *= a.q_scale;
  table->layout[dtype](q_prepared.data(), a.batch * a.num_kv_heads * a.nq, a.head_dim, 0);
  return q_prepared.data();
}

}  // namespace tandem

extern "C" {

int64_t tandem_ranked_rows_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                                     const int64_t* ranked, int64_t ranked_width, const int64_t* skips,
                                     const int64_t* counts, int64_t rank_stride, int64_t* indices, int64_t* lengths,
                                     const int64_t* available, int64_t* row_stats, int64_t stats_stride, float* out,
                                     float* lse, int num_threads);

// out: [B, Hkv, NQ, D] fp32, lse: [B, Hkv, NQ] fp32. Returns the number of out-of-range row ids met
// (those rows are skipped), or -1 if `isa` / `dtype` is not available.
int64_t tandem_sparse_attention(int isa, int dtype, const tandem::AttendArgs* args, float* out, float* lse,
                                int num_threads) {
  using namespace tandem;
  const KernelTable* table = table_for(isa);
  if (table == nullptr || dtype < 0 || dtype >= kNumDtypes) return -1;
  return attend_all(table, dtype, *args, out, lse, num_threads);
}

// Attention over ranks [skip, count) of device-ranked block ids (Quest's top-k, best first), in one call:
// ranked [B, Hkv, ranked_width] int64, ids >= cap / block_size are invalid picks and skipped. The kept ids
// of each (request, KV head) are sorted ascending into `indices` ([B, Hkv, count - skip] scratch, so rows
// stream in address order) with their number in `lengths` [B, Hkv]; `args` carries the query as
// `q_dtype` data (fp32 / bf16 / fp16, [B, Hkv, NQ, D]), the store and the mask; its indices, lengths and
// width are set here. Then as tandem_sparse_attention.
//
// stats (nullable) gets, with available [B] the non-padding rows of each request (nullable = no clamp):
//   stats[0] = sum over (b, h) of min(rows of all `count` ranks' valid ids, available[b])
//   stats[1] = rows of the valid ids among the first `skip` ranks (attended elsewhere: the device share)
//   stats[2] = sum over (b, h) of available[b]
// Returns the out-of-range row ids met, -1 if isa / dtype is unavailable, -2 if not 0 <= skip <= count <=
// ranked_width.
int64_t tandem_ranked_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                                const int64_t* ranked, int64_t ranked_width, int64_t skip, int64_t count,
                                int64_t* indices, int64_t* lengths, const int64_t* available, int64_t* stats,
                                float* out, float* lse, int num_threads) {
  return tandem_ranked_rows_attention(isa, dtype, args, q_dtype, ranked, ranked_width, &skip, &count, 0, indices,
                                      lengths, available, stats, 0, out, lse, num_threads);
}

// tandem_ranked_attention with each request's own ranks: request b keeps ranks [skips[b * rank_stride],
// counts[b * rank_stride]) of its ranked ids (rank_stride 0: one pair for all), and its ids name its own store
// (`args->stores`, or the shared one). `indices` is [B, Hkv, width] scratch with width = max(count - skip) (the
// caller's buffer, as wide as the largest), ranked [B, Hkv, ranked_width] padded with invalid ids past a request's
// own. row_stats (nullable) gets the three counters of tandem_ranked_attention per request at row_stats[b * 3 *
// stats_stride ...] (stats_stride 0: summed over the batch into row_stats[0..2]). Returns as tandem_ranked_attention.
int64_t tandem_ranked_rows_attention(int isa, int dtype, const tandem::AttendArgs* args, int q_dtype,
                                     const int64_t* ranked, int64_t ranked_width, const int64_t* skips,
                                     const int64_t* counts, int64_t rank_stride, int64_t* indices, int64_t* lengths,
                                     const int64_t* available, int64_t* row_stats, int64_t stats_stride, float* out,
                                     float* lse, int num_threads) {
  using namespace tandem;
  const KernelTable* table = table_for(isa);
  if (table == nullptr || dtype < 0 || dtype >= kNumDtypes || q_dtype < 0 || q_dtype > kF16) return -1;  // q: float
  AttendArgs a = *args;
  const int64_t nseg = a.batch * a.num_kv_heads;
  int64_t width = 0;
  for (int64_t b = 0; b < a.batch; ++b) {
    const int64_t skip = skips[b * rank_stride], count = counts[b * rank_stride];
    if (skip < 0 || skip > count || count > ranked_width) return -2;
    width = std::max(width, count - skip);
  }
  if (row_stats != nullptr && stats_stride == 0) row_stats[0] = row_stats[1] = row_stats[2] = 0;
  for (int64_t seg = 0; seg < nseg; ++seg) {
    const int64_t b = seg / a.num_kv_heads;
    const int64_t skip = skips[b * rank_stride], count = counts[b * rank_stride];
    const int64_t limit = (a.stores != nullptr ? a.stores[b].cap : a.cap) / a.block_size;
    const int64_t* r = ranked + seg * ranked_width;
    int64_t* ids = indices + seg * width;
    int64_t n = 0, before = 0;
    for (int64_t j = 0; j < skip; ++j) before += (r[j] >= 0 && r[j] < limit);
    for (int64_t j = skip; j < count; ++j) {
      if (r[j] >= 0 && r[j] < limit) ids[n++] = r[j];
    }
    std::sort(ids, ids + n);
    lengths[seg] = n;
    const int64_t avail = available ? available[b] : INT64_MAX;
    if (row_stats != nullptr) {
      int64_t* st = row_stats + b * 3 * stats_stride;
      if (stats_stride != 0 && seg % a.num_kv_heads == 0) st[0] = st[1] = st[2] = 0;
      st[0] += std::min((n + before) * a.block_size, avail);
      st[1] += before * a.block_size;
      st[2] += available ? avail : 0;
    }
  }
  a.indices = indices;
  a.lengths = lengths;
  a.width = width;
  static thread_local std::vector<float> q32;
  q32.resize(nseg * a.nq * a.head_dim);
  query_to_f32(static_cast<const void*>(a.q), q_dtype, static_cast<int64_t>(q32.size()), q32.data());
  a.q = q32.data();
  return attend_all(table, dtype, a, out, lse, num_threads);
}

// In-place exact merge of two partial attentions over disjoint key sets: (out_a, lse_a) <- merge with
// (out_b, lse_b); out_*: [rows, dim] fp32, lse_*: [rows] fp32, contiguous. A side with lse -inf adds nothing,
// whatever its out holds; both -inf leaves out 0 and lse -inf.
void tandem_merge_lse(float* out_a, float* lse_a, const float* out_b, const float* lse_b, int64_t rows,
                      int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const float la = lse_a[r], lb = lse_b[r];
    float* oa = out_a + r * dim;
    const float* ob = out_b + r * dim;
    if (lb == -INFINITY) {
      if (la == -INFINITY) std::fill(oa, oa + dim, 0.f);
      continue;
    }
    if (la == -INFINITY) {
      std::copy(ob, ob + dim, oa);
      lse_a[r] = lb;
      continue;
    }
    const float m = tandem::max_num(la, lb);
    const float wa = std::exp(la - m), wb = std::exp(lb - m), total = wa + wb;
    const float ca = wa / total, cb = wb / total;
    for (int64_t d = 0; d < dim; ++d) oa[d] = ca * oa[d] + cb * ob[d];
    lse_a[r] = m + std::log(total);
  }
}

}  // extern "C"
