// Paged decode attention on CPU: one query token per request attends over its KV blocks, read in place.
//
// The algorithm is vLLM's paged_attention_v1 (Kwon et al. 2023, "Efficient Memory Management for Large Language
// Model Serving with PagedAttention") laid out for CPU threads: one work item per request, whose keys and values are
// read in place (GQA maps query head i to KV head i / (num_heads / num_kv_heads)): slot by slot, once for all query
// heads, or (head sizes 64 and 128) a chunk of slots at a time, its rows read again from L1 per head or per few heads.
// Scores and accumulators are float32 whatever the cache dtype, which is the query's, or bfloat16 / float16 under
// float32 queries (--kv-cache-dtype: keys and values rounded once as they are stored, widened as they are read,
// halving the bytes a decode step reads). Head sizes of 64 and 128 read 16 slots at a time on AVX-512 CPUs, 8 on
// AVX2 ones (chunked_scores, chunked_values): the slot-by-slot loops were bounded by their own work, not by the
// memory (as fast from L2 as from memory), and over a bfloat16 cache by half the memory's rate. A batch of one
// request runs on the calling thread: an OpenMP region for a single work item only adds a fork and a barrier, which
// on a busy machine waits for a descheduled thread (milliseconds per call).
#include "cpu_ops.h"
#include "attention_common.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using splitserve_cpu::convert;
using splitserve_cpu::exp_nonpositive;
using splitserve_cpu::HeadSize;

// HeadSize<64> and HeadSize<128> (attention_common.h): 1.7x the run-time-bounded loops' speed for 64 requests of
// 200 tokens. With the next block's prefetch in for_each_slot below, one thread's decode attention over 64 requests
// of 64-400 tokens went from 7.4 to 2.6-3.4 ms (python -m benchmarks.decode_attention; docs/benchmarks.md, "One call
// per decode step"), before the chunked passes took over those head sizes on AVX2 and AVX-512 CPUs.
template <typename cache_t, typename Head>
inline float dot(const float* q, const cache_t* k, Head head) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < head.value(); ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// The `bytes` bytes of a cache row from `row` on, brought into L2.
//
// The AVX2 passes fetch the next chunk's rows into L1 as a chunk starts and the rows kL2Ahead slots on into L2. Over
// a 64-row decode step of `small` (contexts of 130-270 tokens, float32, two threads, the step's products between the
// layers' attention calls) the L2 fetch took the AVX-512 passes, which then worked the same way, from 11.6-12.2 to
// 10.9-11.2 ms (docs/benchmarks.md, "Prefill attention over the paged cache", its end; times with glibc's scalar exp
// inside, the softmax's below).
//
// The AVX-512 passes now spread the next chunk's fetch over the chunk's work instead: with every slot they read,
// its share of the lines of one row of the next chunk goes to L2, and nothing goes to L1 ahead of use. Fetching a
// chunk's lines all at once as it starts stalls the work behind them; one line fetched per line read keeps the
// memory busy while the core computes. In a C test reading 16 KiB blocks scattered over 1 GiB on both threads, with
// work per line as slow as this kernel's, one-per-line fetches read 21.5 GB/s against 14.5 for fetching a block's
// lines as it starts; 8 layers' attention with their products and the LM head between the calls took 8.9 ms a step
// against 9.9-10.2 (64 requests of log-normal contexts, alternated builds); whole runs of the throughput set, with
// the softmax's exp change too, 0.98-1.05x the tokens a second, median 1.03x (docs/benchmarks.md, "Decode
// attention's fetches spread over its work"). The AVX2 passes, given the same (one, two or four chunks ahead), were
// 1-6% slower there, and keep the bursts.
inline void prefetch_row_l2(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(row) + b, _MM_HINT_T1);
}

#endif

#if defined(__AVX512F__)
// 16 values of a cache row widened to float32, exactly: float32, bfloat16 (its bits are a float32's upper half) or
// float16.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane s of the result: the sum of a[s]'s 16 lanes (a transpose by pairs, 15 shuffles of each kind and their sums).
inline __m512 sum_lanes(const __m512 (&a)[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i) {  // 128-bit lane l of b[i]: partial sums of a[2i] and a[2i+1] over that lane
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // lane l of c[i]: a[4i..4i+3] summed over lane l
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // across the four 128-bit lanes: lanes (0, 2) and (1, 3) of a pair, then again
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xdd));
}

// The value sums of query heads [head0, head0 + kHeads) of one KV head (their kHeads x HEAD / 16 vectors in
// registers) over the `count` slots `rows[s]` (each the KV head's HEAD values) with their probabilities p[h * n + s].
// With each slot, the same KV head's values of slot s of the next chunk (`ahead[s]`, the first `ahead_count`) are
// brought into L2 (prefetch_row_l2 says why).
template <int HEAD, int kHeads, typename cache_t>
inline void add_values(float* acc, const cache_t* const* rows, int64_t count, const float* p, int64_t n,
                       const cache_t* const* ahead, int64_t ahead_count) {
  constexpr int kVectors = HEAD / 16;
  __m512 sum[kHeads][kVectors];
  for (int h = 0; h < kHeads; ++h)
    for (int v = 0; v < kVectors; ++v) sum[h][v] = _mm512_loadu_ps(acc + h * HEAD + 16 * v);
  for (int64_t s = 0; s < count; ++s) {
    if (s < ahead_count) prefetch_row_l2(ahead[s], HEAD * sizeof(cache_t));
    __m512 value[kVectors];
    for (int v = 0; v < kVectors; ++v) value[v] = load16(rows[s] + 16 * v);
    for (int h = 0; h < kHeads; ++h) {
      const __m512 weight = _mm512_set1_ps(p[h * n + s]);
      for (int v = 0; v < kVectors; ++v) sum[h][v] = _mm512_fmadd_ps(weight, value[v], sum[h][v]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc + h * HEAD + 16 * v, sum[h][v]);
}

// add_values for `heads` (1 to kHeads) query heads.
template <int HEAD, int kHeads, typename cache_t>
inline void add_values_of(int64_t heads, float* acc, const cache_t* const* rows, int64_t count, const float* p,
                          int64_t n, const cache_t* const* ahead, int64_t ahead_count) {
  if (heads == kHeads) {
    add_values<HEAD, kHeads>(acc, rows, count, p, n, ahead, ahead_count);
  } else if constexpr (kHeads > 1) {
    add_values_of<HEAD, kHeads - 1>(heads, acc, rows, count, p, n, ahead, ahead_count);
  }
}

// scores [num_heads, n]: every query head's (q, already scaled: [num_heads, HEAD]) dot products with the n keys at
// `offsets` (cache rows of num_kv_heads x HEAD values), 16 slots at a time; `zeros`, a row of zeros, stands in for
// the slots past n. With each head's dot product of slot s, its share of the lines of slot s's row in the next chunk
// is brought into L2 (prefetch_row_l2 says why).
template <int HEAD, typename cache_t>
void chunked_scores(const float* q, const cache_t* keys, const int64_t* offsets, int64_t n, int64_t num_heads,
                    int64_t group, const cache_t* zeros, float* scores) {
  constexpr int kVectors = HEAD / 16;
  const int64_t row_bytes = num_heads / group * HEAD * static_cast<int64_t>(sizeof(cache_t));
  const int64_t row_lines = (row_bytes + 63) / 64, head_lines = (row_lines + num_heads - 1) / num_heads;
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    const cache_t* rows[16];
    for (int s = 0; s < 16; ++s) rows[s] = s < count ? keys + offsets[j0 + s] : zeros;
    const __mmask16 mask = static_cast<__mmask16>(count == 16 ? 0xffff : (1u << count) - 1);
    const int64_t ahead = std::min<int64_t>(16, n - j0 - 16);  // slots of the next chunk
    for (int64_t h = 0; h < num_heads; ++h) {
      const int64_t kv = (h / group) * HEAD;
      const int64_t line0 = std::min(row_lines, h * head_lines), line1 = std::min(row_lines, line0 + head_lines);
      __m512 qv[kVectors];
      for (int v = 0; v < kVectors; ++v) qv[v] = _mm512_loadu_ps(q + h * HEAD + 16 * v);
      __m512 dots[16];
      for (int s = 0; s < 16; ++s) {
        if (s < ahead) {
          const char* row = reinterpret_cast<const char*>(keys + offsets[j0 + 16 + s]);
          for (int64_t line = line0; line < line1; ++line) _mm_prefetch(row + 64 * line, _MM_HINT_T1);
        }
        __m512 d = _mm512_mul_ps(qv[0], load16(rows[s] + kv));
        for (int v = 1; v < kVectors; ++v) d = _mm512_fmadd_ps(qv[v], load16(rows[s] + kv + 16 * v), d);
        dots[s] = d;
      }
      _mm512_mask_storeu_ps(scores + h * n + j0, mask, sum_lanes(dots));
    }
  }
}

// acc [num_kv_heads * group, HEAD] += the n values at `offsets` weighted by the probabilities p [heads, n], 16 slots
// at a time, a KV head's query heads up to 16 vectors of sums at a time.
template <int HEAD, typename cache_t>
void chunked_values(float* acc, const cache_t* values, const int64_t* offsets, int64_t n, int64_t num_kv_heads,
                    int64_t group, const float* p) {
  constexpr int kPerPass = 16 / (HEAD / 16);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    const int64_t ahead = std::clamp<int64_t>(n - j0 - 16, 0, 16);  // slots of the next chunk
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      const cache_t* rows[16];
      const cache_t* next[16];
      for (int64_t s = 0; s < count; ++s) rows[s] = values + offsets[j0 + s] + kv * HEAD;
      for (int64_t s = 0; s < ahead; ++s) next[s] = values + offsets[j0 + 16 + s] + kv * HEAD;
      for (int64_t h0 = 0; h0 < group; h0 += kPerPass) {  // the first pass prefetches this KV head's next values
        const int64_t h = kv * group + h0;
        add_values_of<HEAD, kPerPass>(std::min<int64_t>(kPerPass, group - h0), acc + h * HEAD, rows, count,
                                      p + h * n + j0, n, next, h0 == 0 ? ahead : 0);
      }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (8 floats per vector, 16 registers): the same passes 8 slots at a time.

// The `bytes` bytes of a cache row from `row` on, brought into L1 (the next chunk's slots).
inline void prefetch_row(const void* row, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(row) + b, _MM_HINT_T0);
}

// Slots ahead of the chunk being read whose rows are brought into L2: four chunks of 8.
constexpr int64_t kL2Ahead = 32;

// 8 values of a cache row widened to float32, exactly.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// Lane s of the result: the sum of a[s]'s 8 lanes.
inline __m256 sum_lanes(const __m256 (&a)[8]) {
  __m256 b[4], c[2];
  for (int i = 0; i < 4; ++i) {  // 128-bit half l of b[i]: partial sums of a[2i] and a[2i+1] over that half
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {  // half l of c[i]: a[4i..4i+3] summed over half l
    const __m256d lo = _mm256_unpacklo_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]));
    const __m256d hi = _mm256_unpackhi_pd(_mm256_castps_pd(b[2 * i]), _mm256_castps_pd(b[2 * i + 1]));
    c[i] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
}

// scores [num_heads, n], as the AVX-512 pass's, 8 slots at a time; q's vectors 4 at a time in registers.
template <int HEAD, typename cache_t>
void chunked_scores(const float* q, const cache_t* keys, const int64_t* offsets, int64_t n, int64_t num_heads,
                    int64_t group, const cache_t* zeros, float* scores) {
  constexpr int kVectors = HEAD / 8;
  const int64_t row_bytes = num_heads / group * HEAD * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    const cache_t* rows[8];
    for (int s = 0; s < 8; ++s) rows[s] = s < count ? keys + offsets[j0 + s] : zeros;
    // the next 8 slots' rows, fetched while these are read, and those kL2Ahead further on into L2: a share of
    // them per head
    const int64_t next = std::min<int64_t>(8, n - j0 - 8), share = (8 + num_heads - 1) / num_heads;
    const int64_t far = std::min<int64_t>(8, n - j0 - kL2Ahead);
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int64_t s = h * share; s < std::min(next, (h + 1) * share); ++s) {
        prefetch_row(keys + offsets[j0 + 8 + s], row_bytes);
      }
      for (int64_t s = h * share; s < std::min(far, (h + 1) * share); ++s) {
        prefetch_row_l2(keys + offsets[j0 + kL2Ahead + s], row_bytes);
      }
      const int64_t kv = (h / group) * HEAD;
      __m256 dots[8];
      for (int s = 0; s < 8; ++s) dots[s] = _mm256_setzero_ps();
      for (int v0 = 0; v0 < kVectors; v0 += 4) {
        __m256 qv[4];
        for (int v = 0; v < 4; ++v) qv[v] = _mm256_loadu_ps(q + h * HEAD + 8 * (v0 + v));
        for (int s = 0; s < 8; ++s) {
          for (int v = 0; v < 4; ++v) dots[s] = _mm256_fmadd_ps(qv[v], load8(rows[s] + kv + 8 * (v0 + v)), dots[s]);
        }
      }
      alignas(32) float sums[8];
      _mm256_store_ps(sums, sum_lanes(dots));
      std::copy(sums, sums + count, scores + h * n + j0);
    }
  }
}

// acc [num_kv_heads * group, HEAD] += the n values at `offsets` weighted by p [heads, n], 8 slots at a time, a query
// head's sums 8 vectors at a time.
template <int HEAD, typename cache_t>
void chunked_values(float* acc, const cache_t* values, const int64_t* offsets, int64_t n, int64_t num_kv_heads,
                    int64_t group, const float* p) {
  constexpr int kVectors = HEAD / 8;
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t count = std::min<int64_t>(8, n - j0);
    const int64_t next = std::min<int64_t>(8, n - j0 - 8), far = std::min<int64_t>(8, n - j0 - kL2Ahead);
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      const cache_t* rows[8];
      for (int64_t s = 0; s < count; ++s) rows[s] = values + offsets[j0 + s] + kv * HEAD;
      // this KV head's values of the next 8 slots, and of those kL2Ahead further on into L2
      for (int64_t s = 0; s < next; ++s) {
        prefetch_row(values + offsets[j0 + 8 + s] + kv * HEAD, HEAD * sizeof(cache_t));
      }
      for (int64_t s = 0; s < far; ++s) {
        prefetch_row_l2(values + offsets[j0 + kL2Ahead + s] + kv * HEAD, HEAD * sizeof(cache_t));
      }
      for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
        for (int v0 = 0; v0 < kVectors; v0 += 8) {
          float* a = acc + h * HEAD + 8 * v0;
          __m256 sum[8];
          for (int v = 0; v < 8; ++v) sum[v] = _mm256_loadu_ps(a + 8 * v);
          for (int64_t s = 0; s < count; ++s) {
            const __m256 weight = _mm256_set1_ps(p[h * n + j0 + s]);
            for (int v = 0; v < 8; ++v) sum[v] = _mm256_fmadd_ps(weight, load8(rows[s] + 8 * (v0 + v)), sum[v]);
          }
          for (int v = 0; v < 8; ++v) _mm256_storeu_ps(a + 8 * v, sum[v]);
        }
      }
    }
  }
}
#endif

// Whether the chunked passes read a float16 cache (AVX2 needs F16C's conversions).
#if defined(__AVX512F__) || defined(__F16C__)
constexpr bool kHalfLoads = true;
#else
constexpr bool kHalfLoads = false;
#endif

template <typename scalar_t, typename cache_t, int HEAD>
void decode_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                   double scale, int64_t sliding_window) {
  const int64_t num_reqs = query.size(0), num_heads = query.size(1);
  const HeadSize<HEAD> head_size(query.size(2));
  const int64_t hs = head_size.value();
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t row_stride = num_kv_heads * hs;  // between consecutive slots of the cache

  // One work item per request: its cache rows ([num_kv_heads, head_size] per slot) are read front to back once,
  // block by block (no division per token). Dynamic scheduling: sequence lengths are long-tailed, so equal static
  // shares of requests are not equal work. No more threads than requests, and no parallel region at all for one.
  const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_reqs)));
  // Longest first (LPT): the threads then finish within about one short request of each other, where a long request
  // taken last kept one thread reading while the others waited at the region's end (64 requests of log-normal
  // contexts, 80-1088 tokens, two threads: attention 11.1-11.3 -> 10.9-11.0 ms per step, three alternated pairs).
  std::vector<int64_t> order(num_reqs);
  std::iota(order.begin(), order.end(), 0);
  if (num_threads > 1) {
    auto keys = [&](int64_t r) { return sliding_window > 0 ? std::min<int64_t>(lens[r], sliding_window) : lens[r]; };
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return keys(a) > keys(b); });
  }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> q(num_heads * hs), acc(num_heads * hs), scores;
    std::vector<int64_t> offsets;
    std::vector<cache_t> zeros(row_stride, cache_t(0.0f));
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_reqs; ++i) {
      const int64_t r = order[i];
      const int64_t len = lens[r];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      scores.resize(num_heads * n);
      const scalar_t* q_row = q_ptr + r * query.stride(0);  // heads contiguous within a row, rows at any stride
      for (int64_t i = 0; i < num_heads * hs; ++i) q[i] = static_cast<float>(q_row[i]) * static_cast<float>(scale);
      const int32_t* blocks = table + r * max_blocks;
      // The slots [first, len) block by block: (block's cache offset, first slot in it, slots in it, token index).
      const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(cache_t));
      auto for_each_slot = [&](const cache_t* cache, auto&& body) {
        for (int64_t t = first; t < len;) {
          const int64_t offset = t % block_size, count = std::min(block_size - offset, len - t);
          const cache_t* slot = cache + (static_cast<int64_t>(blocks[t / block_size]) * block_size + offset) * row_stride;
          // the same slot of the next block, fetched while this one is read: blocks are scattered, so the hardware
          // prefetcher's stream ends at each block's end
          const int64_t next_block = (t + count) / block_size;
          const char* ahead = t + count < len ? reinterpret_cast<const char*>(
              cache + static_cast<int64_t>(blocks[next_block]) * block_size * row_stride) : nullptr;
          for (int64_t i = 0; i < count; ++i, slot += row_stride) {
            if (ahead != nullptr) {
              for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + i * row_bytes + b);
            }
            body(slot, t - first + i);
          }
          t += count;
        }
      };
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
      // Head sizes of 64 and 128: 16 slots at a time (AVX2: 8), each head's scores summed in registers and reduced
      // together (sum_lanes), the slots' values added into sums held in registers, the next chunk's rows prefetched
      // (instead of the next block's, as for_each_slot does). One thread over four requests of 200 tokens held in
      // L2: 27-29 GB/s of float32 cache against 11.6-12.7 for the loops below (AVX2 build: 25.4-25.9 against
      // 17.1-18.6); from memory, 1.1-1.3x their rate over a bfloat16 cache and about the same over a float32 one
      // (docs/benchmarks.md, "Decode attention, 16 slots at a time").
      constexpr bool kChunked = (HEAD == 64 || HEAD == 128) && !std::is_same_v<cache_t, double> &&
                                (kHalfLoads || !std::is_same_v<cache_t, c10::Half>);
#else
      constexpr bool kChunked = false;
#endif
      if constexpr (kChunked) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        // slot j's row offset in the cache (slots [first, len) front to back, block by block)
        offsets.resize(n);
        int64_t j = 0;
        for (int64_t t = first; t < len;) {
          const int64_t offset = t % block_size, count = std::min(block_size - offset, len - t);
          const int64_t base = (static_cast<int64_t>(blocks[t / block_size]) * block_size + offset) * row_stride;
          for (int64_t i = 0; i < count; ++i) offsets[j++] = base + i * row_stride;
          t += count;
        }
        chunked_scores<HEAD>(q.data(), k_ptr, offsets.data(), n, num_heads, group, zeros.data(), scores.data());
#endif
      } else {
        for_each_slot(k_ptr, [&](const cache_t* k, int64_t j) {
          for (int64_t head = 0; head < num_heads; ++head) {
            scores[head * n + j] = dot(q.data() + head * hs, k + (head / group) * hs, head_size);
          }
        });
      }
      // The softmax's exp is exp_nonpositive (attention_common.h): glibc's vector expf, which std::exp became here,
      // hands a whole vector to its scalar routine when a lane lies below about -87, as most of a row's do where
      // scores spread over more than that. Over a 64-row decode step of `small` whose queries spread the scores by
      // about +-70 (its products' outputs, unscaled), attention took 11.1-11.6 ms with std::exp and 9.0-9.1 with
      // this; with scores within a few units of each other, 8.9-9.0 either way (docs/benchmarks.md, "Decode
      // attention's fetches spread over its work").
      for (int64_t head = 0; head < num_heads; ++head) {
        float* s = scores.data() + head * n;
        float m = std::numeric_limits<float>::lowest();
        for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < n; ++t) {
          s[t] = exp_nonpositive(s[t] - m);
          total += s[t];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t t = 0; t < n; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      if constexpr (kChunked) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
        chunked_values<HEAD>(acc.data(), v_ptr, offsets.data(), n, num_kv_heads, group, scores.data());
#endif
      } else {
        for_each_slot(v_ptr, [&](const cache_t* v, int64_t j) {
          for (int64_t head = 0; head < num_heads; ++head) {
            const float p = scores[head * n + j];
            const cache_t* v_head = v + (head / group) * hs;
            float* a = acc.data() + head * hs;
#pragma omp simd
            for (int64_t d = 0; d < head_size.value(); ++d) a[d] += p * static_cast<float>(v_head[d]);
          }
        });
      }
      scalar_t* o_row = o_ptr + r * num_heads * hs;
      for (int64_t i = 0; i < num_heads * hs; ++i) o_row[i] = convert<scalar_t, float>(acc[i]);
    }
  }
}

}  // namespace

namespace splitserve_cpu {

template <typename scalar_t, typename cache_t>
static void decode_heads(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                         double scale, int64_t sliding_window) {
  switch (query.size(2)) {
    case 64:
      decode_kernel<scalar_t, cache_t, 64>(out, query, key_cache, value_cache, block_table, seq_lens, scale,
                                           sliding_window);
      break;
    case 128:
      decode_kernel<scalar_t, cache_t, 128>(out, query, key_cache, value_cache, block_table, seq_lens, scale,
                                            sliding_window);
      break;
    default:
      decode_kernel<scalar_t, cache_t, 0>(out, query, key_cache, value_cache, block_table, seq_lens, scale,
                                          sliding_window);
  }
}

// out, query: [num_reqs, num_heads, head_size] (query's rows at any stride); key_cache, value_cache: [num_blocks,
// block_size, num_kv_heads, head_size]; block_table: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32 (>= 1); sliding_window <= 0: none.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [num_reqs, num_heads, head_size], contiguous within a row (a view of a fused projection is fine)");
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_table.is_contiguous() && block_table.scalar_type() == at::kInt, "block_table: contiguous int32");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kInt, "seq_lens: contiguous int32");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "query [num_reqs, num_heads, head_size], caches [num_blocks, block_size, num_kv_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have the query's shape");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and cache head sizes differ");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) >= query.size(0) && seq_lens.size(0) >= query.size(0),
              "block_table and seq_lens need a row per request");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              "out must have the query's dtype, and the value cache the key cache's");
  dispatch_cache_dtype(query, key_cache, [&](auto q, auto c) {
    decode_heads<decltype(q), decltype(c)>(out, query, key_cache, value_cache, block_table, seq_lens, scale,
                                           sliding_window);
  });
}

// paged_decode_attention of a decode-only batch, after storing each request's new key and value ([num_reqs,
// num_kv_heads, head_size], any row stride; in the query's dtype) in its slot_mapping slot (int64), rounded to the
// cache's dtype where it is narrower: one call per layer for what would otherwise be the KV write's index copies and
// the attention.
template <typename scalar_t, typename cache_t>
static void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                     at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t num_reqs = key.size(0), num_kv_heads = key.size(1), head_size = key.size(2);
  const int64_t row = num_kv_heads * head_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  cache_t* k_cache = key_cache.data_ptr<cache_t>();
  cache_t* v_cache = value_cache.data_ptr<cache_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      std::transform(k + r * key.stride(0) + h * key.stride(1), k + r * key.stride(0) + h * key.stride(1) + head_size,
                     k_cache + slots[r] * row + h * head_size, convert<cache_t, scalar_t>);
      std::transform(v + r * value.stride(0) + h * value.stride(1),
                     v + r * value.stride(0) + h * value.stride(1) + head_size, v_cache + slots[r] * row + h * head_size,
                     convert<cache_t, scalar_t>);
    }
  }
}

void decode_attention_with_kv_write(at::Tensor out, const at::Tensor& query, const at::Tensor& key,
                                    const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                    const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key and value: [num_reqs, num_kv_heads, head_size]");
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "key and value need a row per request and the cache's heads and head size");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key and value rows must be contiguous within a head");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key and value must have the query's dtype, and the value cache the key cache's");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.size(0) >= key.size(0),
              "slot_mapping: contiguous int64, a slot per request");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  dispatch_cache_dtype(query, key_cache, [&](auto q, auto c) {
    write_kv<decltype(q), decltype(c)>(key, value, key_cache, value_cache, slot_mapping);
  });
  paged_decode_attention(out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window);
}

}  // namespace splitserve_cpu
