// The passes around an int8 x int8 -> int32 matmul of W8A8 (core_svc/models/quantization.py), one pass each
// instead of torch's six (abs, amax, clamp, divide, round, cast) and four (cast, two products, cast):
// - quantize_rows_int8: dynamic symmetric int8 per row, scale = max(max|x_row|, FLT_MIN) / 127 and
//   q = round_half_even(x / scale), the values of quantize_int8_per_row bit for bit, an all-zero row's q 0 (a row
//   with a NaN: q 0 and a NaN scale, so its products are NaN as through torch's ops);
// - dequantize_rows: out = acc * row_scale * col_scale (+ bias), float32.
// Rows are independent: split over torch's threads when there is enough work for a parallel region to pay.
#include "cpu_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// These functions round as torch's ops do: no unsafe math optimizations, no fused multiply-adds. The file builds
// without -ffast-math (kernels/attention/cpu_ops.py), under which GCC had replaced x / scale by a product with
// 1 / scale (87 of 2000 scales one ulp off); the pragma keeps that so whatever the flags. GCC's builtins stand in
// for <cmath>'s inline wrappers; the loops on float32 rows are written with AVX-512 or AVX2 intrinsics (GCC left them
// scalar).
#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math", "no-finite-math-only", "fp-contract=off")

namespace {

// Elements per parallel work share: a region for less costs more (fork, barrier) than it saves.
constexpr int64_t kGrainElements = 1 << 16;
// Most activation rows int8_gemv takes (one request's decode is one), the weight rows it reads together, and how far
// ahead of its loads it prefetches (8 KB: the best of 1-32 KB over small's 33 matrices, docs/benchmarks.md).
constexpr int64_t kMaxGemvRows = 4;
constexpr int kGemvBlock = 8;
constexpr int64_t kPrefetchBytes = 8192;

// A row's largest magnitude, and whether it holds a NaN.
template <typename scalar_t>
inline float row_amax(const scalar_t* row, int64_t k, bool& nan) {
  float amax = 0.0f;
  int any_nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : any_nan)
  for (int64_t i = 0; i < k; ++i) {
    const float v = static_cast<float>(row[i]);
    amax = __builtin_fmaxf(amax, __builtin_fabsf(v));
    any_nan |= __builtin_isnan(v);
  }
  nan = any_nan != 0;
  return amax;
}

// q = round_half_even(x / scale) for a row whose values are at most 127 * scale in magnitude.
template <typename scalar_t>
inline void quantize_values(const scalar_t* row, int8_t* q_row, float scale, int64_t k) {
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) q_row[i] = static_cast<int8_t>(static_cast<int32_t>(__builtin_nearbyintf(static_cast<float>(row[i]) / scale)));
}

#if defined(__AVX2__)
// row_amax's scalar tail from value i on, after a vector part that found result and any_nan.
inline float finish_row_amax(const float* row, int64_t i, int64_t k, float result, bool any_nan, bool& nan) {
  for (; i < k; ++i) {
    result = __builtin_fmaxf(result, __builtin_fabsf(row[i]));
    any_nan |= __builtin_isnan(row[i]);
  }
  nan = any_nan;
  return result;
}
#endif

#if defined(__AVX512F__)
// float32 rows 16 values at a time (GCC left the loops above scalar: 3 ns per value): the same IEEE quotients and
// round-half-to-even, then exact conversions.
template <>
inline float row_amax<float>(const float* row, int64_t k, bool& nan) {
  __m512 amax = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float result = _mm512_reduce_max_ps(amax);
  bool any_nan = unordered != 0;
  return finish_row_amax(row, i, k, result, any_nan, nan);
}

template <>
inline void quantize_values<float>(const float* row, int8_t* q_row, float scale, int64_t k) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + i), s),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q_row + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(rounded)));
  }
  for (; i < k; ++i) q_row[i] = static_cast<int8_t>(static_cast<int32_t>(__builtin_nearbyintf(row[i] / scale)));
}
#elif defined(__AVX2__)
// The same passes 8 values at a time on CPUs with AVX2 but not AVX-512 (where int8 batches quantize every
// projection's rows: int8_panel_linear_cpu.cpp).
template <>
inline float row_amax<float>(const float* row, int64_t k, bool& nan) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 amax = _mm256_setzero_ps(), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float result = 0.0f;
  for (const float lane : lanes) result = __builtin_fmaxf(result, lane);
  bool any_nan = _mm256_movemask_ps(unordered) != 0;
  return finish_row_amax(row, i, k, result, any_nan, nan);
}

template <>
inline void quantize_values<float>(const float* row, int8_t* q_row, float scale, int64_t k) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 rounded = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), s),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // in [-127, 127], or NaN where x is infinite (inf / inf: the row's scale is inf), which converts to INT_MIN:
    // those lanes 0, as torch's cast and the AVX-512 path give them, so that the packs below never saturate
    const __m256 ordered = _mm256_cmp_ps(rounded, rounded, _CMP_ORD_Q);
    const __m256i q32 = _mm256_and_si256(_mm256_cvtps_epi32(rounded), _mm256_castps_si256(ordered));
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q32), _mm256_extracti128_si256(q32, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q_row + i), _mm_packs_epi16(q16, q16));
  }
  for (; i < k; ++i) q_row[i] = static_cast<int8_t>(static_cast<int32_t>(__builtin_nearbyintf(row[i] / scale)));
}
#endif

template <typename scalar_t>
void quantize_rows(const scalar_t* x, int8_t* q, float* scales, int64_t begin, int64_t end, int64_t k) {
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* row = x + r * k;
    bool nan = false;
    const float amax = row_amax(row, k, nan);
    int8_t* q_row = q + r * k;
    if (amax == 0.0f || nan) {  // all zero: q 0 (the scale is subnormal); a NaN: the row's products NaN, as torch's
      scales[r] = nan ? __builtin_nanf("") : FLT_MIN / 127.0f;
      std::fill(q_row, q_row + k, int8_t{0});
      continue;
    }
    const float scale = std::max(amax, FLT_MIN) / 127.0f;  // a subnormal amax as torch's clamp(min=tiny)
    scales[r] = scale;
    quantize_values(row, q_row, scale, k);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kHasVnni = true;

// kGemvBlock weight rows of out[:, j0 : j0 + BLOCK] for ROWS activation rows. The loop bounds are constants, so the
// BLOCK x ROWS accumulators stay in registers (with a runtime row count they lived on the stack: the loop took 1.7x
// the time). Each 64-byte load of a weight row is followed by a prefetch kPrefetchBytes further on: a row of
// small's projections is 8 cache lines, too short a stream for the hardware prefetcher, which left one core
// reading int8 weights at half float32's rate.
template <int ROWS, int BLOCK>
inline void int8_gemv_block(const uint8_t* xu, int64_t k, const int8_t* w, const int32_t* sums, const float* xs,
                            const float* ws, const float* b, float* o, int64_t n, int64_t j0, __mmask64 tail_mask) {
  __m512i acc[BLOCK][ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < BLOCK; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) acc[r][m] = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += 64) {
    const __mmask64 mask = i + 64 <= k ? ~0ULL : tail_mask;
    __m512i xv[ROWS];
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) xv[m] = _mm512_maskz_loadu_epi8(mask, xu + m * k + i);
#pragma GCC unroll 8
    for (int r = 0; r < BLOCK; ++r) {
      const int8_t* row = w + (j0 + r) * k + i;
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, row);
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m) acc[r][m] = _mm512_dpbusd_epi32(acc[r][m], xv[m], wv);
    }
  }
  // Unrolled as the loops above, or GCC 12 keeps acc on the stack (as gemv_block's, gemv_cpu.cpp).
#pragma GCC unroll 8
  for (int r = 0; r < BLOCK; ++r) {
    const int64_t j = j0 + r;
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) {
      const int32_t total = _mm512_reduce_add_epi32(acc[r][m]) - 128 * sums[j];
      const float value = static_cast<float>(total) * xs[m] * ws[j];
      o[m * n + j] = b != nullptr ? value + b[j] : value;
    }
  }
}

template <int ROWS>
void int8_gemv_rows(const uint8_t* xu, int64_t k, const int8_t* w, const int32_t* sums, const float* xs,
                    const float* ws, const float* b, float* o, int64_t n, int64_t begin, int64_t end,
                    __mmask64 tail_mask) {
  int64_t j0 = begin;
  for (; j0 + kGemvBlock <= end; j0 += kGemvBlock)
    int8_gemv_block<ROWS, kGemvBlock>(xu, k, w, sums, xs, ws, b, o, n, j0, tail_mask);
  for (; j0 < end; ++j0) int8_gemv_block<ROWS, 1>(xu, k, w, sums, xs, ws, b, o, n, j0, tail_mask);
}

// out[m, n] = (sum_k xq[m, k] * w[n, k]) * x_scales[m] * w_scales[n] (+ bias[n]) for a few rows m: each weight row
// is read once for all of them. VNNI multiplies u8 by s8 (vpdpbusd, four products into each int32 lane, no
// saturation), so the activations go in as xq + 128 and 128 * sum_k w[n, k] (w_sums) comes off: exact int32 sums,
// the values of the W8A8 path (int8_linear_w8a8) bit for bit.
void int8_gemv_core(float* o, const int8_t* x_ptr, const float* xs, int64_t rows, int64_t k, const at::Tensor& w,
                    const at::Tensor& w_scales, const at::Tensor& w_sums, const float* b) {
  const int64_t n = w.size(0);
  std::vector<uint8_t> xu(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) xu[i] = static_cast<uint8_t>(static_cast<int32_t>(x_ptr[i]) + 128);
  const uint8_t* xu_ptr = xu.data();
  const int8_t* w_ptr = w.data_ptr<int8_t>();
  const int32_t* sums = w_sums.data_ptr<int32_t>();
  const float* ws = w_scales.data_ptr<float>();
  const int64_t tail = k % 64;
  const __mmask64 tail_mask = tail == 0 ? 0 : (~0ULL >> (64 - tail));
  // Matrices of up to 1024 rows run on the calling thread: a parallel region would cost more than it saves.
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: int8_gemv_rows<1>(xu_ptr, k, w_ptr, sums, xs, ws, b, o, n, begin, end, tail_mask); break;
      case 2: int8_gemv_rows<2>(xu_ptr, k, w_ptr, sums, xs, ws, b, o, n, begin, end, tail_mask); break;
      case 3: int8_gemv_rows<3>(xu_ptr, k, w_ptr, sums, xs, ws, b, o, n, begin, end, tail_mask); break;
      case 4: int8_gemv_rows<4>(xu_ptr, k, w_ptr, sums, xs, ws, b, o, n, begin, end, tail_mask); break;
      default: break;  // int8_gemv allows 1 to kMaxGemvRows
    }
  });
}
#else
constexpr bool kHasVnni = false;

void int8_gemv_core(float*, const int8_t*, const float*, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                    const at::Tensor&, const float*) {
  TORCH_CHECK(false, "int8_gemv needs AVX-512 VNNI (int8_gemv_available() says whether this build has it)");
}
#endif

}  // namespace

namespace splitserve_cpu {

void quantize_rows_int8(at::Tensor q, at::Tensor scales, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [num_rows, in_features]");
  TORCH_CHECK(q.sizes() == x.sizes() && q.is_contiguous() && q.scalar_type() == at::kChar, "q: int8, x's shape");
  TORCH_CHECK(scales.numel() == x.size(0) && scales.is_contiguous() && scales.scalar_type() == at::kFloat,
              "scales: float32, one per row");
  const int64_t rows = x.size(0), k = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_int8", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    int8_t* q_ptr = q.data_ptr<int8_t>();
    float* s_ptr = scales.data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(k, 1)),
                     [&](int64_t begin, int64_t end) { quantize_rows(x_ptr, q_ptr, s_ptr, begin, end, k); });
  });
}

// x: int8 rows with their scales (quantize_rows_int8's), or float32 / bfloat16 / float16 rows with x_scales None,
// quantized here as quantize_rows_int8 does (the same values: one call instead of three for a decode step).
void int8_gemv(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& w,
               const at::Tensor& w_scales, const at::Tensor& w_sums, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous 2-D");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kMaxGemvRows, "int8_gemv takes 1 to ", kMaxGemvRows, " rows, got ", rows);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kChar && w.size(1) == k,
              "w: contiguous int8 [out_features, in_features]");
  const int64_t n = w.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == n && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "out: contiguous float32 [rows, out_features]");
  TORCH_CHECK(w_scales.numel() == n && w_scales.is_contiguous() && w_scales.scalar_type() == at::kFloat,
              "w_scales: float32, one per output feature");
  TORCH_CHECK(w_sums.numel() == n && w_sums.is_contiguous() && w_sums.scalar_type() == at::kInt,
              "w_sums: int32, one per output feature");
  if (bias.has_value())
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias: float32, one per output feature");
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kChar) {
    TORCH_CHECK(x_scales.has_value() && x_scales->numel() == rows && x_scales->is_contiguous() &&
                    x_scales->scalar_type() == at::kFloat,
                "x_scales: float32, one per row of int8 x");
    int8_gemv_core(out.data_ptr<float>(), x.data_ptr<int8_t>(), x_scales->data_ptr<float>(), rows, k, w, w_scales,
                   w_sums, b);
    return;
  }
  TORCH_CHECK(!x_scales.has_value(), "x_scales: only with int8 x (float x is quantized here)");
  std::vector<int8_t> xq(rows * k);
  std::vector<float> xs(rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_gemv", [&] {
    quantize_rows(x.data_ptr<scalar_t>(), xq.data(), xs.data(), 0, rows, k);
  });
  int8_gemv_core(out.data_ptr<float>(), xq.data(), xs.data(), rows, k, w, w_scales, w_sums, b);
}

bool int8_gemv_available() { return kHasVnni; }

void dequantize_rows(at::Tensor out, const at::Tensor& acc, const at::Tensor& row_scales,
                     const at::Tensor& col_scales, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt, "acc: contiguous int32 2-D");
  TORCH_CHECK(out.sizes() == acc.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out: float32, acc's shape");
  const int64_t rows = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scales.numel() == rows && row_scales.is_contiguous() && row_scales.scalar_type() == at::kFloat,
              "row_scales: float32, one per row");
  TORCH_CHECK(col_scales.numel() == n && col_scales.is_contiguous() && col_scales.scalar_type() == at::kFloat,
              "col_scales: float32, one per column");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias: float32, one per column");
    b = bias->data_ptr<float>();
  }
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* rs = row_scales.data_ptr<float>();
  const float* cs = col_scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a_row = a + r * n;
      float* o_row = o + r * n;
      const float s = rs[r];
      if (b != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o_row[j] = static_cast<float>(a_row[j]) * s * cs[j] + b[j];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o_row[j] = static_cast<float>(a_row[j]) * s * cs[j];
      }
    }
  });
}

}  // namespace splitserve_cpu
