// int8 matrix products on CPUs without AVX-512 VNNI (AVX2): out [M, N] = (x_int8 [M, K] . w_int8 [N, K]^T) *
// x_scales[m] * w_scales[n] (+ bias), the W8A8 product of core_svc/models/quantization.py, with w laid out in panels
// [ceil(N / 16), ceil(K / 2), 16, 2] (panels[p, j, f, i] = w[16 p + f, 2 j + i], zero past N and K;
// quantization.py's pack_int8_panels).
//
// Why: on an Intel Xeon held to AVX2, oneDNN's int8 product (torch._int_mm) multiplied u8 by s8 into saturating int16
// pairs (vpmaddubsw), so its sums were wrong, and int8 batches multiplied by the weight dequantized to float32 per
// call: 0.57x float32's batch throughput. On an AMD Zen 3, oneDNN's product is exact but took 124 ms for 64 rows of small's gate_up
// projection (int8 batches: 16 output tokens/s against float32's 253). vpmaddwd multiplies 16 int16 pairs into 8
// exact int32 sums; on Zen 3 it issues at the rate of a float32 FMA, which does 8 multiply-adds to its 16, so an int8
// product can run at up to twice float32's rate. Over small's five matrices on a Zen 3 core (python -m
// benchmarks.int8_matmul, one thread; docs/benchmarks.md, "int8 on AVX2") this kernel, the activations' quantization
// included, took 0.42-0.69x the time of float32's MKL product at 64 and 256 rows (108-118 GOP/s on the larger
// ones), and over the five together 0.83x the time of torch's weight-only kernel (torch._weight_int8pack_mm) at one
// row, 0.54x at four.
//
// How: a register block of 6 rows x one panel (16 output features) keeps its sums in 12 of the 16 vector registers
// while it walks k two values at a time: per pair of k, two 16-byte loads of the panel sign-extended to int16
// (vpmovsxbw) and, for each row, a broadcast of its two int16 values of x and two vpmaddwd into 2 x 8 int32 sums.
// The loop is written in assembly: GCC hoisted the six broadcasts of a step ahead of the products and spilled the
// sums to the stack (half the rate). The rows of x are widened to int16 and interleaved per block of 6 (x_blocks
// [blocks, ceil(K / 2), 6] int32 pairs) once per chunk of rows, so a block's broadcasts read one contiguous stream;
// a chunk is at most kChunkBytes of them (L2), or one block where K is wider. Threads share out panels. The int32
// sums are exact (|sum| <= K * 128^2 < 2^31 for K < 2^17); each output is then (float(sum) * x_scale) * w_scale (+ bias),
// rounded as dequantize_rows (int8_rows_cpu.cpp) rounds it, so the result equals the W8A8 path through
// torch._int_mm where its sums are exact, bit for bit.
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Rounded as dequantize_rows rounds: products and sums one at a time, no fused multiply-add.
#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math", "no-finite-math-only", "fp-contract=off")

namespace {

constexpr int64_t kPanel = 16;  // output features per panel: two AVX2 vectors of int32 sums
constexpr int kRowBlock = 6;    // rows per register block: 6 x 2 vectors of sums, 4 registers for the step
constexpr int64_t kMaxFewRows = 2;  // rows up to which multiply_few_rows walks panels side by side instead
// Bytes of interleaved int16 rows per chunk (the chunk stays in L2, 512 KiB per core on Zen 3, while every panel
// passes over it).
constexpr int64_t kChunkBytes = 256 * 1024;
// in_features from which K products of -128 x -128 reach 2^31.
constexpr int64_t kMaxInFeatures = int64_t{1} << 17;
// Multiply-adds per thread's share at least: a parallel region for less costs more than it saves.
constexpr int64_t kShareMultiplyAdds = 1 << 20;

#if defined(__AVX2__)
// out[:columns] = (float(sums) * x_scale) * w_scales (+ bias) for one row's 16 sums (two vectors of 8).
inline void store_row(const __m256i* sums, float x_scale, const float* w_scales, const float* bias, int columns,
                      float* out) {
  const __m256 row_scale = _mm256_set1_ps(x_scale);
  __m256 out0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[0]), row_scale), _mm256_loadu_ps(w_scales));
  __m256 out1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[1]), row_scale), _mm256_loadu_ps(w_scales + 8));
  if (bias != nullptr) {
    out0 = _mm256_add_ps(out0, _mm256_loadu_ps(bias));
    out1 = _mm256_add_ps(out1, _mm256_loadu_ps(bias + 8));
  }
  if (columns == kPanel) {
    _mm256_storeu_ps(out, out0);
    _mm256_storeu_ps(out + 8, out1);
  } else {
    alignas(32) float staged[kPanel];
    _mm256_store_ps(staged, out0);
    _mm256_store_ps(staged + 8, out1);
    std::memcpy(out, staged, columns * sizeof(float));
  }
}

// The sums of a block of 6 interleaved rows (x_block: [pairs, 6] int32) against one panel ([pairs, 16, 2] int8),
// scaled and stored: out[r, f] = (float(sum) * x_scales[r]) * w_scales[f] (+ bias[f]) for r < rows, f < columns.
void multiply_block(const int32_t* x_block, int64_t pairs, const int8_t* panel, const float* x_scales, int rows,
                    const float* w_scales, const float* bias, int columns, float* out, int64_t ldo) {
  __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256i a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const int8_t* p = panel;
  const int8_t* const end = panel + pairs * 2 * kPanel;
  const int32_t* xp = x_block;
  // ymm12/ymm13: the step's panel as int16; ymm14: a row's broadcast pair; ymm15: a product.
#define SPLITSERVE_INT8_ROW(offset, A0, A1)              \
  "vpbroadcastd " offset "(%[xp]), %%ymm14\n\t"          \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t"               \
  "vpaddd %%ymm15, %[" A0 "], %[" A0 "]\n\t"             \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm14\n\t"               \
  "vpaddd %%ymm14, %[" A1 "], %[" A1 "]\n\t"
  __asm__ volatile(
      "1:\n\t"
      "vpmovsxbw (%[p]), %%ymm12\n\t"
      "vpmovsxbw 16(%[p]), %%ymm13\n\t"
      SPLITSERVE_INT8_ROW("0", "a00", "a01")
      SPLITSERVE_INT8_ROW("4", "a10", "a11")
      SPLITSERVE_INT8_ROW("8", "a20", "a21")
      SPLITSERVE_INT8_ROW("12", "a30", "a31")
      SPLITSERVE_INT8_ROW("16", "a40", "a41")
      SPLITSERVE_INT8_ROW("20", "a50", "a51")
      "addq $32, %[p]\n\t"
      "addq $24, %[xp]\n\t"
      "cmpq %[p], %[end]\n\t"
      "jne 1b\n\t"
      : [a00] "+x"(a00), [a01] "+x"(a01), [a10] "+x"(a10), [a11] "+x"(a11), [a20] "+x"(a20), [a21] "+x"(a21),
        [a30] "+x"(a30), [a31] "+x"(a31), [a40] "+x"(a40), [a41] "+x"(a41), [a50] "+x"(a50), [a51] "+x"(a51),
        [p] "+r"(p), [xp] "+r"(xp)
      : [end] "r"(end)
      : "cc", "memory", "xmm12", "xmm13", "xmm14", "xmm15");
#undef SPLITSERVE_INT8_ROW
  const __m256i sums[kRowBlock][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < rows; ++r) store_row(sums[r], x_scales[r], w_scales, bias, columns, out + r * ldo);
}

// One or two rows (a request's decode), bounded by reading the weight: ROWS rows against PANELS panels side by side
// (consecutive ones, panel_bytes apart), their sums in registers (ROWS x PANELS x 2 vectors, at most 8), each row's
// two int16 values of x broadcast once per pair of k for every panel. The block of 6 multiplies 4-5 rows of zeros
// there: over small's projections and LM head this walk took 0.4-0.6x the block's time at one row and 0.6-0.85x at
// two; at four rows (one panel at a time) it took 1.15-1.2x, so three and four rows take the block.
template <int ROWS, int PANELS>
void multiply_few_rows(const int32_t* x_block, int64_t pairs, const int8_t* panels, const float* x_scales,
                       const float* const* w_scales, const float* const* bias, const int* columns, float* out,
                       int64_t ldo) {
  static_assert(ROWS * PANELS <= 4, "ROWS x PANELS x 2 vectors of sums, at most 8 registers");
  __m256i sums[ROWS][PANELS][2];
  for (int r = 0; r < ROWS; ++r) {
    for (int q = 0; q < PANELS; ++q) sums[r][q][0] = sums[r][q][1] = _mm256_setzero_si256();
  }
  const int64_t panel_bytes = pairs * 2 * kPanel;
  for (int64_t j = 0; j < pairs; ++j) {
    __m256i x[ROWS];
    for (int r = 0; r < ROWS; ++r) x[r] = _mm256_set1_epi32(x_block[j * kRowBlock + r]);
    for (int q = 0; q < PANELS; ++q) {
      const int8_t* step = panels + q * panel_bytes + j * 2 * kPanel;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16)));
      for (int r = 0; r < ROWS; ++r) {
        sums[r][q][0] = _mm256_add_epi32(sums[r][q][0], _mm256_madd_epi16(x[r], w0));
        sums[r][q][1] = _mm256_add_epi32(sums[r][q][1], _mm256_madd_epi16(x[r], w1));
      }
    }
  }
  for (int q = 0; q < PANELS; ++q) {
    for (int r = 0; r < ROWS; ++r) {
      store_row(sums[r][q], x_scales[r], w_scales[q], bias[q], columns[q], out + r * ldo + q * kPanel);
    }
  }
}

// Panels [begin, end) of ROWS (1 or 2) rows: 4 / ROWS of them side by side, the rest one at a time.
template <int ROWS>
void multiply_panels_few_rows(const int32_t* x_block, int64_t pairs, const int8_t* panels, const float* x_scales,
                              const float* w_scales, const float* tail_scales, const float* bias,
                              const float* tail_bias, int64_t num_panels, int tail, float* out, int64_t ldo,
                              int64_t begin, int64_t end) {
  constexpr int kSide = 4 / ROWS;
  const int64_t panel_bytes = pairs * 2 * kPanel;
  int64_t p = begin;
  const auto walk = [&]<int PANELS>() {
    const float* scales[PANELS];
    const float* biases[PANELS];
    int columns[PANELS];
    for (int q = 0; q < PANELS; ++q) {
      const bool last = p + q == num_panels - 1;
      scales[q] = last ? tail_scales : w_scales + (p + q) * kPanel;
      biases[q] = bias == nullptr ? nullptr : last ? tail_bias : bias + (p + q) * kPanel;
      columns[q] = last ? tail : static_cast<int>(kPanel);
    }
    multiply_few_rows<ROWS, PANELS>(x_block, pairs, panels + p * panel_bytes, x_scales, scales, biases, columns,
                                    out + p * kPanel, ldo);
    p += PANELS;
  };
  while (p + kSide <= end) walk.template operator()<kSide>();
  while (p < end) walk.template operator()<1>();
}
#endif

}  // namespace

namespace splitserve_cpu {

bool int8_panel_linear_available() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

void int8_panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& panels,
                       const at::Tensor& w_scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(int8_panel_linear_available(), "int8_panel_linear: this build has no AVX2 kernel "
                                             "(int8_panel_linear_available says whether it has)");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kPanel && panels.size(3) == 2 && panels.is_contiguous() &&
                  panels.scalar_type() == at::kChar && panels.size(0) > 0 && panels.size(1) > 0,
              "panels: contiguous int8 [num_panels, ceil(in_features / 2), ", kPanel, ", 2], got ",
              panels.scalar_type(), " ", panels.sizes(), panels.is_contiguous() ? "" : " (not contiguous)");
  const int64_t num_panels = panels.size(0), pairs = panels.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kChar && x.size(0) > 0 &&
                  (x.size(1) + 1) / 2 == pairs && x.size(1) > 0,
              "x: contiguous int8 [rows, in_features] with at least one row and ceil(in_features / 2) = ", pairs,
              ", got ", x.scalar_type(), " ", x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k < kMaxInFeatures, "x: in_features ", k, " from ", kMaxInFeatures,
              " up, where int32 sums of int8 products (128^2 each at most) could overflow");
  TORCH_CHECK(x_scales.dim() == 1 && x_scales.numel() == rows && x_scales.is_contiguous() &&
                  x_scales.scalar_type() == at::kFloat,
              "x_scales: contiguous float32 [rows=", rows, "], got ", x_scales.scalar_type(), " ", x_scales.sizes());
  const int64_t n = out.dim() == 2 ? out.size(1) : -1;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == rows &&
                  n > (num_panels - 1) * kPanel && n <= num_panels * kPanel,
              "out: contiguous float32 [rows=", rows, ", out_features] with out_features in (",
              (num_panels - 1) * kPanel, ", ", num_panels * kPanel, "] (", num_panels, " panels of ", kPanel,
              "), got ", out.scalar_type(), " ", out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(w_scales.dim() == 1 && w_scales.numel() == n && w_scales.is_contiguous() &&
                  w_scales.scalar_type() == at::kFloat,
              "w_scales: contiguous float32 [out_features=", n, "], got ", w_scales.scalar_type(), " ",
              w_scales.sizes());
  TORCH_CHECK(!out.is_alias_of(x) && !out.is_alias_of(panels) && !out.is_alias_of(x_scales) &&
                  !out.is_alias_of(w_scales),
              "out: must not share memory with the inputs");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias: contiguous float32 [out_features=", n, "], got ", bias->scalar_type(), " ", bias->sizes());
    TORCH_CHECK(!out.is_alias_of(*bias), "out: must not share memory with bias");
    b = bias->data_ptr<float>();
  }
#if defined(__AVX2__)
  const int8_t* x_ptr = x.data_ptr<int8_t>();
  const float* xs_ptr = x_scales.data_ptr<float>();
  const int8_t* w_ptr = panels.data_ptr<int8_t>();
  const float* ws_ptr = w_scales.data_ptr<float>();
  float* o_ptr = out.data_ptr<float>();
  // The last panel's scales and bias padded to a whole panel (its missing features' sums are zero).
  const int64_t tail = n - (num_panels - 1) * kPanel;
  alignas(32) float tail_scales[kPanel] = {}, tail_bias[kPanel] = {};
  std::memcpy(tail_scales, ws_ptr + (num_panels - 1) * kPanel, tail * sizeof(float));
  if (b != nullptr) std::memcpy(tail_bias, b + (num_panels - 1) * kPanel, tail * sizeof(float));
  const int64_t block_bytes = pairs * kRowBlock * int64_t{sizeof(int32_t)};
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkBytes / block_bytes);
  std::vector<int32_t> x_blocks(std::min(chunk_blocks, (rows + kRowBlock - 1) / kRowBlock) * pairs * kRowBlock);
  const int64_t grain = std::max<int64_t>(1, kShareMultiplyAdds / (kPanel * k * std::min<int64_t>(rows, 256)));
  for (int64_t row0 = 0; row0 < rows; row0 += chunk_blocks * kRowBlock) {
    const int64_t chunk_rows = std::min(chunk_blocks * kRowBlock, rows - row0);
    const int64_t blocks = (chunk_rows + kRowBlock - 1) / kRowBlock;
    // x_blocks[b, j, r] = (x[row, 2 j], x[row, 2 j + 1]) as two int16 in one int32, row = row0 + 6 b + r; zero past
    // the rows and in_features
    for (int64_t bl = 0; bl < blocks; ++bl) {
      int32_t* block = x_blocks.data() + bl * pairs * kRowBlock;
      for (int r = 0; r < kRowBlock; ++r) {
        const int64_t row = row0 + bl * kRowBlock + r;
        if (row >= rows) {
          for (int64_t j = 0; j < pairs; ++j) block[j * kRowBlock + r] = 0;
          continue;
        }
        const int8_t* x_row = x_ptr + row * k;
        for (int64_t j = 0; j < pairs; ++j) {
          const int32_t low = static_cast<uint16_t>(static_cast<int16_t>(x_row[2 * j]));
          const int32_t high = 2 * j + 1 < k ? static_cast<int32_t>(x_row[2 * j + 1]) : 0;
          block[j * kRowBlock + r] = static_cast<int32_t>(static_cast<uint32_t>(high) << 16) | low;
        }
      }
    }
    at::parallel_for(0, num_panels, grain, [&](int64_t begin, int64_t end) {
      if (chunk_rows <= kMaxFewRows) {
        const auto few = [&]<int ROWS>() {
          multiply_panels_few_rows<ROWS>(x_blocks.data(), pairs, w_ptr, xs_ptr + row0, ws_ptr, tail_scales, b,
                                         tail_bias, num_panels, static_cast<int>(tail), o_ptr + row0 * n, n, begin,
                                         end);
        };
        return chunk_rows == 1 ? few.template operator()<1>() : few.template operator()<2>();
      }
      for (int64_t p = begin; p < end; ++p) {
        const bool last = p == num_panels - 1;
        const int columns = static_cast<int>(last ? tail : kPanel);
        const float* scales = last ? tail_scales : ws_ptr + p * kPanel;
        const float* panel_bias = b == nullptr ? nullptr : last ? tail_bias : b + p * kPanel;
        for (int64_t bl = 0; bl < blocks; ++bl) {
          const int64_t first = bl * kRowBlock;
          multiply_block(x_blocks.data() + bl * pairs * kRowBlock, pairs, w_ptr + p * pairs * 2 * kPanel,
                         xs_ptr + row0 + first, static_cast<int>(std::min<int64_t>(kRowBlock, chunk_rows - first)),
                         scales, panel_bias, columns, o_ptr + (row0 + first) * n + p * kPanel, n);
        }
      }
    });
  }
#endif
}

}  // namespace splitserve_cpu
