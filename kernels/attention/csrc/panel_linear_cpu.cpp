// float32 matrix products of batch and prefill rows over the weight laid out in panels: out [M, N] = x [M, K] @ w.T
// (+ bias), w given as panels [ceil(N / 32), K, 32] (panels[p, k, j] = w[32 p + j, k], the last panel's missing
// features zero; core_svc/models/layers.py's pack_panels), float32 sums.
//
// Why: a decode batch's rows are too few for MKL's sgemm over the column-major weight (float32's batch layout
// before this kernel) or oneDNN's product over its packed one to hide the wait for a weight that the attention
// between products has pushed out of the caches. Over small's 33 weight matrices (python -m benchmarks.gemv,
// docs/benchmarks.md, "float32 products over weight panels"; one thread, routes interleaved), this kernel took 0.63x
// the column-major route's time at 16 rows, 0.89x at 64, 0.90x at 256 and 1.01x at one row, and over the
// projections at a 1458-row prefill chunk 1.07-1.18x (MKL's micro-kernel is the faster one where nothing waits on
// memory); on the 32,000-wide LM head alone, against oneDNN's packed product, 0.65-0.85x from 2 rows up and
// 0.85-0.95x at one. Whole float32 runs of bench throughput (64 requests, prefill about half the
// products' work) alternating with the column-major layout came out within the spread between runs.
//
// How (the register-blocked micro-kernel of Goto and van de Geijn, "Anatomy of High-Performance Matrix
// Multiplication", ACM TOMS 34(3), 2008, and of BLIS): a panel's 32 output features are two 16-float vectors, and a
// block of up to kRowBlock rows of x keeps its 2 x kRowBlock sums in registers (28 of the 32 AVX-512 registers)
// while it walks k: per k, two vector loads of the panel and, for each row, one broadcast of x and two fused
// multiply-adds. The panel is walked kDepth values of k at a time (its 32 KiB slice stays in L1 while every row
// block of the chunk passes over it). A thread's panels are one contiguous stream (K x 128 bytes each), read in
// order: its first slice is prefetched into L2 before the walk, and each next slice while the one before it is
// multiplied, its cache lines spread over the row blocks' walks. Rows are walked kRowChunk at a time (fewer where K
// is large), so the rows of x a panel meets stay in L2. One to four rows (multiply_few_rows) are a pass bounded by
// the memory: several panels are walked side by side instead. Threads share out panels (kShareMultiplyAdds each at
// least).
//
// Every output is one sum over k in order (an FMA chain; partial sums stored and reloaded between slices of k
// unchanged), so a row's result does not depend on the other rows, on how rows were blocked, or on the thread
// count; it differs from MKL's and oneDNN's in the summation order only (rounding: about 1e-7 relative). Needs
// AVX-512F (panel_linear_available()).
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Sums in the order written (only the attention kernel builds with -ffast-math; this keeps it so if that changes).
#pragma GCC optimize("no-unsafe-math-optimizations", "no-finite-math-only")

namespace {

constexpr int64_t kPanel = 32;  // output features per panel: two AVX-512 vectors of float32
// Rows per register block: 2 x 14 sums and the panel's two vectors take 30 of the 32 vector registers.
constexpr int kRowBlock = 14;
// k per walk of a panel: its 256 x 32 floats (32 KiB) stay in L1 (48 KiB on the machines measured) while the row
// blocks pass over them. 128-512 measured over small's projections and LM head at 16-256 rows: 256 the best or
// within noise of it.
constexpr int64_t kDepth = 256;
// Rows of x per walk over the weight, at most (the rows split into walks as even as they can be); fewer where K is
// large, so the chunk (rows x K floats) stays within kChunkBytes of L2 (2 MiB per core on the machines measured): a
// panel meets every row of the chunk. Walks of 28, 64 and 128 rows were measured too (small's projections at
// 512 and 1458 rows, prefill chunks): none clearly ahead of 256 alone, and 64 no better in the engine.
constexpr int64_t kRowChunk = 256;
constexpr int64_t kChunkBytes = int64_t{1} << 20;
// Multiply-adds per parallel work share, at least: a product of at most one share runs on the calling thread, where
// a parallel region costs more (fork, barrier) than it saves.
constexpr int64_t kShareMultiplyAdds = int64_t{4} << 20;

#if defined(__AVX512F__)
// Sums of rows [0, kRows) of x (rows at stride k_stride, from k0) with a panel's slice of `depth` values of k, into
// out's 32 columns (rows at stride n): stored, or added to what is there (`accumulate`, the slices after the first),
// plus the bias after the last slice (`bias` non-null, its 32 columns). `mask0`/`mask1`: which of the columns exist.
// Meanwhile `prefetch_lines` 64-byte lines from `prefetch` on are brought into L2.
template <int kRows>
void multiply_block(const float* x, int64_t k_stride, const float* panel, int64_t depth, float* out, int64_t n,
                    bool accumulate, const float* bias, __mmask16 mask0, __mmask16 mask1, const float* prefetch,
                    int64_t prefetch_lines) {
  __m512 sum0[kRows], sum1[kRows];
  for (int i = 0; i < kRows; ++i) {
    sum0[i] = accumulate ? _mm512_maskz_loadu_ps(mask0, out + i * n) : _mm512_setzero_ps();
    sum1[i] = accumulate ? _mm512_maskz_loadu_ps(mask1, out + i * n + 16) : _mm512_setzero_ps();
  }
  // the prefetches, spread evenly over the walk: `per_step` lines every `every` steps of k
  const int64_t per_step = (prefetch_lines + depth - 1) / depth;
  const int64_t every = per_step > 0 ? std::max<int64_t>(1, depth * per_step / prefetch_lines) : depth;
  int64_t line = 0, countdown = 0;
  for (int64_t k = 0; k < depth; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    if (--countdown <= 0) {
      countdown = every;
      for (int64_t j = 0; j < per_step && line < prefetch_lines; ++j, ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + line * 16), _MM_HINT_T1);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < kRows; ++i) {
      const __m512 xi = _mm512_set1_ps(x[i * k_stride + k]);
      sum0[i] = _mm512_fmadd_ps(xi, w0, sum0[i]);
      sum1[i] = _mm512_fmadd_ps(xi, w1, sum1[i]);
    }
  }
  const __m512 b0 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask0, bias);
  const __m512 b1 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask1, bias + 16);
  for (int i = 0; i < kRows; ++i) {
    _mm512_mask_storeu_ps(out + i * n, mask0, bias == nullptr ? sum0[i] : _mm512_add_ps(sum0[i], b0));
    _mm512_mask_storeu_ps(out + i * n + 16, mask1, bias == nullptr ? sum1[i] : _mm512_add_ps(sum1[i], b1));
  }
}

// multiply_block<rows> for a row count known only at run time (1 to kRowBlock).
template <int kRows = kRowBlock>
void multiply_rows(int rows, const float* x, int64_t k_stride, const float* panel, int64_t depth, float* out,
                   int64_t n, bool accumulate, const float* bias, __mmask16 mask0, __mmask16 mask1,
                   const float* prefetch, int64_t prefetch_lines) {
  if constexpr (kRows > 0) {
    if (rows == kRows) {
      multiply_block<kRows>(x, k_stride, panel, depth, out, n, accumulate, bias, mask0, mask1, prefetch,
                            prefetch_lines);
    } else {
      multiply_rows<kRows - 1>(rows, x, k_stride, panel, depth, out, n, accumulate, bias, mask0, mask1, prefetch,
                               prefetch_lines);
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
      const int64_t valid = std::min(kPanel, n - f0);
      const auto m0 = static_cast<__mmask16>(valid >= 16 ? 0xffff : (1u << valid) - 1);
      const auto m1 = static_cast<__mmask16>(valid >= 32 ? 0xffff : valid <= 16 ? 0 : (1u << (valid - 16)) - 1);
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
  // row blocks as even as they can be: `blocks` of `base` or `base + 1` rows (64 rows: 13, 13, 13, 13, 12)
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
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t base = rows / blocks, longer = rows % blocks;
  // The walk reads panels [begin, end) in memory order, a slice (up to kDepth x 32 floats) at a time: the first
  // slice is brought into L2 before it starts, each later one while the slice before it is multiplied.
  const float* walk_end = panels + end * k * kPanel;
  const float* first = panels + begin * k * kPanel;
  for (const float* line = first; line < std::min(walk_end, first + kDepth * kPanel); line += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
  }
  for (int64_t p = begin; p < end; ++p) {
    const int64_t feature0 = p * kPanel;
    const int64_t valid = std::min(kPanel, n - feature0);
    const auto mask0 = static_cast<__mmask16>(valid >= 16 ? 0xffff : (1u << valid) - 1);
    const auto mask1 = static_cast<__mmask16>(valid >= 32 ? 0xffff : valid <= 16 ? 0 : (1u << (valid - 16)) - 1);
    const float* panel = panels + p * k * kPanel;
    for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
      const int64_t depth = std::min(kDepth, k - k0);
      const bool last = k0 + depth == k;
      // the next slice (2 lines per k), a share of it per row block
      const float* next = panel + (k0 + depth) * kPanel;
      const int64_t next_depth = last ? std::min(kDepth, k) : std::min(kDepth, k - k0 - depth);
      const int64_t lines = next < walk_end ? 2 * next_depth : 0;
      const int64_t share = (lines + blocks - 1) / blocks;
      int64_t row = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int block_rows = static_cast<int>(base + (b < longer));
        const int64_t from = b * share;
        const int64_t count = std::clamp<int64_t>(lines - from, 0, share);
        multiply_rows(block_rows, x + row * k + k0, k, panel + k0 * kPanel, depth, out + row * n + feature0, n,
                      k0 > 0, last && bias != nullptr ? bias + feature0 : nullptr, mask0, mask1,
                      count > 0 ? next + from * 16 : nullptr, count);
        row += block_rows;
      }
    }
  }
}
#endif

}  // namespace

namespace splitserve_cpu {

bool panel_linear_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(panel_linear_available(), "panel_linear: this build has no AVX-512F kernel (panel_linear_available says "
                                        "whether it has)");
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
    b = bias->data_ptr<float>();
  }
#if defined(__AVX512F__)
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

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.impl("panel_linear", c10::DispatchKey::CPU, &splitserve_cpu::panel_linear);
  m.def("panel_linear_available() -> bool");
  m.impl("panel_linear_available", &splitserve_cpu::panel_linear_available);
}
