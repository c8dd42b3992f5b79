// float32 matrix products of batch and prefill rows over the weight laid out in panels: out [M, N] = x [M, K] @ w.T
// (+ bias), w given as panels [ceil(N / 32), K, 32] (panels[p, k, j] = w[32 p + j, k], the last panel's missing
// features zero; core_svc/models/layers.py's pack_panels), float32 sums.
//
// Why: a decode batch's rows are too few for MKL's sgemm over the column-major weight (float32's batch layout
// before this kernel) or oneDNN's product over its packed one to hide the wait for a weight that the attention
// between products has pushed out of the caches. Over small's 33 weight matrices (python -m benchmarks.gemv,
// docs/benchmarks.md, "float32 products over weight panels"; one thread, routes interleaved), this kernel took
// 0.63-0.72x the column-major route's time at 16 rows, 0.89-1.01x at 64, 0.90-0.98x at 256 and about the same at
// one row, and over the projections at a 1458-row prefill chunk 0.95-1.14x (the machine's phase moved these); on
// the 32,000-wide LM head alone, against oneDNN's packed product, 0.65-0.85x from 2 rows up and 0.85-0.95x at one
// (measured with one-panel blocks). Whole float32 runs of bench throughput (64 requests, prefill about half the
// products' work) alternating with the column-major layout came out within the spread between runs.
//
// How (the register-blocked micro-kernel of Goto and van de Geijn, "Anatomy of High-Performance Matrix
// Multiplication", ACM TOMS 34(3), 2008, and of BLIS): a panel's 32 output features are two 16-float vectors, and a
// block of up to kRowBlock rows of x keeps the sums of two panels (4 x kRowBlock vectors) in registers while it
// walks k: per k, four vector loads of the panels and, for each row, one broadcast of x and four fused
// multiply-adds (an odd last panel alone: two). Panels are walked in pairs, kDepth values of k at a time (the
// pair's 32 KiB slice stays in L1 while every row block of the chunk passes over it). A thread's panels are one
// contiguous stream (K x 128 bytes each), read in order: its first slices are prefetched into L2 before the walk,
// and each next pair of slices while the pair before it is multiplied, their cache lines spread over the row
// blocks' walks; with each block, the lines of out that the next block's first slice stores, and in a walk's first
// pair the rows of x it reads, are fetched too. Rows are walked kRowChunk at a time (fewer where K is large), so the
// rows of x a panel meets stay in L2. One to four rows (multiply_few_rows) are a pass bounded by the memory:
// several panels are walked side by side instead. Threads share out panels (kShareMultiplyAdds each at least).
//
// Every output is one sum over k in order (an FMA chain; partial sums stored and reloaded between slices of k
// unchanged), so a row's result does not depend on the other rows, on how rows were blocked, or on the thread
// count; it differs from MKL's and oneDNN's in the summation order only (rounding: about 1e-7 relative). Needs
// AVX-512F, or AVX2 with FMA (panel_linear_available()).
//
// AVX2 (the second section below): the same panels and the same sums, bit for bit, in 8-float vectors. Register
// blocks are 6 rows x half a panel (12 of the 16 registers hold sums), and the next slice of the weight is
// prefetched into L2 across a slice's blocks; one or two rows walk whole panels, three side by side for one row.
// Over small's 33 matrices on a 2-vCPU AMD Zen 3 (python -m benchmarks.gemv, one thread) it took 0.54-0.60x the time
// of oneDNN's packed layout at one to four rows and 0.8x at 64, and 0.4-0.9x the column-major layout's at one to
// four rows and 0.6x at 64 (docs/benchmarks.md, "float32 panels on AVX2").
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// Sums in the order written (only the attention kernel builds with -ffast-math; this keeps it so if that changes).
#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math", "no-finite-math-only")

namespace {

constexpr int64_t kPanel = 32;  // output features per panel: two AVX-512 vectors of float32
// Rows per register block: 6 rows x 4 vectors (two panels) of sums and the panels' four vectors take 28 of the 32
// vector registers. Over a weight held in L2 (512 x 512, 252 rows) this block ran at 1.1-1.4x the rate of one of 14
// rows x one panel (2 x 14 sums), which had run at 0.84-0.93x MKL's: per multiply-add it loads 0.42 values where
// that one loaded 0.57.
constexpr int kRowBlock = 6;
// k per walk of a pair of panels: their 2 x 128 x 32 floats (32 KiB) stay in L1 (48 KiB on the machines measured)
// while the row blocks pass over them.
constexpr int64_t kDepth = 128;
// Rows of x per walk over the weight, at most (the rows split into walks as even as they can be); fewer where K is
// large, so the chunk (rows x K floats) stays within kChunkBytes of L2 (2 MiB per core on the machines measured): a
// panel meets every row of the chunk. Walks of 28, 64 and 128 rows were measured too (small's projections at
// 512 and 1458 rows, prefill chunks): none clearly ahead of 256 alone, and 64 no better in the engine.
constexpr int64_t kRowChunk = 256;
constexpr int64_t kChunkBytes = int64_t{1} << 20;
// Multiply-adds per parallel work share, at least: a product of at most one share runs on the calling thread, where
// a parallel region costs more (fork, barrier) than it saves.
constexpr int64_t kShareMultiplyAdds = int64_t{4} << 20;

// Register blocks of a chunk's rows, as even as they can be: `count` blocks of `base` or `base + 1` rows (64 rows:
// nine of 6, two of 5), block b of rows(b).
struct RowBlocks {
  int64_t count, base, longer;
  explicit RowBlocks(int64_t rows)
      : count((rows + kRowBlock - 1) / kRowBlock), base(rows / count), longer(rows % count) {}
  int rows(int64_t b) const { return static_cast<int>(base + (b < longer)); }
};

#if defined(__AVX512F__) || defined(__AVX2__)
// The 64-byte lines of `rows` rows (each `stride` floats after the one before) of `count` floats from `first`,
// fetched with `kHint` (_MM_HINT_ET0: to be written).
//
// The empty asm statement is an effect that keeps the fetches: GCC 12 found a function that does nothing but fetch,
// in loops it can bound, to have no effect at all (const), and deleted the calls to it before inlining them. The
// products stayed right and the fetches were gone (tests/test_kernel_registers.py checks the machine code for the
// fetches to write).
template <int kHint>
inline void prefetch_rows(const float* first, int rows, int64_t stride, int64_t count) {
  for (int i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < count; c += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(first + i * stride + c), static_cast<_mm_hint>(kHint));
      asm volatile("");
    }
  }
}

// A register block of a walk: rows [row, row + rows) of x, `count` panels from panel p, the slice of k from k0.
struct Block {
  int64_t row;
  int rows;
  int64_t p, count, k0;
};

// What the walk's `next` block touches first, fetched while the block before it multiplies: the lines of out that
// its first slice of k stores without reading them (a store to a line not in the cache waits for the line's read),
// and, in the walk's first panels (from `walk_begin`), the lines of x it reads (nothing has brought them in yet;
// later panels find them in L2). Over small's projections at 2048 rows (a prefill chunk), two threads, the products
// ran 5-18% faster with these fetches (docs/benchmarks.md, "Prefill products fetch what each block touches first").
inline void fetch_first_touches(const float* x, float* out, int64_t n, int64_t k, int64_t walk_begin,
                                Block next) {
  if (next.k0 == 0) {
    prefetch_rows<_MM_HINT_ET0>(out + next.row * n + next.p * kPanel, next.rows, n, next.count * kPanel);
  }
  if (next.p == walk_begin) {
    prefetch_rows<_MM_HINT_T0>(x + next.row * k + next.k0, next.rows, k, std::min(kDepth, k - next.k0));
  }
}
#endif

#if defined(__AVX512F__)
// Which of the 16 output columns from `feature0` on exist (of n).
inline __mmask16 column_mask(int64_t n, int64_t feature0) {
  const int64_t valid = std::clamp<int64_t>(n - feature0, 0, 16);
  return static_cast<__mmask16>(valid == 16 ? 0xffff : (1u << valid) - 1);
}

// A slice of `depth` values of k of the weight to prefetch, as two ranges of 64-byte lines (the slices of two
// panels lie a panel apart): `first_count` lines from `first`, then `second_count` from `second`.
struct PrefetchLines {
  const float* first = nullptr;
  int64_t first_count = 0;
  const float* second = nullptr;
  int64_t second_count = 0;
  int64_t count() const { return first_count + second_count; }
  const float* line(int64_t i) const { return i < first_count ? first + i * 16 : second + (i - first_count) * 16; }
};

// Sums of rows [0, kRows) of x (rows at stride k_stride) with a slice of `depth` values of k of kPanels adjacent
// panels (each `panel_stride` floats after the one before), into out's 32 x kPanels columns (rows at stride n):
// stored, or added to what is there (`accumulate`, the slices after the first), plus the bias after the last slice
// (`bias` non-null, its columns). `masks[v]`: which of vector v's 16 columns exist. Meanwhile the `prefetch`
// lines are brought into L2, spread evenly over the walk.
//
// Never inlined: inlined into multiply_panels, GCC 12 kept 23 of the 24 sums on the stack (a load and a store per
// multiply-add), and 64 rows of small's down projection ran at 48-57 GFLOP/s instead of 78-126 on a Sapphire Rapids
// core (docs/benchmarks.md, "Register blocks kept in registers"). A call per block and slice costs nothing beside it.
template <int kRows, int kPanels>
[[gnu::noinline]] void multiply_block(const float* x, int64_t k_stride, const float* panel, int64_t panel_stride,
                                      int64_t depth, float* out, int64_t n, bool accumulate, const float* bias,
                                      const __mmask16* masks, const PrefetchLines& prefetch) {
  constexpr int kVectors = 2 * kPanels;
  __m512 sum[kRows][kVectors];
  for (int i = 0; i < kRows; ++i) {
    for (int v = 0; v < kVectors; ++v) {
      sum[i][v] = accumulate ? _mm512_maskz_loadu_ps(masks[v], out + i * n + 16 * v) : _mm512_setzero_ps();
    }
  }
  // `per_step` lines every `every` steps of k
  const int64_t lines = prefetch.count();
  const int64_t per_step = (lines + depth - 1) / depth;
  const int64_t every = per_step > 0 ? std::max<int64_t>(1, depth * per_step / lines) : depth;
  int64_t line = 0, countdown = 0;
  for (int64_t k = 0; k < depth; ++k) {
    __m512 w[kVectors];
    for (int q = 0; q < kPanels; ++q) {
      w[2 * q] = _mm512_loadu_ps(panel + q * panel_stride + k * kPanel);
      w[2 * q + 1] = _mm512_loadu_ps(panel + q * panel_stride + k * kPanel + 16);
    }
    if (--countdown <= 0) {
      countdown = every;
      for (int64_t j = 0; j < per_step && line < lines; ++j, ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch.line(line)), _MM_HINT_T1);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * k_stride + k]);
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) sum[i][v] = _mm512_fmadd_ps(xi, w[v], sum[i][v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(masks[v], bias + 16 * v);
    for (int i = 0; i < kRows; ++i) {
      _mm512_mask_storeu_ps(out + i * n + 16 * v, masks[v], bias == nullptr ? sum[i][v] : _mm512_add_ps(sum[i][v], b));
    }
  }
}

// multiply_block<rows, kPanels> for a row count known only at run time (1 to kRowBlock).
template <int kPanels, int kRows = kRowBlock>
void multiply_rows(int rows, const float* x, int64_t k_stride, const float* panel, int64_t panel_stride,
                   int64_t depth, float* out, int64_t n, bool accumulate, const float* bias, const __mmask16* masks,
                   const PrefetchLines& prefetch) {
  if constexpr (kRows > 0) {
    if (rows == kRows) {
      multiply_block<kRows, kPanels>(x, k_stride, panel, panel_stride, depth, out, n, accumulate, bias, masks,
                                     prefetch);
    } else {
      multiply_rows<kPanels, kRows - 1>(rows, x, k_stride, panel, panel_stride, depth, out, n, accumulate, bias,
                                        masks, prefetch);
    }
  }
}

// One to four rows (a request or a few decoding alone): the pass is bounded by the memory, not by the multiply-adds,
// so kStreams panels are walked side by side (more independent loads in flight), each k step loading a 128-byte row
// of each and prefetching the first 64-byte line of the row kStreamAhead floats (64 steps of k) further on into L1
// (the measured form; the second line is left to the hardware's adjacent-line prefetch). At one row a panel at a
// time ran small's projections at 0.84-0.92x MKL's rate over the column-major weight, four side by side at
// 0.97-1.04x; two at two to four rows were level with or ahead of the register-blocked walk.
constexpr int64_t kStreamAhead = 64 * kPanel;
template <int kRows, int kStreams>
void multiply_few_rows(const float* x, const float* panels, const float* bias, float* out, int64_t n, int64_t k,
                       int64_t begin, int64_t end) {
  int64_t p = begin;
  for (; p + kStreams <= end; p += kStreams) {
    __m512 sum[kRows][2 * kStreams];
    for (int i = 0; i < kRows; ++i)
      for (int u = 0; u < 2 * kStreams; ++u) sum[i][u] = _mm512_setzero_ps();
    const float* panel = panels + p * k * kPanel;
    for (int64_t kk = 0; kk < k; ++kk) {
      __m512 w[2 * kStreams];
#pragma GCC unroll 8
      for (int u = 0; u < kStreams; ++u) {
        const float* at = panel + u * k * kPanel + kk * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(at + kStreamAhead), _MM_HINT_T0);
        w[2 * u] = _mm512_loadu_ps(at);
        w[2 * u + 1] = _mm512_loadu_ps(at + 16);
      }
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        const __m512 xi = _mm512_set1_ps(x[i * k + kk]);
#pragma GCC unroll 8
        for (int u = 0; u < 2 * kStreams; ++u) sum[i][u] = _mm512_fmadd_ps(xi, w[u], sum[i][u]);
      }
    }
    for (int u = 0; u < kStreams; ++u) {
      const int64_t f0 = (p + u) * kPanel;
      const __mmask16 m0 = column_mask(n, f0), m1 = column_mask(n, f0 + 16);
      const __m512 b0 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, bias + f0);
      const __m512 b1 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, bias + f0 + 16);
      for (int i = 0; i < kRows; ++i) {  // as multiply_block stores: the bias added only where there is one
        _mm512_mask_storeu_ps(out + i * n + f0, m0, bias == nullptr ? sum[i][2 * u] : _mm512_add_ps(sum[i][2 * u], b0));
        _mm512_mask_storeu_ps(out + i * n + f0 + 16, m1,
                              bias == nullptr ? sum[i][2 * u + 1] : _mm512_add_ps(sum[i][2 * u + 1], b1));
      }
    }
  }
  if constexpr (kStreams > 1) {
    if (p < end) multiply_few_rows<kRows, 1>(x, panels, bias, out, n, k, p, end);
  }
}

// Panels [begin, end) for `rows` rows of x (from x, into out).
void multiply_panels(const float* x, const float* panels, const float* bias, float* out, int64_t rows, int64_t n,
                     int64_t k, int64_t begin, int64_t end) {
  switch (rows) {
    case 1:
      return multiply_few_rows<1, 4>(x, panels, bias, out, n, k, begin, end);
    case 2:
      return multiply_few_rows<2, 2>(x, panels, bias, out, n, k, begin, end);
    case 3:
      return multiply_few_rows<3, 2>(x, panels, bias, out, n, k, begin, end);
    case 4:
      return multiply_few_rows<4, 2>(x, panels, bias, out, n, k, begin, end);
    default:
      break;
  }
  const RowBlocks blocks(rows);
  // The walk reads panels [begin, end) two at a time, a slice (up to kDepth values of k) of both at once: the first
  // slices are brought into L2 before it starts, each later pair while the pair before it is multiplied.
  const int64_t panel_stride = k * kPanel;
  for (int64_t q = begin; q < std::min(end, begin + 2); ++q) {
    const float* first = panels + q * panel_stride;
    for (const float* line = first; line < first + std::min(kDepth, k) * kPanel; line += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
    }
  }
  for (int64_t p = begin; p < end; p += 2) {
    const int64_t count_here = std::min<int64_t>(2, end - p);
    const int64_t feature0 = p * kPanel;
    __mmask16 masks[4];
    for (int v = 0; v < 4; ++v) masks[v] = column_mask(n, feature0 + 16 * v);
    const float* panel = panels + p * panel_stride;
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, k - k0);
      const bool last = k0 + depth == k;
      // the next slices in the walk: these panels' next ones, or the next pair's first; a share per row block
      const int64_t next_p = last ? p + 2 : p, next_k0 = last ? 0 : k0 + depth;
      const int64_t next_count = std::clamp<int64_t>(end - next_p, 0, 2);
      const int64_t per_panel = 2 * std::min(kDepth, k - next_k0);  // lines of one panel's slice
      const float* next = panels + next_p * panel_stride + next_k0 * kPanel;
      const int64_t lines = next_count * per_panel;
      const int64_t share = (lines + blocks.count - 1) / blocks.count;
      int64_t row = 0;
      for (int64_t b = 0; b < blocks.count; ++b) {
        const int block_rows = blocks.rows(b);
        const int64_t from = std::min(lines, b * share), to = std::min(lines, from + share);
        PrefetchLines prefetch;
        if (from < per_panel) {
          prefetch.first = next + from * 16;
          prefetch.first_count = std::min(to, per_panel) - from;
        }
        if (to > per_panel) {
          const int64_t second_from = std::max(from, per_panel) - per_panel;
          prefetch.second = next + panel_stride + second_from * 16;
          prefetch.second_count = to - per_panel - second_from;
        }
        // the walk's next block: this slice's next rows, else the first rows of the next slice or pair
        const bool more_rows = b + 1 < blocks.count;
        const int64_t next_block_p = more_rows ? p : next_p;
        fetch_first_touches(x, out, n, k, begin,
                            {more_rows ? row + block_rows : 0, blocks.rows(more_rows ? b + 1 : 0), next_block_p,
                             std::clamp<int64_t>(end - next_block_p, 0, 2), more_rows ? k0 : next_k0});
        const float* block_x = x + row * k + k0;
        float* block_out = out + row * n + feature0;
        const float* block_bias = last && bias != nullptr ? bias + feature0 : nullptr;
        if (count_here == 2) {
          multiply_rows<2>(block_rows, block_x, k, panel + k0 * kPanel, panel_stride, depth, block_out, n, k0 > 0,
                           block_bias, masks, prefetch);
        } else {
          multiply_rows<1>(block_rows, block_x, k, panel + k0 * kPanel, panel_stride, depth, block_out, n, k0 > 0,
                           block_bias, masks, prefetch);
        }
        row += block_rows;
      }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (8 floats per vector, 16 vector registers): the same walks with narrower blocks, each output the same FMA
// chain over k in order, so the same values bit for bit as the AVX-512 passes'.

// Which of the 8 output columns from `feature0` on exist (of n), as vmaskmovps takes them.
inline __m256i column_mask(int64_t n, int64_t feature0) {
  const int valid = static_cast<int>(std::clamp<int64_t>(n - feature0, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 columns of out (or the bias) loaded and stored, only those in `mask` where not all exist (`full`): masked moves
// take several times a plain one's time on AMD Zen cores.
inline __m256 load_columns(const float* p, bool full, __m256i mask) {
  return full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
}
inline void store_columns(float* p, bool full, __m256i mask, __m256 value) {
  if (full) {
    _mm256_storeu_ps(p, value);
  } else {
    _mm256_maskstore_ps(p, mask, value);
  }
}

// Sums of rows [0, kRows) of x (rows at stride k_stride) with `depth` values of k of half a panel (its 16 columns
// from `panel`, a panel row kPanel floats long), into out's 16 columns (rows at stride n): stored, or added to what
// is there (`accumulate`), plus the bias after the last slice (`bias` non-null). 6 rows x 2 vectors of sums, the
// two weight vectors and a broadcast take 15 of the 16 registers. `masks[v]`: which of vector v's columns exist
// (all: `full`). Meanwhile `prefetch_lines` 64-byte lines from `prefetch` are brought into L2, one per step of k
// (those past `depth`, where a short last slice precedes a full one, before the walk). Never inlined, as the
// AVX-512 block above, and every loop over the sums unrolled: out of line with those loops rolled, GCC 12 stored
// all 12 sums on every step of k.
template <int kRows>
[[gnu::noinline]] void multiply_block(const float* x, int64_t k_stride, const float* panel, int64_t depth, float* out,
                                      int64_t n, bool accumulate, const float* bias, const __m256i* masks, bool full,
                                      const char* prefetch, int64_t prefetch_lines) {
  __m256 sum[kRows][2];
#pragma GCC unroll 8
  for (int i = 0; i < kRows; ++i) {
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      sum[i][v] = accumulate ? load_columns(out + i * n + 8 * v, full, masks[v]) : _mm256_setzero_ps();
    }
  }
  for (int64_t line = depth; line < prefetch_lines; ++line) _mm_prefetch(prefetch + 64 * line, _MM_HINT_T1);
  for (int64_t k = 0; k < depth; ++k) {
    if (k < prefetch_lines) _mm_prefetch(prefetch + 64 * k, _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel), w1 = _mm256_loadu_ps(panel + k * kPanel + 8);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      const __m256 xi = _mm256_broadcast_ss(x + i * k_stride + k);
      sum[i][0] = _mm256_fmadd_ps(xi, w0, sum[i][0]);
      sum[i][1] = _mm256_fmadd_ps(xi, w1, sum[i][1]);
    }
  }
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const __m256 b = bias == nullptr ? _mm256_setzero_ps() : load_columns(bias + 8 * v, full, masks[v]);
#pragma GCC unroll 8
    for (int i = 0; i < kRows; ++i) {
      store_columns(out + i * n + 8 * v, full, masks[v], bias == nullptr ? sum[i][v] : _mm256_add_ps(sum[i][v], b));
    }
  }
}

// multiply_block<rows> for a row count known only at run time (1 to kRowBlock).
template <int kRows = kRowBlock>
void multiply_rows(int rows, const float* x, int64_t k_stride, const float* panel, int64_t depth, float* out,
                   int64_t n, bool accumulate, const float* bias, const __m256i* masks, bool full,
                   const char* prefetch, int64_t prefetch_lines) {
  if constexpr (kRows > 0) {
    if (rows == kRows) {
      multiply_block<kRows>(x, k_stride, panel, depth, out, n, accumulate, bias, masks, full, prefetch,
                            prefetch_lines);
    } else {
      multiply_rows<kRows - 1>(rows, x, k_stride, panel, depth, out, n, accumulate, bias, masks, full, prefetch,
                               prefetch_lines);
    }
  }
}

// One or two rows: kStreams panels side by side (the pass is bounded by the memory), without the AVX-512 pass's
// software prefetch (on a Zen 3 core one row took 1.0-1.2x the time with it). From three rows the register blocks
// below took 0.6-0.9x this walk's time.
template <int kRows, int kStreams>
void multiply_few_rows(const float* x, const float* panels, const float* bias, float* out, int64_t n, int64_t k,
                       int64_t begin, int64_t end) {
  int64_t p = begin;
  for (; p + kStreams <= end; p += kStreams) {
    // every loop over the sums unrolled, as multiply_block's: with them rolled, GCC 12 loaded and stored one row's
    // 12 sums on every step of k
    __m256 sum[kRows][4 * kStreams];
#pragma GCC unroll 2
    for (int i = 0; i < kRows; ++i)
#pragma GCC unroll 16
      for (int u = 0; u < 4 * kStreams; ++u) sum[i][u] = _mm256_setzero_ps();
    const float* panel = panels + p * k * kPanel;
    for (int64_t kk = 0; kk < k; ++kk) {
#pragma GCC unroll 4
      for (int i = 0; i < kRows; ++i) {
        const __m256 xi = _mm256_broadcast_ss(x + i * k + kk);
#pragma GCC unroll 16
        for (int u = 0; u < 4 * kStreams; ++u) {
          const __m256 w = _mm256_loadu_ps(panel + (u / 4) * k * kPanel + kk * kPanel + 8 * (u % 4));
          sum[i][u] = _mm256_fmadd_ps(xi, w, sum[i][u]);
        }
      }
    }
#pragma GCC unroll 16
    for (int u = 0; u < 4 * kStreams; ++u) {
      const int64_t f0 = p * kPanel + 8 * u;  // the streams' panels are adjacent: vector u is columns 8u on
      const __m256i mask = column_mask(n, f0);
      const bool full = f0 + 8 <= n;
      const __m256 b = bias == nullptr ? _mm256_setzero_ps() : load_columns(bias + f0, full, mask);
#pragma GCC unroll 2
      for (int i = 0; i < kRows; ++i) {
        store_columns(out + i * n + f0, full, mask, bias == nullptr ? sum[i][u] : _mm256_add_ps(sum[i][u], b));
      }
    }
  }
  if constexpr (kStreams > 1) {
    if (p < end) multiply_few_rows<kRows, 1>(x, panels, bias, out, n, k, p, end);
  }
}

// Panels [begin, end) for `rows` rows of x (from x, into out).
void multiply_panels(const float* x, const float* panels, const float* bias, float* out, int64_t rows, int64_t n,
                     int64_t k, int64_t begin, int64_t end) {
  switch (rows) {
    case 1:
      return multiply_few_rows<1, 3>(x, panels, bias, out, n, k, begin, end);
    case 2:
      return multiply_few_rows<2, 1>(x, panels, bias, out, n, k, begin, end);
    default:
      break;
  }
  const RowBlocks blocks(rows);
  const int64_t panel_stride = k * kPanel;
  for (int64_t p = begin; p < end; ++p) {
    __m256i masks[4];
    for (int v = 0; v < 4; ++v) masks[v] = column_mask(n, p * kPanel + 8 * v);
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {  // a slice of the panel (kDepth x 128 bytes) stays in L1
      const int64_t depth = std::min(kDepth, k - k0);
      const bool last = k0 + depth == k;
      // the walk's next slice (this panel's, or the next panel's first; none past `end`), brought into L2 while
      // this one is multiplied: its lines shared out over the blocks' passes
      const int64_t next_p = last ? p + 1 : p, next_k0 = last ? 0 : k0 + depth;
      const char* next = reinterpret_cast<const char*>(panels + next_p * panel_stride + next_k0 * kPanel);
      const int64_t next_lines = next_p < end ? std::min(kDepth, k - next_k0) * kPanel * 4 / 64 : 0;
      const int64_t share = (next_lines + 2 * blocks.count - 1) / (2 * blocks.count);
      int64_t row = 0, line = 0;
      for (int64_t b = 0; b < blocks.count; ++b) {
        const int block_rows = blocks.rows(b);
        const bool more_rows = b + 1 < blocks.count;  // the next block: as the AVX-512 walk's, one panel at a time
        const int64_t next_block_p = more_rows ? p : next_p;
        fetch_first_touches(x, out, n, k, begin,
                            {more_rows ? row + block_rows : 0, blocks.rows(more_rows ? b + 1 : 0), next_block_p,
                             std::clamp<int64_t>(end - next_block_p, 0, 1), more_rows ? k0 : next_k0});
        for (int half = 0; half < 2; ++half) {
          const int64_t feature0 = p * kPanel + 16 * half;
          const int64_t lines = std::clamp<int64_t>(next_lines - line, 0, share);
          multiply_rows(block_rows, x + row * k + k0, k, panels + p * panel_stride + k0 * kPanel + 16 * half, depth,
                        out + row * n + feature0, n, k0 > 0, last && bias != nullptr ? bias + feature0 : nullptr,
                        masks + 2 * half, feature0 + 16 <= n, next + 64 * line, lines);
          line += lines;
        }
        row += block_rows;
      }
    }
  }
}
#endif

}  // namespace

namespace splitserve_cpu {

bool panel_linear_available() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(panel_linear_available(), "panel_linear: this build has neither an AVX-512F nor an AVX2 kernel "
                                        "(panel_linear_available says whether it has)");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat && panels.size(0) > 0 && panels.size(1) > 0,
              "panels: contiguous float32 [num_panels, in_features, ", kPanel, "], got ", panels.scalar_type(), " ",
              panels.sizes(), panels.is_contiguous() ? "" : " (not contiguous)");
  const int64_t k = panels.size(1), num_panels = panels.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat && x.size(1) == k && x.size(0) > 0,
              "x: contiguous float32 [rows, in_features=", k, "] with at least one row, got ", x.scalar_type(), " ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t rows = x.size(0), n = out.dim() == 2 ? out.size(1) : -1;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == rows &&
                  n > (num_panels - 1) * kPanel && n <= num_panels * kPanel,
              "out: contiguous float32 [rows=", rows, ", out_features] with out_features in (",
              (num_panels - 1) * kPanel, ", ", num_panels * kPanel, "] (", num_panels, " panels of ", kPanel,
              "), got ", out.scalar_type(), " ", out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(!out.is_alias_of(x) && !out.is_alias_of(panels), "out: must not share memory with x or panels");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias: contiguous float32 [out_features=", n, "], got ", bias->scalar_type(), " ", bias->sizes());
    TORCH_CHECK(!out.is_alias_of(*bias), "out: must not share memory with bias");  // partial sums land in out
    b = bias->data_ptr<float>();
  }
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = panels.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  const int64_t most = std::clamp<int64_t>(kChunkBytes / (k * int64_t{sizeof(float)}), kRowBlock, kRowChunk);
  const int64_t chunks = (rows + most - 1) / most;
  const int64_t grain = std::max<int64_t>(1, kShareMultiplyAdds / (kPanel * k * rows));
  at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
    for (int64_t c = 0, row0 = 0; c < chunks; ++c) {
      const int64_t chunk_rows = rows / chunks + (c < rows % chunks);
      multiply_panels(x_ptr + row0 * k, w_ptr, b, o_ptr + row0 * n, chunk_rows, n, k, begin, end);
      row0 += chunk_rows;
    }
  });
#endif
}

}  // namespace splitserve_cpu
