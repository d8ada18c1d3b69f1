// Certified row selection: `certified_rows_reference` of tandem/policies/certify.py in one call. Per query head,
// the key sketch's upper and lower bound of every host row's scaled logit, the histogram selection of
// `certified_blocks` (float64 bins of bucket_nats under the head's best bound, the fewest whole buckets whose
// tail certifies epsilon, capped), the union of each KV head's group of picks, then `skipped_rows`: the log
// upper mass of the live rows a head skips, and the largest value norm of the blocks holding one.
//
// The same fp32 and float64 operations as the reference, except for the order of three kinds of sums: the fp32
// dot products' (the bounds stay sound: key_sketch pads the error radius for any order), the histogram's float64
// bins (row by row), and the skipped mass (below). A row whose bound sits within rounding of a bucket edge may
// therefore fall into the neighbouring bucket.
//
// One OpenMP team runs four stages:
// 1. per (segment = request x KV head, chunk of rows): the group's dot products with the int8 codes (per-ISA
//    worker, certify_impl.h) and every row's upper / lower bound per query head, into [B * Hq, n] scratch;
// 2. per query head: its top (best free bound, or the hot tier's mass), each row's bucket, the histogram and
//    the cut; a head is a unit of work here because the cut needs all of its rows;
// 3. per (segment, chunk): the union (forced rows, then each head's buckets below its cut), and per query head
//    the upper mass of the rows under its cut that another head of the group picked; the chunk's largest value
//    norm over blocks with a skipped row;
// 4. per query head and segment: tail_lse and skipped_norm from the chunks' parts.
// A head's skipped mass is the histogram's tail at its cut (every free row it does not pick) less what the rest
// of its group picked there: one exp per row picked by another head, instead of one per skipped row.
// Chunks are whole blocks, so that a block's skipped rows are all seen by one chunk of stage 3.
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tandem_cpu.h"
#include "simd_scalar.h"
#include "certify_impl.h"

namespace tandem {

// The portable workers compile here: this translation unit is built for the baseline ISA anyway.
const CertifyTable* certify_table_scalar() {
  static const CertifyTable table = make_certify_table<VScalar>();
  return &table;
}

namespace {

constexpr int64_t kChunkRows = 512;           // rows per work item of stages 1 and 3 (rounded to whole blocks)
constexpr int64_t kMinPairsPerThread = 8192;  // (row, query head) pairs per thread: fewer cost more in sync
// Rows a head does not rank take the bins past the histogram's last: forced ones kForcedBin, those whose bound is
// not finite kUnranked (padding at -inf adds 0 there; +inf or NaN make the bin's sum so, which stage 4 checks).
constexpr uint8_t kForcedBin = kMaxBuckets, kUnranked = kMaxBuckets + 1;
constexpr int32_t kBins = kMaxBuckets + 2;
// A head's tail from the difference of two sums is taken where it keeps at least ~8 of float64's 16 digits and
// lies above the terms exp_f64 drops (e^-708 and less, relative to top); else it is summed again over the
// skipped rows, from their own maximum.
constexpr double kCancellation = 1e-8;
constexpr double kTinyTail = 1e-290;

const CertifyTable* certify_table_for(int isa) {
  if (!isa_supported(isa)) return nullptr;
  switch (isa) {
    case kScalar:
      return certify_table_scalar();
    case kAvx2:
      return certify_table_avx2();
    case kAvx512:
    case kAvx512Bf16:
      return certify_table_avx512();
    default:
      return nullptr;
  }
}

constexpr float kInf = __builtin_inff();

inline bool finite(float x) { return std::fabs(x) < kInf; }
inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// A call's derived shapes and its scratch (grow-only buffers of the calling thread: fresh ones were page-faulted
// in on every call).
struct Plan {
  const CertifyArgs* a = nullptr;
  int64_t group = 0, heads = 0, segs = 0, chunk = 0, nchunks = 0, items = 0;
  double per_nat = 0.0;         // 1 / bucket_nats where that is exact (a power of two), else 0
  std::vector<float> q_norm;    // [heads] ||q||
  std::vector<float> upper;     // [heads, n] the rows' bounds per query head
  std::vector<float> lower;
  std::vector<uint8_t> bucket;  // [heads, n] the row's bin for the head
  std::vector<float> best;      // [items, group] the best free upper bound per chunk, or -inf
  std::vector<double> top;      // [heads] the reference point of the head's histogram
  std::vector<int64_t> take_at; // [heads] the head picks its rows of buckets below this
  std::vector<double> cut_tail; // [heads] upper mass of the free rows at or past the cut, relative to top
  std::vector<uint8_t> odd;     // [heads] some row the head does not rank has an upper bound of +inf or NaN
  std::vector<double> removed;  // [items, group] the part of cut_tail that another head picked
  std::vector<int64_t> skipped; // [items] rows valid and not in the union
  std::vector<float> norm;      // [items] largest value norm of a block with a skipped row, or -inf
  std::vector<int64_t> blocks;  // [items] blocks with a skipped row

  void layout(const CertifyArgs* args) {
    a = args;
    group = a->num_q_heads / a->num_kv_heads;
    heads = a->batch * a->num_q_heads;
    segs = a->batch * a->num_kv_heads;
    chunk = (kChunkRows + a->block_size - 1) / a->block_size * a->block_size;
    nchunks = (a->n + chunk - 1) / chunk;
    items = segs * nchunks;
    int exponent = 0;
    per_nat = std::frexp(a->bucket_nats, &exponent) == 0.5 ? 1.0 / a->bucket_nats : 0.0;
    const int64_t rows = heads * a->n;
    grow(upper, rows), grow(lower, rows), grow(bucket, rows);
    grow(q_norm, heads), grow(top, heads), grow(take_at, heads), grow(cut_tail, heads), grow(odd, heads);
    grow(best, items * group), grow(removed, items * group);
    grow(skipped, items), grow(norm, items), grow(blocks, items);
  }

  template <class T>
  static void grow(std::vector<T>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  }
};

// The best upper bound of m rows that the head ranks (finite, not forced), or -inf: selects and four independent
// maxima, so that neither a branch per row nor one chain of max latencies bounds the loop.
float best_free(const float* __restrict up, const uint8_t* __restrict forced, int64_t m) {
  float best[4] = {-kInf, -kInf, -kInf, -kInf};
  for (int64_t r = 0; r < m; ++r) {
    const float u = finite(up[r]) && !(forced && forced[r]) ? up[r] : -kInf;
    best[r & 3] = u > best[r & 3] ? u : best[r & 3];
  }
  return max_num(max_num(best[0], best[1]), max_num(best[2], best[3]));
}

// Stage 1 for one chunk: bounds of its rows of segment `seg` for each query head of the group.
void bound_chunk(const CertifyTable* table, Plan& p, int64_t seg, int64_t c, std::vector<float>& dots) {
  const CertifyArgs& a = *p.a;
  const int64_t b = seg / a.num_kv_heads, h = seg % a.num_kv_heads;
  const int64_t r0 = c * p.chunk, m = min64(p.chunk, a.n - r0);
  const int64_t head0 = b * a.num_q_heads + h * p.group;
  Plan::grow(dots, p.group * m);
  const int8_t* codes = a.codes + b * a.codes_stride_b + h * a.codes_stride_h + r0 * a.codes_stride_row;
  table->sketch_dots(a.q + head0 * a.head_dim, p.group, a.head_dim, codes, a.codes_stride_row, m, dots.data(), m);
  const float* rs = a.row_scale + b * a.row_scale_stride_b + h * a.row_scale_stride_h + r0;
  const float* err = a.error + b * a.error_stride_b + h * a.error_stride_h + r0;
  const uint8_t* valid = a.row_valid + b * a.row_valid_stride_b + r0;
  const uint8_t* forced = a.forced ? a.forced + b * a.forced_stride_b + h * a.forced_stride_h + r0 : nullptr;
  for (int64_t j = 0; j < p.group; ++j) {
    float* up = p.upper.data() + (head0 + j) * a.n + r0;
    table->bound_rows(dots.data() + j * m, p.q_norm[head0 + j], rs, err, valid, m, a.scale, a.slack_abs,
                      a.slack_rel, up, p.lower.data() + (head0 + j) * a.n + r0);
    p.best[(seg * p.nchunks + c) * p.group + j] = best_free(up, forced, m);
  }
}

// One bin of a head's histogram (bins past the last bucket: rows it does not rank).
struct Bin {
  double tail;    // upper mass relative to top
  double gained;  // lower mass relative to top
  int64_t count;
};

// suffix[j] = the histogram's tail past bucket j, j in [0, buckets], summed from the far end as the reference.
void tail_suffix(const Bin* hist, int64_t buckets, double* suffix) {
  suffix[buckets] = 0.0;
  double run = 0.0;
  for (int64_t j = buckets - 1; j >= 0; --j) suffix[j] = run += hist[j].tail;
}

// The first prefix of buckets whose tail certifies against `known` alone, or `buckets`. The cut never looks past
// it: a prefix's lower masses only add to what is known. So the lower masses of the buckets from here on are
// never needed, and stage 2 computes them for the rows above it only.
int64_t certified_without_gain(const double* suffix, int64_t buckets, double known, double ratio, double margin) {
  for (int64_t j = 0; j < buckets; ++j) {
    if (suffix[j] * margin <= known * ratio) return j;
  }
  return buckets;
}

// certified_blocks' cut for one head from its histogram: the first prefix of whole buckets j whose tail certifies
// epsilon against the known mass plus the prefix's lower mass, then capped where the prefix's units (forced rows
// first) pass max(max_units, forced rows). Sums run in the reference's order: the gained mass and the units from
// the front. Returns the tail at the cut.
double cut_head(const Bin* hist, const double* suffix, int64_t buckets, double known, double ratio,
                double margin, int64_t forced_count, int64_t max_units, int64_t* take_at, int64_t* needed,
                int64_t* kept) {
  int64_t units[kMaxBuckets + 1];
  units[0] = forced_count;
  int64_t need_at = -1, counted = 0;
  double gained = 0.0;
  for (int64_t j = 0; j <= buckets; ++j) {
    if (j > 0) {
      gained += hist[j - 1].gained;
      counted += hist[j - 1].count;
      units[j] = forced_count + counted;
    }
    const double known_j = j > 0 ? known + gained : known;
    if (need_at < 0 && suffix[j] * margin <= known_j * ratio) need_at = j;
  }
  if (need_at < 0) need_at = 0;  // none certifies (NaN inputs): argmax of all-false
  const int64_t most = max_units > forced_count ? max_units : forced_count;
  int64_t within = 0;
  for (int64_t j = 0; j <= buckets; ++j) within += units[j] <= most;
  const int64_t cap_at = within - 1;
  *take_at = need_at < cap_at ? need_at : cap_at;
  *needed = units[need_at];
  *kept = units[*take_at];
  return suffix[*take_at];
}

// Per-thread buffers for one chunk of rows (grow-only): stage 2's exponentials, and the rows gathered
// for an exponential of their own (stages 2 and 3).
struct RowScratch {
  std::vector<double> e;
  std::vector<int64_t> ids;
  std::vector<float> x;
  void grow(int64_t n) {
    Plan::grow(e, n), Plan::grow(ids, n), Plan::grow(x, n);
  }
};

// The lower masses relative to top of the rows the cut may need, in row order: with `forced`, the sum over the
// forced rows with a finite upper bound (all of them count toward the known mass); else, into gained, those of
// the rows of buckets below `reach`. The rows are gathered first, so that one vectorised exponential serves them.
double lower_masses(const CertifyTable* table, const float* up, const float* lo, const uint8_t* bucket, int64_t n,
                    int64_t chunk, bool forced, int64_t reach, double top, RowScratch& s, Bin* hist) {
  double forced_low = 0.0;
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t m = min64(chunk, n - r0);
    int64_t k = 0;
    for (int64_t r = r0; r < r0 + m; ++r) {  // branch-free: which rows pass is data
      s.ids[k] = r, s.x[k] = lo[r];
      k += forced ? bucket[r] == kForcedBin && finite(up[r]) : bucket[r] < reach;
    }
    table->exp_shifted(s.x.data(), k, top, s.e.data());
    for (int64_t i = 0; i < k; ++i) {
      if (forced) {
        forced_low += s.e[i];
      } else {
        hist[bucket[s.ids[i]]].gained += s.e[i];
      }
    }
  }
  return forced_low;
}

// Stage 2 for one query head: top, bins, histogram and cut.
void rank_head(const CertifyTable* table, Plan& p, int64_t head, int64_t* needed, int64_t* kept, RowScratch& s) {
  const CertifyArgs& a = *p.a;
  const int64_t b = head / a.num_q_heads, hq = head % a.num_q_heads, h = hq / p.group;
  const int64_t seg = b * a.num_kv_heads + h;
  const float* up = p.upper.data() + head * a.n;
  uint8_t* bucket = p.bucket.data() + head * a.n;
  const uint8_t* forced = a.forced ? a.forced + b * a.forced_stride_b + h * a.forced_stride_h : nullptr;
  float best = -kInf;
  for (int64_t c = 0; c < p.nchunks; ++c) best = max_num(best, p.best[(seg * p.nchunks + c) * p.group + hq % p.group]);
  // torch.maximum propagates NaN, and a top that is not finite becomes 0
  const float known_lse = a.known_lse[head];
  const float t = std::isnan(known_lse) ? known_lse : known_lse > best ? known_lse : best;
  const double top = finite(t) ? t : 0.0;
  Bin hist[kBins];
  std::memset(hist, 0, sizeof hist);
  s.grow(p.chunk);
  for (int64_t r0 = 0; r0 < a.n; r0 += p.chunk) {
    const int64_t m = min64(p.chunk, a.n - r0);
    uint8_t* bin = bucket + r0;
    table->rank_rows(up + r0, m, top, a.bucket_nats, p.per_nat, static_cast<double>(a.buckets - 1), kUnranked,
                     s.e.data(), bin);
    if (forced) {
      for (int64_t i = 0; i < m; ++i) bin[i] = forced[r0 + i] ? kForcedBin : bin[i];
    }
    for (int64_t i = 0; i < m; ++i) {
      hist[bin[i]].tail += s.e[i];
      ++hist[bin[i]].count;
    }
  }
  double suffix[kMaxBuckets + 1];
  tail_suffix(hist, a.buckets, suffix);
  const double ratio = a.epsilon / (1.0 - a.epsilon), margin = 1.0 + a.tail_margin;
  double known = std::exp(static_cast<double>(known_lse) - top);
  // the forced rows' lower masses come first: they decide how far the rest is needed
  if (hist[kForcedBin].count > 0) {
    known += lower_masses(table, up, p.lower.data() + head * a.n, bucket, a.n, p.chunk, true, 0, top, s, nullptr);
  }
  const int64_t reach = certified_without_gain(suffix, a.buckets, known, ratio, margin);
  if (reach > 0) {
    lower_masses(table, up, p.lower.data() + head * a.n, bucket, a.n, p.chunk, false, reach, top, s, hist);
  }
  const int64_t max_units = a.max_units[b * a.max_units_stride_b + hq * a.max_units_stride_h];
  p.top[head] = top;
  p.odd[head] = !std::isfinite(hist[kUnranked].tail);
  p.cut_tail[head] = cut_head(hist, suffix, a.buckets, known, ratio, margin, hist[kForcedBin].count, max_units,
                              &p.take_at[head], needed + head, kept + head);
}

// un[r] |= bucket[r] < cut over m rows.
void pick_rows(const uint8_t* __restrict bucket, uint8_t cut, int64_t m, uint8_t* __restrict un) {
  for (int64_t r = 0; r < m; ++r) un[r] |= bucket[r] < cut;
}

// skip[r] = the row is valid and not in the union (0 / 1 bytes in, 0 / 1 out); returns how many are.
int64_t skipped_rows(const uint8_t* __restrict valid, const uint8_t* __restrict un, int64_t m,
                     uint8_t* __restrict skip) {
  int64_t count = 0;
  for (int64_t r = 0; r < m; ++r) {
    skip[r] = valid[r] & (un[r] ^ 1);
    count += skip[r];
  }
  return count;
}

// The upper mass relative to top of the rows a head ranks at or past its cut that are in the union anyway
// (gathered, then one vectorised exponential).
double picked_by_others(const CertifyTable* table, const float* up, const uint8_t* bucket, const uint8_t* un,
                        int64_t m, int64_t cut, int64_t buckets, double top, RowScratch& s) {
  int64_t k = 0;
  for (int64_t r = 0; r < m; ++r) {
    s.x[k] = up[r];
    k += un[r] && bucket[r] >= cut && bucket[r] < buckets;
  }
  table->exp_shifted(s.x.data(), k, top, s.e.data());
  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) sum += s.e[i];
  return sum;
}

// The largest value norm of the blocks of a chunk holding a skipped row (-inf if none), and how many do.
float skipped_blocks(const uint8_t* skip, const float* norm, int64_t first, int64_t count, int64_t block_size,
                     int64_t* blocks) {
  float largest = -kInf;
  *blocks = 0;
  for (int64_t k = 0; k < count; ++k) {
    uint8_t any = 0;
    for (int64_t r = 0; r < block_size; ++r) any |= skip[k * block_size + r];
    if (any) {
      ++*blocks;
      largest = max_num(largest, norm[first + k]);
    }
  }
  return largest;
}

// Stage 3 for one chunk: union rows, what each head's cut leaves to others, the skipped blocks' largest norm.
void union_chunk(const CertifyTable* table, Plan& p, int64_t seg, int64_t c, uint8_t* union_rows, RowScratch& s,
                 std::vector<uint8_t>& skip) {
  const CertifyArgs& a = *p.a;
  const int64_t b = seg / a.num_kv_heads, h = seg % a.num_kv_heads;
  const int64_t r0 = c * p.chunk, m = min64(p.chunk, a.n - r0), item = seg * p.nchunks + c;
  const int64_t head0 = b * a.num_q_heads + h * p.group;
  s.grow(m);
  uint8_t* un = union_rows + seg * a.n + r0;
  if (a.forced) {
    const uint8_t* forced = a.forced + b * a.forced_stride_b + h * a.forced_stride_h + r0;
    for (int64_t r = 0; r < m; ++r) un[r] = forced[r] != 0;
  } else {
    std::memset(un, 0, m);
  }
  for (int64_t j = 0; j < p.group; ++j) {  // take_at is at most buckets, below the marks' bins
    pick_rows(p.bucket.data() + (head0 + j) * a.n + r0, static_cast<uint8_t>(p.take_at[head0 + j]), m, un);
  }
  for (int64_t j = 0; j < p.group; ++j) {  // alone in its group, a head's cut leaves only forced rows to others
    const int64_t head = head0 + j, at = head * a.n + r0;
    p.removed[item * p.group + j] = p.group == 1 ? 0.0
                                                 : picked_by_others(table, &p.upper[at], &p.bucket[at], un, m,
                                                                    p.take_at[head], a.buckets, p.top[head], s);
  }
  Plan::grow(skip, m);
  p.skipped[item] = skipped_rows(a.row_valid + b * a.row_valid_stride_b + r0, un, m, skip.data());
  const float* norm = a.value_norm + b * a.value_norm_stride_b + h * a.value_norm_stride_h;
  p.norm[item] = skipped_blocks(skip.data(), norm, r0 / a.block_size, m / a.block_size, a.block_size,
                                &p.blocks[item]);
}

// A head's tail_lse from its skipped rows alone (max, then the sum relative to it), for the tails that the
// difference in stage 3 does not give to float64 precision, and those with a row at +inf or NaN.
float exact_tail(const Plan& p, int64_t head, const uint8_t* un, const uint8_t* valid) {
  const float* up = p.upper.data() + head * p.a->n;
  float best = -kInf;
  for (int64_t r = 0; r < p.a->n; ++r) {
    if (valid[r] && !un[r] && (up[r] > best || up[r] != up[r])) best = up[r];  // NaN wins, as in torch
  }
  if (!finite(best)) return best;
  double sum = 0.0;
  for (int64_t r = 0; r < p.a->n; ++r) {
    if (valid[r] && !un[r]) sum += std::exp(static_cast<double>(up[r]) - best);
  }
  return static_cast<float>(best + std::log(sum));
}

// Stage 4 for one query head: tail_lse, -inf when the group skips nothing.
void finish_head(const Plan& p, int64_t head, const uint8_t* union_rows, float* tail_lse) {
  const CertifyArgs& a = *p.a;
  const int64_t b = head / a.num_q_heads, h = head % a.num_q_heads / p.group, j = head % a.num_q_heads % p.group;
  const int64_t seg = b * a.num_kv_heads + h;
  double removed = 0.0;
  int64_t skipped = 0;
  for (int64_t c = 0; c < p.nchunks; ++c) {
    removed += p.removed[(seg * p.nchunks + c) * p.group + j];
    skipped += p.skipped[seg * p.nchunks + c];
  }
  const double rest = p.cut_tail[head] - removed;
  if (skipped == 0) {
    tail_lse[head] = -kInf;
  } else if (!p.odd[head] && rest > kCancellation * p.cut_tail[head] && rest > kTinyTail) {
    tail_lse[head] = static_cast<float>(p.top[head] + std::log(rest));
  } else {
    tail_lse[head] = exact_tail(p, head, union_rows + seg * a.n, a.row_valid + b * a.row_valid_stride_b);
  }
}

// Stage 4 for one segment: the largest value norm of a block with a skipped row; other blocks count as 0.
void finish_segment(const Plan& p, int64_t seg, float* skipped_norm) {
  const int64_t num_blocks = p.a->n / p.a->block_size;
  float largest = -kInf;
  int64_t blocks = 0;
  for (int64_t c = 0; c < p.nchunks; ++c) {
    largest = max_num(largest, p.norm[seg * p.nchunks + c]);
    blocks += p.blocks[seg * p.nchunks + c];
  }
  skipped_norm[seg] = num_blocks == 0 ? 0.f : blocks < num_blocks ? max_num(largest, 0.f) : largest;
}

}  // namespace
}  // namespace tandem

extern "C" {

// The certified row selection (tandem/kernels/cpu/certify.py checks the arguments). Writes union_rows [B, Hkv, n]
// (0 / 1), needed / kept [B, Hq], tail_lse [B, Hq] and skipped_norm [B, Hkv]. Returns 0, or -1 if isa is not
// supported here or buckets is out of range.
int64_t tandem_certified_rows(int isa, const tandem::CertifyArgs* args, uint8_t* union_rows, int64_t* needed,
                              int64_t* kept, float* tail_lse, float* skipped_norm, int num_threads) {
  using namespace tandem;
  const CertifyTable* table = certify_table_for(isa);
  if (table == nullptr || args->buckets < 1 || args->buckets > kMaxBuckets) return -1;
  // the calling thread's plan, named through a reference: inside the parallel region a thread_local's own name
  // would give each OpenMP thread its own, empty one
  static thread_local Plan calling_thread_plan;
  Plan& p = calling_thread_plan;
  p.layout(args);
  const CertifyArgs& a = *args;
  for (int64_t head = 0; head < p.heads; ++head) {  // ||q|| in float64, rounded once
    const float* q = a.q + head * a.head_dim;
    double s = 0.0;
    for (int64_t d = 0; d < a.head_dim; ++d) s += static_cast<double>(q[d]) * q[d];
    p.q_norm[head] = static_cast<float>(std::sqrt(s));
  }
  const int nt = static_cast<int>(clamp64(min64(num_threads, p.heads * a.n / kMinPairsPerThread), 1, 1 << 20));
#pragma omp parallel num_threads(nt)
  {
    // per OpenMP thread and grow-only, as the calling thread's
    static thread_local std::vector<float> dots;
    static thread_local RowScratch rows;
    static thread_local std::vector<uint8_t> skip;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < p.items; ++it) bound_chunk(table, p, it / p.nchunks, it % p.nchunks, dots);
#pragma omp for schedule(dynamic, 1)
    for (int64_t head = 0; head < p.heads; ++head) rank_head(table, p, head, needed, kept, rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < p.items; ++it) {
      union_chunk(table, p, it / p.nchunks, it % p.nchunks, union_rows, rows, skip);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < p.heads + p.segs; ++i) {  // one loop: a barrier fewer
      if (i < p.heads) {
        finish_head(p, i, union_rows, tail_lse);
      } else {
        finish_segment(p, i - p.heads, skipped_norm);
      }
    }
  }
  return 0;
}

}  // extern "C"
