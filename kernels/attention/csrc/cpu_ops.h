// The CPU kernels: each registered as torch.ops.splitserve_cpu.<name> (registration_cpu.cpp, its schema; the checks
// are the defining source's); some also called directly by other sources (decoder_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace splitserve_cpu {

// gemv_cpu.cpp: out [rows, n] = x [rows, k] @ w.T (+ bias, float32) for 1-4 rows, float32 or bfloat16.
bool gemv_available(at::ScalarType dtype);
void gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// int8_rows_cpu.cpp: float32 out [rows, n] of 1-4 rows x against an int8 weight per output channel.
bool int8_gemv_available();
void int8_gemv(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& x_scales, const at::Tensor& w,
               const at::Tensor& w_scales, const at::Tensor& w_sums, const c10::optional<at::Tensor>& bias);

// int8_rows_cpu.cpp: q int8 [rows, k] and scales float32 [rows] of x [rows, k] (float32, bfloat16 or float16),
// dynamic symmetric int8 per row.
void quantize_rows_int8(at::Tensor q, at::Tensor scales, const at::Tensor& x);
// int8_rows_cpu.cpp: float32 out = acc (int32 [rows, n]) x row_scales [rows] x col_scales [n] (+ bias), rounded once.
void dequantize_rows(at::Tensor out, const at::Tensor& acc, const at::Tensor& row_scales,
                     const at::Tensor& col_scales, const c10::optional<at::Tensor>& bias);

// int8_panel_linear_cpu.cpp: float32 out [rows, n] of int8 rows x (with their float32 scales) against an int8
// weight in panels of 16 output features ([ceil(n / 16), ceil(k / 2), 16, 2]), AVX2.
bool int8_panel_linear_available();
void int8_panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& panels,
                       const at::Tensor& w_scales, const c10::optional<at::Tensor>& bias);

// panel_linear_cpu.cpp: float32 out [rows, n] = x [rows, k] @ w.T (+ bias) over w laid out in panels of 32 output
// features ([ceil(n / 32), k, 32]); AVX-512F or AVX2.
bool panel_linear_available();
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias);

// amx_linear_cpu.cpp: bfloat16 out [rows, n] = x [rows, k] @ w.T (+ bias, float32) over the dense bfloat16 weight,
// with AMX tiles (float32 sums, rounded once).
bool amx_linear_available();
void amx_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// layer_ops_cpu.cpp: a decoder layer's elementwise work (add_rms_norm: of rows, or of each head of [tokens, heads,
// head_size]).
void add_rms_norm(at::Tensor out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                  const at::Tensor& weight, double eps);
void rotary_in_place(at::Tensor x, const at::Tensor& cos, const at::Tensor& signed_sin);
void silu_and_mul(at::Tensor out, const at::Tensor& x);

// argmax_cpu.cpp: out int64 [rows], the first index of each row's maximum (or first NaN) of float32 x [rows, n].
void argmax_rows(at::Tensor out, const at::Tensor& x);

// paged_attention_cpu.cpp: decode attention over the paged KV cache, after the new keys and values are stored.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window);
void decode_attention_with_kv_write(at::Tensor out, const at::Tensor& query, const at::Tensor& key,
                                    const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                                    const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                    const at::Tensor& seq_lens, double scale, int64_t sliding_window);

// prefill_attention_cpu.cpp: causal attention of the prefill requests' query tokens over the paged KV cache, after
// the step's keys and values are stored.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const at::Tensor& query_start_loc, int64_t first_request, double scale,
                             int64_t sliding_window);

}  // namespace splitserve_cpu
