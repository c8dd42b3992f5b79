// bfloat16 matrix products on Intel AMX over a dense weight: out [M, N] = x [M, K] @ w.T (+ bias), w the weight
// as loaded ([out_features, in_features], row-major), float32 sums, each result rounded once to bfloat16.
//
// Why: oneDNN multiplies bfloat16 on AMX fast only over its own blocked copy of the weight
// (torch.ops.mkldnn._reorder_linear_weight), whose one-row product reads the weight at about half the rate of the
// compiled matrix-vector kernel (gemv_cpu.cpp) on the dense weight; keeping both layouts doubles the weights'
// memory (--dense-decode-weights). This kernel multiplies the dense weight itself at batch and prefill row counts,
// so one dense weight serves every step: gemv up to 4 rows, this kernel above (docs/benchmarks.md, "bfloat16 on
// AMX over the dense weight").
//
// How (Intel Architecture Instruction Set Extensions Programming Reference, ch. 3, "Intel AMX"): tdpbf16ps
// multiplies a 16 x 32 bfloat16 tile A by a 16 x 32 tile B whose rows hold pairs of consecutive k ("VNNI" layout)
// into 16 x 16 float32 sums. The kernel computes the transposed product, out.T = w @ x.T: A is 16 weight rows x 32
// in_features, loaded straight from the dense weight (rows at their stride); B is x re-laid once per call into
// those pairs (16 rows of x per tile, contiguous 1 KiB tiles); each 16 x 16 float32 block of out.T is transposed
// in registers on the way out. Tiles: C0-C3 sums of 2 weight blocks x 2 row blocks, A4-A5, B6-B7. The weight is
// walked 32 output features at a time (a 32 x in_features block, re-read from L1/L2 for every 32 rows of x, at
// most kRowChunk rows per walk), and a block further on is prefetched into L2 while the current one is
// multiplied: tile loads wait for their data in order, so without the prefetch every block's first pass waits on
// memory. Threads share out the 32-feature blocks (kShareMultiplyAdds each at least), every output computed by one
// of them in the same order, so a result does not depend on the thread count.
//
// Where it pays (python -m benchmarks.gemv, docs/benchmarks.md): at 5-256 rows, about oneDNN's packed product's
// time on small's projections (often less), and 1.0-1.4x its time on the 32,000-wide LM head; from 512 rows it and
// oneDNN's own product of the dense weight (which repacks it per call) were each within about 10% of the packed
// product, so core_svc/models/layers.py leaves those rows to oneDNN.
//
// Needs in_features % 32 == 0 and out_features % 16 == 0 (every decoder projection and LM head of the supported
// families; other shapes keep oneDNN's path, core_svc/models/layers.py), a build with AMX-BF16 and AVX512_BF16,
// and the kernel's permission to use the tile registers (Linux's arch_prctl(ARCH_REQ_XCOMP_PERM)).
// amx_linear_available() says whether all of that holds. tdpbf16ps and vcvtneps2bf16 flush inputs and results
// below float32's normal range to zero, as oneDNN's AMX path does; the sums are ordered differently from oneDNN's
// (rounding only).
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SPLITSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileK = 32;  // in_features per A tile (64 bytes of bfloat16)
constexpr int64_t kTileN = 16;  // output features per A tile, and rows of x per B tile
// Rows of x per walk over the weight: the walk's re-laid x (kRowChunk x in_features bfloat16, 256-704 KiB for
// small's projections) stays in L2. The best of 64-1024 for 256- and 2048-row products over small's projections
// (64: 1.4x the time at 256 rows; 256-1024 within 5%).
constexpr int64_t kRowChunk = 256;
// How many 32-feature blocks ahead the weight is prefetched into L2 (1-8 measured at 64 and 256 rows over small's
// projections and LM head: 2 the best or within noise of it).
constexpr int64_t kPrefetchBlocks = 2;
// Multiply-adds per parallel work share, at least (about 10 us of AMX work): a product of at most one share runs on
// the calling thread, where a parallel region costs more than it saves; a larger one is split over 32-feature blocks
// whatever its shape (a decode batch's 1024-feature qkv projection of small at 64 rows, 32M multiply-adds, is
// eight shares of four blocks).
constexpr int64_t kShareMultiplyAdds = int64_t{4} << 20;
// Pairs of x re-laid per parallel work share.
constexpr int64_t kShareRelayoutPairs = int64_t{1} << 16;

#if defined(SPLITSERVE_AMX)
constexpr int kArchReqXcompPerm = 0x1023;  // linux/arch/x86/include/uapi/asm/prctl.h
constexpr int kXfeatureXtiledata = 18;

bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
}

// The 64-byte tile configuration ldtilecfg reads (palette 1): every tile used is 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// In place: r[i] lane j becomes r[j] lane i (16 x 16 32-bit elements).
inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// x [rows, k] (k / 2 a multiple of 16) as pairs: packed[block][k / 2][16] 32-bit pairs, block = 16 rows of x,
// `padded` rows in all, those past `rows` zero. A B tile (16 pairs of k x 16 rows) is then 1 KiB contiguous.
void relayout_rows(const uint32_t* x, int64_t rows, int64_t padded, int64_t k_pairs, uint32_t* packed) {
  const int64_t grain = std::max<int64_t>(1, kShareRelayoutPairs / (kTileN * k_pairs));
  at::parallel_for(0, padded / kTileN, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t valid = std::clamp<int64_t>(rows - b * kTileN, 0, kTileN);
      for (int64_t p = 0; p < k_pairs; p += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
          r[i] = i < valid ? _mm512_loadu_si512(x + (b * kTileN + i) * k_pairs + p) : _mm512_setzero_si512();
        }
        transpose_16x16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(packed + (b * k_pairs + p + i) * kTileN, r[i]);
      }
    }
  });
}

// A 16 x 16 float32 block of out.T (sums[feature][row]) into out rows row0.. (at most `rows` of them), features
// feature0..feature0 + 15, plus the bias, rounded to bfloat16.
inline void store_block(const float* sums, const float* bias, c10::BFloat16* out, int64_t n, int64_t row0,
                        int64_t rows, int64_t feature0) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums + 16 * i);
  transpose_16x16(r);
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias + feature0);
  for (int64_t i = 0; i < rows; ++i) {
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_castsi512_ps(r[i]), b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (row0 + i) * n + feature0), (__m256i)v);
  }
}

// Features [feature0, feature0 + 16 * kBlocks) of rows [row0, row0 + 32) (rows past `rows` are padding): C tiles
// summed over every k, then stored. kBlocks is 2 (the usual 32 features) or 1 (a last block of 16). Meanwhile
// `prefetch_rows` weight rows from `prefetch` on are brought into L2, a 64-byte line of each per step of k.
template <int kBlocks>
void multiply_block(const c10::BFloat16* w, const c10::BFloat16* packed, const float* bias, c10::BFloat16* out,
                    int64_t n, int64_t k, int64_t rows, int64_t row0, int64_t feature0, const c10::BFloat16* prefetch,
                    int64_t prefetch_rows) {
  const int64_t k_pairs = k / 2;
  const c10::BFloat16* b0 = packed + (row0 / kTileN) * k_pairs * 2 * kTileN;
  const c10::BFloat16* b1 = b0 + k_pairs * 2 * kTileN;
  const c10::BFloat16* a0 = w + feature0 * k;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kBlocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kk = 0; kk < k; kk += kTileK) {
    for (int64_t i = 0; i < prefetch_rows; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + i * k + kk), _MM_HINT_T1);
    }
    _tile_loadd(4, a0 + kk, k * 2);
    _tile_loadd(6, b0 + kk * kTileN, 64);
    _tile_loadd(7, b1 + kk * kTileN, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kBlocks == 2) {
      _tile_loadd(5, a0 + kTileN * k + kk, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[kTileN * kTileN];
  const int64_t rows0 = std::clamp<int64_t>(rows - row0, 0, kTileN);
  const int64_t rows1 = std::clamp<int64_t>(rows - row0 - kTileN, 0, kTileN);
  _tile_stored(0, sums, 64);
  store_block(sums, bias, out, n, row0, rows0, feature0);
  _tile_stored(1, sums, 64);
  store_block(sums, bias, out, n, row0 + kTileN, rows1, feature0);
  if constexpr (kBlocks == 2) {
    _tile_stored(2, sums, 64);
    store_block(sums, bias, out, n, row0, rows0, feature0 + kTileN);
    _tile_stored(3, sums, 64);
    store_block(sums, bias, out, n, row0 + kTileN, rows1, feature0 + kTileN);
  }
}
#endif

}  // namespace

namespace splitserve_cpu {

bool amx_linear_available() {
#if defined(SPLITSERVE_AMX)
  return tiles_permitted();
#else
  return false;
#endif
}

void amx_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_linear_available(),
              "amx_linear: this build or CPU has no AMX-BF16 kernel (amx_linear_available says whether it has)");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "w: contiguous bfloat16 [out_features, in_features], got ", w.scalar_type(), " ", w.sizes(),
              w.is_contiguous() ? "" : " (not contiguous)");
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(k % kTileK == 0 && k > 0, "w: in_features must be a positive multiple of ", kTileK, ", got ", k);
  TORCH_CHECK(n % kTileN == 0 && n > 0, "w: out_features must be a positive multiple of ", kTileN, ", got ", n);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) == k && x.size(0) > 0,
              "x: contiguous bfloat16 [rows, in_features=", k, "] with at least one row, got ", x.scalar_type(), " ",
              x.sizes(), x.is_contiguous() ? "" : " (not contiguous)");
  const int64_t rows = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.size(0) == rows &&
                  out.size(1) == n,
              "out: contiguous bfloat16 [rows, out_features] = [", rows, ", ", n, "], got ", out.scalar_type(), " ",
              out.sizes(), out.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(!out.is_alias_of(w), "out: must not share memory with w");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n && bias->is_contiguous() && bias->scalar_type() == at::kFloat,
                "bias: float32, one per output feature");
    b = bias->data_ptr<float>();
  }
#if defined(SPLITSERVE_AMX)
  const int64_t padded = (rows + 2 * kTileN - 1) / (2 * kTileN) * (2 * kTileN);
  at::Tensor packed = at::empty({padded, k}, x.options());
  relayout_rows(reinterpret_cast<const uint32_t*>(x.data_ptr()), rows, padded, k / 2,
                reinterpret_cast<uint32_t*>(packed.data_ptr()));
  const c10::BFloat16* w_ptr = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* p_ptr = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* o_ptr = out.data_ptr<c10::BFloat16>();
  const int64_t blocks = (n + 2 * kTileN - 1) / (2 * kTileN);  // of 32 features; a last one of 16 if n % 32
  const int64_t grain = std::max<int64_t>(1, kShareMultiplyAdds / (2 * kTileN * k * padded));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t chunk = 0; chunk < padded; chunk += kRowChunk) {
      const int64_t chunk_end = std::min(padded, chunk + kRowChunk);
      // the 32 weight rows kPrefetchBlocks blocks on, spread over the chunk's passes of 32 rows
      const int64_t passes = (chunk_end - chunk) / (2 * kTileN);
      const int64_t rows_per_pass = (2 * kTileN + passes - 1) / passes;
      for (int64_t block = begin; block < end; ++block) {
        const int64_t feature0 = block * 2 * kTileN;
        const int64_t ahead = feature0 + kPrefetchBlocks * 2 * kTileN;  // first feature of the block to prefetch
        const bool prefetch = block + kPrefetchBlocks < end && ahead + 2 * kTileN <= n;
        for (int64_t row0 = chunk, pass = 0; row0 < chunk_end; row0 += 2 * kTileN, ++pass) {
          const int64_t first = pass * rows_per_pass;
          const int64_t count = prefetch ? std::clamp<int64_t>(2 * kTileN - first, 0, rows_per_pass) : 0;
          const c10::BFloat16* from = count > 0 ? w_ptr + (ahead + first) * k : nullptr;
          if (feature0 + 2 * kTileN <= n) {
            multiply_block<2>(w_ptr, p_ptr, b, o_ptr, n, k, rows, row0, feature0, from, count);
          } else {
            multiply_block<1>(w_ptr, p_ptr, b, o_ptr, n, k, rows, row0, feature0, from, 0);
          }
        }
      }
    }
    _tile_release();
  });
#endif
}

}  // namespace splitserve_cpu
