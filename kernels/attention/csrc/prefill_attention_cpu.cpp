// Paged prefill attention on CPU: the query tokens of prefill chunks (a whole prompt, or a chunk after cached
// tokens: chunked prefill, prefix caching) attend causally over their request's keys and values, read in place from
// its blocks after this step's are stored. One call per layer for every prefill request of a step.
//
// The algorithm is FlashAttention's (Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention
// with IO-Awareness"; the online softmax of Milakov and Gimelshein 2018) laid out for CPU threads. A work item is a
// tile: up to kTileRows rows, each a query token and one of the query heads of one KV head (GQA: the group's heads
// share the tile's keys). It walks the keys the tile may see kChunk slots at a time, reading their rows in place (a
// float32 cache) or widened into a buffer (bfloat16, float16): the scores of every row against the chunk, the
// rows' running maxima and sums, and the chunk's values added into the rows' sums (rescaled where a maximum grew).
// The rows are the vectors' lanes (queries, scores and sums stored transposed), so the softmax's maxima, sums and
// rescaling are vector operations with no sum across lanes, and the score and value passes are register blocks of
// 4 slots or 4 head values x up to 64 rows. Scores and sums are float32 whatever the cache dtype. Tiles are shared
// out over the threads longest first (a tile's work grows with its last position), so the long prompts' last tiles
// do not finish alone.
//
// The loops are plain C++ with constant trip counts where the head size is 64 or 128 (compiled apart; any other
// size read at run time), vectorized by the compiler for the build's instruction set (AVX-512 or AVX2). Before it,
// each prefill request ran torch's scaled_dot_product_attention on its own (a gathered copy of its blocks and a mask
// where it had cached tokens): 1.6x its time for the benchmark's 64 prompts on two threads (docs/benchmarks.md,
// "Prefill attention over the paged cache").
#include "cpu_ops.h"
#include "attention_common.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
// 16 floats per vector: GCC's -march=native prefers 256-bit vectors on Intel's AVX-512 cores, which halves the
// multiply-adds per instruction of the loops below.
#pragma GCC target("prefer-vector-width=512")
#endif

namespace {

using splitserve_cpu::convert;
using splitserve_cpu::exp_nonpositive;
using splitserve_cpu::HeadSize;

// Query rows per vector of the passes below: a tile's rows are the lanes, so the online softmax's maxima, sums and
// rescaling are vector operations over 16 rows, with no sum across lanes.
constexpr int64_t kLanes = 16;
// Query rows per tile, at most (tokens x the query heads of one KV head): four vectors of rows.
constexpr int64_t kTileRows = 4 * kLanes;
// Slots per chunk of keys.
constexpr int64_t kChunk = 32;
// Register blocks: 4 slots (scores) or 4 values of the head (value sums) x up to 4 vectors of rows, 16 sums.
constexpr int64_t kBlock = 4;
// A score that masks its key out: finite, since the file is built with -ffast-math (no infinities), and far below
// any real score.
constexpr float kMasked = -1.0e30f;

// A tile of one request's query tokens [token0, token0 + num_tokens), each with the query heads [head0, head0 +
// num_heads) of KV head kv_head (heads counted within its group).
struct Tile {
  int64_t request, kv_head, token0, num_tokens, head0, num_heads;
  int64_t cost;  // keys it may see times its rows, for the longest-first order
};

// A tile's buffers, rows as the lanes (the rows past the tile's zeros): queries q_t [head_size, kTileRows], value
// sums acc_t [head_size, kTileRows], a chunk's scores and then weights p_t [kChunk, kTileRows], the running maxima
// and sums and the chunk's rescaling [kTileRows], each row's position [kTileRows], and the chunk's values widened to
// float32 [kChunk, head_size] (a cache narrower than float32).
struct TileBuffers {
  std::vector<float> q_t, acc_t, p_t, row_max, row_sum, rescale, widened;
  std::vector<int64_t> position;
  explicit TileBuffers(int64_t head_size)
      : q_t(head_size * kTileRows), acc_t(head_size * kTileRows), p_t(kChunk * kTileRows), row_max(kTileRows),
        row_sum(kTileRows), rescale(kTileRows), widened(kChunk * head_size), position(kTileRows) {}
};

// p_t[s][r] = q_t[:, r] . keys[s] for the chunk's slots s (rows kVecs vectors of lanes; `keys[s]` a row of head_size
// floats, a row of zeros past the chunk's slots).
template <int kVecs, typename Head>
void chunk_scores(const float* q_t, const float* const* keys, float* p_t, Head head) {
  constexpr int64_t kRows = kVecs * kLanes;
  for (int64_t s0 = 0; s0 < kChunk; s0 += kBlock) {
    float sums[kBlock][kRows] = {};
    for (int64_t d = 0; d < head.value(); ++d) {
      const float* q = q_t + d * kTileRows;
      for (int64_t b = 0; b < kBlock; ++b) {
        const float k = keys[s0 + b][d];
#pragma omp simd
        for (int64_t r = 0; r < kRows; ++r) sums[b][r] += k * q[r];
      }
    }
    for (int64_t b = 0; b < kBlock; ++b) std::copy(sums[b], sums[b] + kRows, p_t + (s0 + b) * kTileRows);
  }
}

// acc_t[d][r] = acc_t[d][r] * rescale[r] + sum_s p_t[s][r] values[s][d], over the chunk's `count` slots.
template <int kVecs, typename Head>
void chunk_values(float* acc_t, const float* rescale, const float* p_t, const float* const* values, int64_t count,
                  Head head) {
  constexpr int64_t kRows = kVecs * kLanes;
  const int64_t hs = head.value();
  for (int64_t d0 = 0; d0 < hs; d0 += kBlock) {
    const int64_t width = std::min(kBlock, hs - d0);
    float sums[kBlock][kRows];
    for (int64_t b = 0; b < kBlock; ++b) {
      const float* a = acc_t + std::min(d0 + b, hs - 1) * kTileRows;
#pragma omp simd
      for (int64_t r = 0; r < kRows; ++r) sums[b][r] = a[r] * rescale[r];
    }
    for (int64_t s = 0; s < count; ++s) {
      const float* p = p_t + s * kTileRows;
      for (int64_t b = 0; b < kBlock; ++b) {
        const float v = values[s][std::min(d0 + b, hs - 1)];
#pragma omp simd
        for (int64_t r = 0; r < kRows; ++r) sums[b][r] += v * p[r];
      }
    }
    for (int64_t b = 0; b < width; ++b) std::copy(sums[b], sums[b] + kRows, acc_t + (d0 + b) * kTileRows);
  }
}

// The online softmax over a chunk of keys [k0, k0 + count) for rows [0, num_rows) (a multiple of kLanes): scores
// masked (causal, the window, the chunk's end; not where the whole chunk is visible to every row), new maxima, the
// old sums' rescaling, the scores turned into weights in place. Kept out of inlining and cloning, so the row count
// stays a run-time value: given the callers' constants, GCC unrolled the loops over rows completely and left the
// straight code unvectorized (the softmax then took most of the kernel's time).
[[gnu::noipa]] void chunk_softmax(TileBuffers& buf, int64_t num_rows, int64_t k0, int64_t count, bool whole,
                                  int64_t sliding_window) {
  float* p_t = buf.p_t.data();
  if (!whole) {
    const int64_t* pos = buf.position.data();
    for (int64_t s = 0; s < kChunk; ++s) {
      const int64_t key = k0 + s;
      float* p = p_t + s * kTileRows;
#pragma omp simd
      for (int64_t r = 0; r < num_rows; ++r) {
        const bool seen = s < count && key <= pos[r] && (sliding_window <= 0 || key > pos[r] - sliding_window);
        p[r] = seen ? p[r] : kMasked;
      }
    }
  }
  float m[kTileRows];
  std::copy(buf.row_max.data(), buf.row_max.data() + num_rows, m);
  for (int64_t s = 0; s < kChunk; ++s) {
    const float* p = p_t + s * kTileRows;
#pragma omp simd
    for (int64_t r = 0; r < num_rows; ++r) m[r] = std::max(m[r], p[r]);
  }
  float total[kTileRows] = {};
  for (int64_t s = 0; s < kChunk; ++s) {
    float* p = p_t + s * kTileRows;
#pragma omp simd
    for (int64_t r = 0; r < num_rows; ++r) {
      const float e = exp_nonpositive(p[r] - m[r]);
      p[r] = p[r] > 0.5f * kMasked ? e : 0.0f;  // masked keys, and rows that saw none yet: 0
      total[r] += p[r];
    }
  }
#pragma omp simd
  for (int64_t r = 0; r < num_rows; ++r) {
    // ~0 for a row's first keys (its maximum was kMasked; its sums are 0); 1 for a row that has seen none yet
    buf.rescale[r] = exp_nonpositive(buf.row_max[r] - m[r]);
    buf.row_sum[r] = buf.row_sum[r] * buf.rescale[r] + total[r];
    buf.row_max[r] = m[r];
  }
}

// A tile's walk over the keys it may see, its rows kVecs vectors of lanes.
template <int kVecs, typename cache_t, typename Head>
void walk_tile(TileBuffers& buf, const Tile& tile, const cache_t* k_ptr, const cache_t* v_ptr, const int32_t* blocks,
               int64_t block_size, int64_t row_stride, int64_t first_pos, int64_t last_pos, int64_t sliding_window,
               const float* zeros, Head head) {
  constexpr int64_t kRows = kVecs * kLanes;
  const int64_t hs = head.value();
  std::fill(buf.acc_t.begin(), buf.acc_t.end(), 0.0f);
  std::fill(buf.row_max.begin(), buf.row_max.end(), kMasked);
  std::fill(buf.row_sum.begin(), buf.row_sum.end(), 0.0f);
  const float* keys[kChunk];
  const float* values[kChunk];
  // keys [lo, hi): from where the first token's window starts through the last token
  const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, first_pos - sliding_window + 1) : 0;
  const int64_t hi = last_pos + 1;
  for (int64_t k0 = lo; k0 < hi; k0 += kChunk) {
    const int64_t count = std::min(kChunk, hi - k0);
    for (int64_t s = 0; s < kChunk; ++s) {
      if (s >= count) {
        keys[s] = values[s] = zeros;
        continue;
      }
      const int64_t t = k0 + s;
      const int64_t offset =
          (static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size) * row_stride +
          tile.kv_head * hs;
      if constexpr (std::is_same_v<cache_t, float>) {  // read in place
        keys[s] = k_ptr + offset;
        values[s] = v_ptr + offset;
      } else {  // widened into the buffer: the keys' rows, then (after the scores) the values'
        float* k = buf.widened.data() + s * hs;
        for (int64_t d = 0; d < hs; ++d) k[d] = static_cast<float>(k_ptr[offset + d]);
        keys[s] = k;
      }
    }
    chunk_scores<kVecs>(buf.q_t.data(), keys, buf.p_t.data(), head);
    if constexpr (!std::is_same_v<cache_t, float>) {
      for (int64_t s = 0; s < count; ++s) {
        const int64_t t = k0 + s;
        const int64_t offset =
            (static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size) * row_stride +
            tile.kv_head * hs;
        float* v = buf.widened.data() + s * hs;
        for (int64_t d = 0; d < hs; ++d) v[d] = static_cast<float>(v_ptr[offset + d]);
        values[s] = v;
      }
    }
    const bool whole = count == kChunk && k0 + kChunk - 1 <= first_pos &&
                       (sliding_window <= 0 || k0 > last_pos - sliding_window);
    chunk_softmax(buf, kRows, k0, count, whole, sliding_window);
    chunk_values<kVecs>(buf.acc_t.data(), buf.rescale.data(), buf.p_t.data(), values, count, head);
  }
}

template <typename scalar_t, typename cache_t, int HEAD>
void prefill_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                    const at::Tensor& query_start_loc, int64_t first_request, double scale, int64_t sliding_window) {
  const int64_t num_reqs = seq_lens.size(0), num_heads = query.size(1);
  const HeadSize<HEAD> head(query.size(2));
  const int64_t hs = head.value();
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const int64_t row_stride = num_kv_heads * hs;  // between consecutive slots of the cache
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  const int64_t q_row_stride = query.stride(0);
  // a tile: tokens x the group's heads up to kTileRows rows; a group larger than that, one token x part of it
  const int64_t tile_heads = std::min(group, kTileRows), tile_tokens = std::max<int64_t>(1, kTileRows / group);

  std::vector<Tile> tiles;
  for (int64_t r = first_request; r < num_reqs; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r], num_context = lens[r] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
      const int64_t n = std::min(tile_tokens, q_len - t0);
      const int64_t last = num_context + t0 + n;  // keys the tile's last token sees, without a window
      const int64_t seen = sliding_window > 0 ? std::min(last, sliding_window + n - 1) : last;
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
        for (int64_t h0 = 0; h0 < group; h0 += tile_heads) {
          const int64_t nh = std::min(tile_heads, group - h0);
          tiles.push_back({r, kv, t0, n, h0, nh, seen * n * nh});
        }
      }
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tiles)));

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    TileBuffers buf(hs);
    const std::vector<float> zeros(hs, 0.0f);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_tiles; ++i) {
      const Tile& tile = tiles[i];
      const int64_t q_len = starts[tile.request + 1] - starts[tile.request];
      const int64_t first_pos = lens[tile.request] - q_len + tile.token0;
      const int64_t last_pos = first_pos + tile.num_tokens - 1;
      const int64_t rows = tile.num_tokens * tile.num_heads;
      const int64_t first_row = starts[tile.request] + tile.token0;  // the tile's first token's row of query, out
      // row r: token r / num_heads, query head kv_head * group + head0 + r % num_heads; scaled, transposed
      std::fill(buf.q_t.begin(), buf.q_t.end(), 0.0f);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t token = std::min(r, rows - 1) / tile.num_heads;
        buf.position[r] = first_pos + token;
        if (r >= rows) continue;
        const scalar_t* src = q_ptr + (first_row + token) * q_row_stride +
                              (tile.kv_head * group + tile.head0 + r % tile.num_heads) * hs;
        for (int64_t d = 0; d < hs; ++d) {
          buf.q_t[d * kTileRows + r] = static_cast<float>(src[d]) * static_cast<float>(scale);
        }
      }
      const int32_t* blocks = table + tile.request * max_blocks;
      switch ((rows + kLanes - 1) / kLanes) {
        case 1:
          walk_tile<1>(buf, tile, k_ptr, v_ptr, blocks, block_size, row_stride, first_pos, last_pos, sliding_window,
                       zeros.data(), head);
          break;
        case 2:
          walk_tile<2>(buf, tile, k_ptr, v_ptr, blocks, block_size, row_stride, first_pos, last_pos, sliding_window,
                       zeros.data(), head);
          break;
        case 3:
          walk_tile<3>(buf, tile, k_ptr, v_ptr, blocks, block_size, row_stride, first_pos, last_pos, sliding_window,
                       zeros.data(), head);
          break;
        default:
          walk_tile<4>(buf, tile, k_ptr, v_ptr, blocks, block_size, row_stride, first_pos, last_pos, sliding_window,
                       zeros.data(), head);
      }
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* dst = o_ptr + ((first_row + r / tile.num_heads) * num_heads + tile.kv_head * group + tile.head0 +
                                 r % tile.num_heads) * hs;
        const float inv = 1.0f / buf.row_sum[r];
        for (int64_t d = 0; d < hs; ++d) dst[d] = convert<scalar_t, float>(buf.acc_t[d * kTileRows + r] * inv);
      }
    }
  }
}

}  // namespace

namespace splitserve_cpu {

// out: [num_tokens, num_heads, head_size], contiguous (rows of the prefill requests written, the others left);
// query: the same shape, rows at any stride (heads contiguous); key_cache, value_cache: [num_blocks, block_size,
// num_kv_heads, head_size]; block_table: [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32;
// query_start_loc: [num_reqs + 1] int32; requests [first_request, num_reqs) attend; sliding_window <= 0: none.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t first_request, double scale,
                             int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query: [num_tokens, num_heads, head_size], contiguous within a row (a view of a fused projection is "
              "fine)");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "out: contiguous, the query's shape and dtype");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && value_cache.scalar_type() == key_cache.scalar_type(),
              "caches: contiguous [num_blocks, block_size, num_kv_heads, head_size], one dtype");
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "query and cache head sizes differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t num_reqs = seq_lens.dim() == 1 ? seq_lens.size(0) : -1;
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kInt && num_reqs >= 0,
              "seq_lens: contiguous int32 [num_reqs]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.is_contiguous() && block_table.scalar_type() == at::kInt &&
                  block_table.size(0) >= num_reqs,
              "block_table: contiguous int32 [num_reqs, max_blocks]");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
                  query_start_loc.scalar_type() == at::kInt && query_start_loc.size(0) >= num_reqs + 1,
              "query_start_loc: contiguous int32 [num_reqs + 1]");
  TORCH_CHECK(first_request >= 0 && first_request <= num_reqs, "first_request must lie in [0, num_reqs]");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t max_slots = block_table.size(1) * key_cache.size(1);
  TORCH_CHECK(starts[first_request] >= 0 && starts[num_reqs] <= query.size(0),
              "query_start_loc runs outside the query's ", query.size(0), " rows");
  for (int64_t r = first_request; r < num_reqs; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    TORCH_CHECK(q_len >= 0 && lens[r] >= q_len && lens[r] <= max_slots, "request ", r, ": ", q_len,
                " query tokens, seq_len ", lens[r], " (at most ", max_slots, " slots in its block table row)");
  }
  dispatch_cache_dtype(query, key_cache, [&](auto q, auto c) {
    using scalar_t = decltype(q);
    using cache_t = decltype(c);
    switch (query.size(2)) {
      case 64:
        prefill_kernel<scalar_t, cache_t, 64>(out, query, key_cache, value_cache, block_table, seq_lens,
                                              query_start_loc, first_request, scale, sliding_window);
        break;
      case 128:
        prefill_kernel<scalar_t, cache_t, 128>(out, query, key_cache, value_cache, block_table, seq_lens,
                                               query_start_loc, first_request, scale, sliding_window);
        break;
      default:
        prefill_kernel<scalar_t, cache_t, 0>(out, query, key_cache, value_cache, block_table, seq_lens,
                                             query_start_loc, first_request, scale, sliding_window);
    }
  });
}

}  // namespace splitserve_cpu
