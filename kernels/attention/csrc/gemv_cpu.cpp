// Matrix-vector products for one request's decode: out[m, :] = x[m, :] @ w.T (+ bias) for a few rows m (at most
// kMaxRows), w a dense [out_features, in_features] float32 or bfloat16 weight, float32 sums.
//
// At one row a linear layer is a pass over its weight, and on one core that pass is bounded by how many cache lines
// are in flight. Over small's weights this kernel's pass takes 0.84x the time of oneDNN's packed float32 one and
// 0.75x its bfloat16 one (python -m benchmarks.gemv, docs/benchmarks.md). Each weight row is read once for all rows m, kBlock weight rows at a
// time (as many independent streams, every accumulator in a register), and every 64-byte load is followed by a
// prefetch kPrefetchBytes further on: a weight row of small's projections is 16-32 cache lines, too short a stream
// for the hardware prefetcher to reach full speed on its own.
//
// float32 needs AVX-512F (16 fused multiply-adds per instruction); bfloat16 AVX512_BF16 (vdpbf16ps: 32 products
// per instruction, pairs summed into float32 lanes, inputs and results below float32's normal range flushed to
// zero, as the instruction defines). The sums are ordered differently from oneDNN's or MKL's (rounding only:
// about 1e-7 relative in float32); a bfloat16 result is its float32 sum plus the bias, rounded once to the nearest
// bfloat16 (ties to even), as oneDNN rounds its float32 accumulator. gemv_available(dtype) says whether this build
// has the kernel.
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Sums in the order written (only the attention kernel builds with -ffast-math; this keeps it so if that changes).
#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math", "no-finite-math-only")

namespace {

constexpr int64_t kMaxRows = 4;
constexpr int kBlock = 8;
// 16 KB: the best of 1-32 KB over small's 33 weight matrices for bfloat16 (1.8x oneDNN's time at one row without it:
// 16.7 against 11.4 ms, one core); float32 is the same with or without.
constexpr int64_t kPrefetchBytes = 16384;
// Weight rows per parallel work share: smaller matrices run on the calling thread, where a parallel region costs
// more (fork, barrier) than it saves.
constexpr int64_t kGrainRows = 1024;

#if defined(__AVX512F__)
constexpr bool kHasFloat = true;

// A weight row's chunk of kVector elements, as what the product instruction takes.
struct Float32 {
  using scalar = float;
  using vector = __m512;
  static constexpr int64_t kVector = 16;
  static vector load(const float* p, int64_t valid) {
    return valid >= kVector ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << valid) - 1), p);
  }
  static __m512 multiply_add(__m512 acc, vector x, vector w) { return _mm512_fmadd_ps(x, w, acc); }
  static void store(float* o, float value) { *o = value; }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kHasBFloat16 = true;

struct BFloat16 {
  using scalar = at::BFloat16;
  using vector = __m512bh;
  static constexpr int64_t kVector = 32;
  static vector load(const at::BFloat16* p, int64_t valid) {
    const __m512i bits = valid >= kVector
                             ? _mm512_loadu_si512(p)
                             : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << valid) - 1), p);
    return reinterpret_cast<__m512bh>(bits);
  }
  static __m512 multiply_add(__m512 acc, vector x, vector w) { return _mm512_dpbf16_ps(acc, x, w); }
  static void store(at::BFloat16* o, float value) { *o = at::BFloat16(value); }
};
#else
constexpr bool kHasBFloat16 = false;
#endif

// out[m, j0 : j0 + BLOCK] for ROWS rows: loop bounds are constants, so the BLOCK x ROWS accumulators stay in
// registers.
template <typename T, int ROWS, int BLOCK>
inline void gemv_block(const typename T::scalar* x, const typename T::scalar* w, const float* bias,
                       typename T::scalar* out, int64_t k, int64_t n, int64_t j0) {
  __m512 acc[BLOCK][ROWS];
#pragma GCC unroll 8
  for (int r = 0; r < BLOCK; ++r)
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += T::kVector) {
    const int64_t valid = k - i;
    typename T::vector xv[ROWS];
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) xv[m] = T::load(x + m * k + i, valid);
#pragma GCC unroll 8
    for (int r = 0; r < BLOCK; ++r) {
      const typename T::scalar* row = w + (j0 + r) * k + i;
      const typename T::vector wv = T::load(row, valid);
      _mm_prefetch(reinterpret_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m) acc[r][m] = T::multiply_add(acc[r][m], xv[m], wv);
    }
  }
  // Unrolled as the loops above: a loop here, over acc by a variable index, made GCC 12 keep acc on the stack and
  // store every sum on each step of i.
#pragma GCC unroll 8
  for (int r = 0; r < BLOCK; ++r) {
    const int64_t j = j0 + r;
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) {
      const float sum = _mm512_reduce_add_ps(acc[r][m]);
      T::store(out + m * n + j, bias != nullptr ? sum + bias[j] : sum);
    }
  }
}

template <typename T, int ROWS>
void gemv_rows(const typename T::scalar* x, const typename T::scalar* w, const float* bias, typename T::scalar* out,
               int64_t k, int64_t n, int64_t begin, int64_t end) {
  int64_t j0 = begin;
  for (; j0 + kBlock <= end; j0 += kBlock) gemv_block<T, ROWS, kBlock>(x, w, bias, out, k, n, j0);
  for (; j0 < end; ++j0) gemv_block<T, ROWS, 1>(x, w, bias, out, k, n, j0);
}

template <typename T>
void gemv_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const float* bias) {
  using scalar = typename T::scalar;
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  const scalar* x_ptr = x.data_ptr<scalar>();
  const scalar* w_ptr = w.data_ptr<scalar>();
  scalar* o = out.data_ptr<scalar>();
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: gemv_rows<T, 1>(x_ptr, w_ptr, bias, o, k, n, begin, end); break;
      case 2: gemv_rows<T, 2>(x_ptr, w_ptr, bias, o, k, n, begin, end); break;
      case 3: gemv_rows<T, 3>(x_ptr, w_ptr, bias, o, k, n, begin, end); break;
      case 4: gemv_rows<T, 4>(x_ptr, w_ptr, bias, o, k, n, begin, end); break;
      default: break;  // gemv allows 1 to kMaxRows
    }
  });
}
#else
constexpr bool kHasFloat = false;
constexpr bool kHasBFloat16 = false;
#endif

}  // namespace

namespace splitserve_cpu {

bool gemv_available(at::ScalarType dtype) {
  return (dtype == at::kFloat && kHasFloat) || (dtype == at::kBFloat16 && kHasBFloat16);
}

void gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const auto dtype = w.scalar_type();
  TORCH_CHECK(gemv_available(dtype), "gemv: no kernel for ", dtype, " in this build (gemv_available says which)");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "w: contiguous [out_features, in_features]");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == dtype && x.size(1) == w.size(1),
              "x: contiguous [rows, in_features] in w's dtype");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv takes 1 to ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == dtype && out.size(0) == x.size(0) &&
                  out.size(1) == w.size(0),
              "out: contiguous [rows, out_features] in w's dtype");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == w.size(0) && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias: float32, one per output feature");
    b = bias->data_ptr<float>();
  }
#if defined(__AVX512F__)
  if (dtype == at::kFloat) {
    gemv_typed<Float32>(out, x, w, b);
    return;
  }
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  gemv_typed<BFloat16>(out, x, w, b);
#endif
#endif
}

}  // namespace splitserve_cpu
