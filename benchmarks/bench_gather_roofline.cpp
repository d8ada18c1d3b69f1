// Roofline of the CPU sparse-attention kernel's access pattern (a diagnostic, not part of the package).
//
// How fast can the host merely read the rows that kernel reads (Llama-3.1-8B layer: 8 KV heads, head_dim
// 128, bf16; 128K tokens, 5% selected as sorted token ids or 16/64-token blocks; batch 1 and 8), split into
// the same dynamic chunks over 15 threads, with and without the kernel's software prefetch and with as many
// FMAs per row as the kernel's q.k and p.V (64, in 8 independent chains)? Against a sequential read of
// 1 GiB, caches flushed before every timed call. AVX-512 only.
//
//   g++ -O3 -fopenmp -march=native benchmarks/bench_gather_roofline.cpp -o /tmp/gather && /tmp/gather
//
// Result on the GPU host: benchmarks/results/2026-11-26_xeon16_gather_roofline/gather_roofline_intel-xeon-16c.log,
// read in docs/cpu-kernels.md.
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
using clk = std::chrono::steady_clock;
static double now() { return std::chrono::duration<double>(clk::now().time_since_epoch()).count(); }

__attribute__((target("avx512f"))) static double seq_read(const float* p, int64_t n, int nt) {
  double total = 0;
#pragma omp parallel for num_threads(nt) reduction(+ : total) schedule(static)
  for (int64_t i = 0; i < n; i += 64) {
    __m512 a = _mm512_loadu_ps(p + i), b = _mm512_loadu_ps(p + i + 16), c = _mm512_loadu_ps(p + i + 32),
           d = _mm512_loadu_ps(p + i + 48);
    total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
  }
  return total;
}

// rows: global list of (K ptr offset, V ptr offset) in units of rows; each row = 256 bytes (bf16 x 128)
__attribute__((target("avx512f"))) static double gather(const char* K, const char* V, const int64_t* rows,
                                                        int64_t nrows, int nt, int ahead, int compute) {
  const int64_t nchunks = nt * 4, chunk = (nrows + nchunks - 1) / nchunks;
  double total = 0;
#pragma omp parallel for num_threads(nt) reduction(+ : total) schedule(dynamic, 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t lo = c * chunk, hi = std::min(nrows, lo + chunk);
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    __m512 a[8];
    for (int j = 0; j < 8; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t i = lo; i < hi; ++i) {
      if (ahead && i + ahead < hi) {
        const char* pk = K + rows[i + ahead] * 256;
        const char* pv = V + rows[i + ahead] * 256;
        for (int o = 0; o < 256; o += 64) {
          asm volatile("prefetcht0 %0\n\tprefetcht0 %1" ::"m"(pk[o]), "m"(pv[o]));
        }
      }
      const char* k = K + rows[i] * 256;
      const char* v = V + rows[i] * 256;
      for (int o = 0; o < 256; o += 64) {
        __m512 x = _mm512_castsi512_ps(_mm512_loadu_si512(k + o));
        __m512 y = _mm512_castsi512_ps(_mm512_loadu_si512(v + o));
        if (compute) {  // ~ the kernel's 64 FMAs per row (4 queries x 128 dims x 2 / 16 lanes)
          for (int j = 0; j < 8; ++j) a[j] = _mm512_fmadd_ps(x, y, a[j]);
          for (int j = 0; j < 8; ++j) a[j] = _mm512_fmadd_ps(y, x, a[j]);
        } else {
          acc = _mm512_add_ps(acc, x); acc2 = _mm512_add_ps(acc2, y);
        }
      }
    }
    for (int j = 0; j < 8; ++j) acc = _mm512_add_ps(acc, a[j]);
    total += _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
  }
  return total;
}

int main() {
  const int64_t ctx = 131072, heads = 8, D = 128;
  const int maxb = 8;
  const int64_t store_rows = maxb * heads * ctx;  // rows of 256 bytes
  char* K = (char*)aligned_alloc(2 << 20, store_rows * 256);
  char* V = (char*)aligned_alloc(2 << 20, store_rows * 256);
  memset(K, 1, store_rows * 256); memset(V, 2, store_rows * 256);
  const int64_t flush_n = (int64_t(1) << 30) / 4;
  float* F = (float*)aligned_alloc(64, flush_n * 4);
  for (int64_t i = 0; i < flush_n; ++i) F[i] = 1.f;
  std::mt19937_64 gen(1);
  double sink = 0;
  auto timeit = [&](auto fn, int reps) {
    std::vector<double> t;
    for (int r = 0; r < reps + 1; ++r) {
      sink += seq_read(F, flush_n, 15);
      double s = now(); sink += fn(); double e = now();
      if (r) t.push_back(e - s);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  for (int nt : {15, 8, 1}) {
    double s = timeit([&] { return seq_read(F, flush_n, nt); }, 5);
    printf("seq_read threads=%d %.1f GB/s\n", nt, flush_n * 4 / s / 1e9);
  }
  for (int b : {1, 8}) {
    for (int blk : {1, 16, 64}) {
      // per (request, head): 5% of ctx rows, as sorted distinct blocks
      std::vector<int64_t> rows;
      const int64_t units = ctx / blk, count = (int64_t)(0.05 * units + 0.5);
      for (int64_t s = 0; s < b * heads; ++s) {
        std::vector<int64_t> ids(units);
        for (int64_t i = 0; i < units; ++i) ids[i] = i;
        std::shuffle(ids.begin(), ids.end(), gen);
        ids.resize(count);
        std::sort(ids.begin(), ids.end());
        for (int64_t id : ids)
          for (int r = 0; r < blk; ++r) rows.push_back(s * ctx + id * blk + r);
      }
      const double mb = rows.size() * 512.0;
      for (int nt : {15, 8, 1}) {
        for (int ahead : {0, 64}) {
          for (int compute : {0, 1}) {
            if (nt != 15 && (ahead == 0 || compute)) continue;
            double s = timeit([&] { return gather(K, V, rows.data(), rows.size(), nt, ahead, compute); }, 7);
            printf("gather b=%d block=%d threads=%d prefetch=%d fma_per_row=%d: %.3f ms %.1f GB/s\n", b, blk, nt,
                   ahead, compute * 64, s * 1e3, mb / s / 1e9);
          }
        }
      }
    }
  }
  printf("sink %g\n", sink);
}
