// What the attention kernels share (paged_attention_cpu.cpp, prefill_attention_cpu.cpp): the head size as a constant
// or a run-time value, their softmax's exp, and the dtypes they read and write: the cache in the query's dtype, or
// bfloat16 / float16 under float32 queries (--kv-cache-dtype), and float32 sums rounded to the output's dtype.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace splitserve_cpu {

// HEAD: the head size as a constant (64, 128: every inner loop then has a constant trip count, fully unrolled and
// vectorized), or 0 for any size read at run time.
template <int HEAD>
struct HeadSize {
  explicit HeadSize(int64_t) {}
  static constexpr int64_t value() { return HEAD; }
};
template <>
struct HeadSize<0> {
  explicit HeadSize(int64_t size) : size_(size) {}
  int64_t value() const { return size_; }
  int64_t size_;
};

// exp(x) for x <= 0 (above -87.3 the result is a normal float; below it, what exp(-87.3) is), within 5 ulps (4.5
// at most measured, near -86, in the attention sources' -ffast-math build): Cody and Waite's reduction
// x = n ln 2 + r, |r| <= ln 2 / 2, and Cephes' degree-6 polynomial for exp(r) (S. L. Moshier, Cephes Mathematical
// Library, expf.c), scaled by 2^n through the exponent's bits. Plain arithmetic, inlined, so the loops that call it
// are vectorized whatever the build: glibc's vector expf (libmvec) hands a vector with any lane below about -87, as
// every masked score is, to its scalar routine. layer_ops_cpu.cpp's exp_poly has the same polynomial but rounds n by
// adding and subtracting 1.5 * 2^23, which -ffast-math may fold away; here n comes from floor.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// x converted to T (a key or value as the cache stores it, an output row in the query's dtype). float to bfloat16
// rounds to nearest even, as c10's conversion and torch's .to() do, and keeps a NaN a NaN: the attention sources are
// built with -ffast-math, under which c10's std::isnan test folds away (a NaN with a full payload rounded to -0.0),
// so the test here is on the bits.
template <typename T, typename S>
inline T convert(S x) {
  return static_cast<T>(x);
}
template <>
inline c10::BFloat16 convert<c10::BFloat16, float>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return c10::BFloat16(0x7fc0, c10::BFloat16::from_bits());
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// f(scalar_t{}, cache_t{}) for the query's dtype and the cache's: the same dtype, or bfloat16 / float16 under
// float32 queries; any other pair is refused, naming both.
template <typename F>
void dispatch_cache_dtype(const at::Tensor& query, const at::Tensor& key_cache, F&& f) {
  const at::ScalarType q = query.scalar_type(), c = key_cache.scalar_type();
  TORCH_CHECK(c == q || (q == at::kFloat && (c == at::kBFloat16 || c == at::kHalf)),
              "the cache's dtype must be the query's, or bfloat16 or float16 under float32 queries; got a ", c,
              " cache under ", q, " queries");
  if (c == q) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q, "paged_attention",
                                    [&] { f(scalar_t{}, scalar_t{}); });
  } else {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(c, "paged_attention", [&] { f(float{}, scalar_t{}); });
  }
}

}  // namespace splitserve_cpu
