// A decoder layer's elementwise work between its matrix products, one call each instead of torch's 5-8 operators
// (core_svc/models/llama.py, every forward on CPU):
// - add_rms_norm: residual += x (when given), then out = weight * rms_norm(residual) (Zhang & Sennrich 2019), of
//   each row, or of each head of a [tokens, heads, head_size] view (Qwen3's per-head q/k norms);
// - rotary_in_place: RoPE (Su et al. 2021) as core_svc/models/layers.py's apply_rotary, on a view of the fused qkv;
// - silu_and_mul: out = silu(gate) * up of a fused gate_up row (SwiGLU, Shazeer 2020).
// Why a call each: after a matrix product has streamed megabytes of weights through the core's caches, every
// torch operator pays to bring its own code and data back (docs/benchmarks.md, "Matrix-vector kernels for one
// request": an RMSNorm took 43 us after a product against 16 us without one), so one request's decode step spent
// milliseconds in a layer's 20-odd small operators; and a batch's activations are read and written once per call
// instead of once per operator.
//
// Each rounds where transformers' modules round: every operation in float32, its result rounded to the tensors'
// dtype where torch's operator would (the residual sum, RMSNorm's normalized value before the weight's product,
// each RoPE product and their sum, SiLU and its product). What differs: RMSNorm's mean of squares is summed in
// float64 and rounded once (torch sums float32 in its own order), and SiLU's exp is Cephes' polynomial (exp_poly,
// vectorized; torch's is SLEEF's): up to 4 float32 ulps apart measured (hidden size 3584); in bfloat16 a normed value
// now and then rounds to the neighbouring value (2.7% of a small model's outputs one ulp apart in one case of 8).
// The file builds without -ffast-math (kernels/attention/cpu_ops.py), which would call libmvec's less exact expf.
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <utility>
#include <vector>

// Rounds as the operators above: no reassociation, no contraction of a product and a sum into one rounding.
#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math", "no-finite-math-only", "fp-contract=off")

namespace {

// Elements per parallel work share: a region for less costs more (fork, barrier) than it saves.
constexpr int64_t kGrainElements = 1 << 16;

template <typename T>
inline T round_to(float v) {
  return static_cast<T>(v);
}

// e^x in float32 without a call, so that a loop over it vectorizes: Cephes' expf (Moshier 1992): x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two so n ln2 subtracts exactly), a degree-6 polynomial for e^r, times 2^n built in
// the exponent bits (as 2^(n-1) * 2, so that n = 128 stays finite up to float32's overflow at x = 88.72). n is
// rounded by adding 1.5 * 2^23, which leaves it in the low mantissa bits (floorf would keep GCC from vectorizing).
// Measured against torch's exp: silu's float32 results 0.6% one ulp apart. x is clamped to [-86.5, 88.8]: e^x
// below -86.5 gives e^-86.5 (1 + e^x is 1 either way), above 88.72 inf; NaN stays NaN.
inline float exp_poly(float x) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  x = std::min(std::max(x, -86.5f), 88.8f);
  const float shifted = x * 1.44269504088896341f + kRound;
  const float n = shifted - kRound;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * (r * r) + r + 1.0f;
  const int32_t n_int = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kRound);  // -125 .. 128
  return e_r * std::bit_cast<float>((n_int - 1 + 127) << 23) * 2.0f;
}

template <typename scalar_t>
void add_rms_norm_rows(scalar_t* out, const scalar_t* x, scalar_t* residual, const scalar_t* weight, float eps,
                       int64_t begin, int64_t end, int64_t hidden, int64_t x_stride, int64_t out_stride,
                       int64_t residual_stride) {
  std::vector<float> row(hidden);
  for (int64_t r = begin; r < end; ++r) {
    const scalar_t* x_row = x + r * x_stride;
    if (residual != nullptr) {
      scalar_t* res_row = residual + r * residual_stride;
      for (int64_t i = 0; i < hidden; ++i) {
        res_row[i] = round_to<scalar_t>(static_cast<float>(res_row[i]) + static_cast<float>(x_row[i]));
        row[i] = static_cast<float>(res_row[i]);
      }
    } else {
      for (int64_t i = 0; i < hidden; ++i) row[i] = static_cast<float>(x_row[i]);
    }
    double sum = 0.0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += static_cast<double>(row[i]) * static_cast<double>(row[i]);
    const float mean = static_cast<float>(sum / static_cast<double>(hidden));
    const float inv = 1.0f / __builtin_sqrtf(mean + eps);
    scalar_t* out_row = out + r * out_stride;
    for (int64_t i = 0; i < hidden; ++i) {
      const scalar_t normed = round_to<scalar_t>(row[i] * inv);
      out_row[i] = round_to<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
    }
  }
}

// out[i] = silu(gate[i]) * up[i], up = gate + inter; each rounded to the dtype as torch's silu and mul round.
template <typename scalar_t>
void silu_and_mul_row(scalar_t* out, const scalar_t* gate, int64_t inter) {
  const scalar_t* up = gate + inter;
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) {
    const float g = static_cast<float>(gate[i]);
    const scalar_t act = round_to<scalar_t>(g / (1.0f + exp_poly(-g)));
    out[i] = round_to<scalar_t>(static_cast<float>(act) * static_cast<float>(up[i]));
  }
}

}  // namespace

namespace splitserve_cpu {

// x, out: [rows, hidden] (rows at any stride, each contiguous), or [tokens, heads, head_size] with heads contiguous
// within a token (a view of the fused qkv: per-head q/k norms, Qwen3's, normalize each head's row); residual: x's
// shape, 2-D only.
void add_rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 && x.stride(1) == 1) || (x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2)),
              "x: [rows, hidden] with contiguous rows, or [tokens, heads, head_size] contiguous within a token");
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(-1) == 1 && (x.dim() == 2 || out.stride(1) == out.size(2)) &&
                  out.scalar_type() == x.scalar_type(),
              "out: x's shape and dtype, laid out as x");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == hidden && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: [hidden] in x's dtype");
  // Rows apart (a token's rows inside its stride) and out either x itself or apart from it: rows are normalized one
  // at a time, in parallel across tokens.
  const int64_t row_extent = x.dim() == 3 ? x.size(1) * x.size(2) : hidden;
  TORCH_CHECK(x.size(0) <= 1 || (x.stride(0) >= row_extent && out.stride(0) >= row_extent),
              "x and out: a token's row(s) may not overlap the next token's");
  const bool same = out.data_ptr() == x.data_ptr() && out.strides() == x.strides();
  if (!same && x.numel() > 0) {
    const int64_t item = x.element_size();
    const auto span = [&](const at::Tensor& t) {
      const char* first = static_cast<const char*>(t.data_ptr());
      return std::pair{first, first + ((t.size(0) - 1) * t.stride(0) + row_extent) * item};
    };
    const auto [x_begin, x_end] = span(x);
    const auto [out_begin, out_end] = span(out);
    TORCH_CHECK(out_end <= x_begin || x_end <= out_begin, "out must be x itself (in place) or not overlap it");
  }
  if (residual.has_value()) {
    TORCH_CHECK(x.dim() == 2 && residual->dim() == 2 && residual->sizes() == x.sizes() &&
                    residual->stride(1) == 1 && residual->scalar_type() == x.scalar_type(),
                "residual: x's shape and dtype, [rows, hidden] with contiguous rows");
  }
  // [tokens, heads, head_size]: a token's heads are rows one head_size apart
  const int64_t tokens = x.size(0), rows_per_token = x.dim() == 3 ? x.size(1) : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* res = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    const int64_t res_stride = residual.has_value() ? residual->stride(0) : 0;
    const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(hidden * rows_per_token, 1));
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
      if (rows_per_token == 1) {
        add_rms_norm_rows(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), res, weight.data_ptr<scalar_t>(),
                          static_cast<float>(eps), begin, end, hidden, x.stride(0), out.stride(0), res_stride);
        return;
      }
      for (int64_t t = begin; t < end; ++t) {
        add_rms_norm_rows(out.data_ptr<scalar_t>() + t * out.stride(0), x.data_ptr<scalar_t>() + t * x.stride(0),
                          static_cast<scalar_t*>(nullptr), weight.data_ptr<scalar_t>(), static_cast<float>(eps), 0,
                          rows_per_token, hidden, hidden, hidden, 0);
      }
    });
  });
}

// x: [tokens, heads, head_size], heads and elements contiguous within a token (a view of the fused qkv);
// cos, signed_sin: [tokens, head_size] contiguous (RotaryEmbedding.tables, the first half of sin negated).
// x[i] <- x[i] * cos[i] + x[(i + half) % head_size] * signed_sin[i], each product and the sum rounded to the dtype.
void rotary_in_place(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x: [tokens, heads, head_size], contiguous within a token");
  const int64_t tokens = x.size(0), heads = x.size(1), head_size = x.size(2), half = head_size / 2;
  TORCH_CHECK(head_size % 2 == 0, "head_size must be even");
  for (const at::Tensor* table : {&cos, &signed_sin}) {
    TORCH_CHECK(table->is_contiguous() && table->numel() == tokens * head_size &&
                    table->scalar_type() == x.scalar_type(),
                "cos and signed_sin: [tokens, head_size] contiguous in x's dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary_in_place", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    const scalar_t* c = cos.data_ptr<scalar_t>();
    const scalar_t* s = signed_sin.data_ptr<scalar_t>();
    const int64_t token_stride = x.stride(0);
    at::parallel_for(0, tokens * heads, std::max<int64_t>(1, kGrainElements / head_size), [&](int64_t begin,
                                                                                              int64_t end) {
      std::vector<float> row(head_size);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t t = item / heads, h = item % heads;
        scalar_t* v = base + t * token_stride + h * head_size;
        const scalar_t* ct = c + t * head_size;
        const scalar_t* st = s + t * head_size;
        for (int64_t i = 0; i < head_size; ++i) row[i] = static_cast<float>(v[i]);
        for (int64_t i = 0; i < head_size; ++i) {
          const float rolled = row[i < half ? i + half : i - half];
          const scalar_t a = round_to<scalar_t>(row[i] * static_cast<float>(ct[i]));
          const scalar_t b = round_to<scalar_t>(rolled * static_cast<float>(st[i]));
          v[i] = round_to<scalar_t>(static_cast<float>(a) + static_cast<float>(b));
        }
      }
    });
  });
}

// x: [rows, 2 * intermediate] contiguous (gate, then up); out: [rows, intermediate] contiguous.
void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0, "x: contiguous [rows, 2 * intermediate]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == rows && out.size(1) == inter &&
                  out.scalar_type() == x.scalar_type(),
              "out: contiguous [rows, intermediate] in x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrainElements / std::max<int64_t>(inter, 1)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t r = begin; r < end; ++r) silu_and_mul_row(o + r * inter, in + r * 2 * inter, inter);
                     });
  });
}

}  // namespace splitserve_cpu
