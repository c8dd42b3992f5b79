// The greedy token of each row of a decode step's float32 logits in one call (core_svc/sampler.py argmax): torch's
// argmax semantics, the first index among equal maxima and the first NaN where a row holds one. One call instead
// of the eight small torch operators of the two-stage argmax, each of which pays to bring its code back into caches
// that the LM head's weights have just filled (docs/benchmarks.md); 6 against 24 us for one row in a loop.
#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#pragma GCC optimize("no-unsafe-math-optimizations", "no-trapping-math", "no-finite-math-only")

namespace {

// Logits per parallel work share, at least (two rows of a 32,000-token vocabulary): one row stays on the calling
// thread, a 64-row step splits over the threads (0.48 ms of a two-thread step on one thread before).
constexpr int64_t kGrainElements = int64_t{1} << 16;

int64_t row_argmax(const float* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_set1_ps(best);
  __mmask16 unordered = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    vmax = _mm512_max_ps(vmax, v);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  best = _mm512_reduce_max_ps(vmax);
  if (unordered != 0) best = std::numeric_limits<float>::quiet_NaN();
#elif defined(__AVX2__)
  // the same in 8-float vectors: without it an AVX2 CPU took the scalar loop, 4.7 ms per 64-row step of a
  // 32,000-token vocabulary (docs/benchmarks.md, "argmax on AVX2")
  __m256 vmax = _mm256_set1_ps(best);
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    vmax = _mm256_max_ps(vmax, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  best = _mm_cvtss_f32(m4);
  if (_mm256_movemask_ps(unordered) != 0) best = std::numeric_limits<float>::quiet_NaN();
#endif
  for (; i < n; ++i) {
    if (__builtin_isnan(row[i])) best = row[i];
    if (!__builtin_isnan(best) && row[i] > best) best = row[i];
  }
  const bool nan = __builtin_isnan(best);
  // the first index holding the maximum (or the first NaN)
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(row + j);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit != 0) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#elif defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(row + j);
    const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hit != 0) return j + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; j < n; ++j) {
    if (nan ? __builtin_isnan(row[j]) : row[j] == best) return j;
  }
  return 0;  // every value -inf: torch's argmax gives the first, 0 (an empty row is refused below)
}

}  // namespace

namespace splitserve_cpu {

// out: [num_rows] int64; x: [num_rows, vocab_size] float32, rows contiguous.
void argmax_rows(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "x: float32 [num_rows, vocab_size] with contiguous rows");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.is_contiguous() && out.scalar_type() == at::kLong,
              "out: contiguous int64 [num_rows]");
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, kGrainElements / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(base + r * stride, n);
  });
}

}  // namespace splitserve_cpu
