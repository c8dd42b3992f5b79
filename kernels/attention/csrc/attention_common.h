// What the attention kernels share (paged_attention_cpu.cpp, prefill_attention_cpu.cpp): the head size as a constant
// or a run-time value, and the dtypes they read and write: the cache in the query's dtype, or bfloat16 / float16
// under float32 queries (--kv-cache-dtype), and float32 sums rounded to the output's dtype.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>

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
