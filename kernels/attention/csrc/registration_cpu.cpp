// The schemas of torch.ops.splitserve_cpu.*, each bound to its kernel (declared in cpu_ops.h, defined in the source
// named above it); OneCallDecoder's class registers itself in decoder_cpu.cpp, the only other source that includes
// <torch/library.h>: each source that did spent about 10 s of the build parsing it, against 4 for
// <ATen/core/Tensor.h>, which the kernels need (docs/benchmarks.md, "The kernels' build").
#include "cpu_ops.h"

#include <torch/library.h>

TORCH_LIBRARY(splitserve_cpu, m) {
  // paged_attention_cpu.cpp
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, float scale, int sliding_window) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &splitserve_cpu::paged_decode_attention);
  m.def("decode_attention_with_kv_write(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
        "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping, Tensor block_table, Tensor seq_lens, "
        "float scale, int sliding_window) -> ()");
  m.impl("decode_attention_with_kv_write", c10::DispatchKey::CPU, &splitserve_cpu::decode_attention_with_kv_write);
  // prefill_attention_cpu.cpp
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, int first_request, float scale, "
        "int sliding_window) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &splitserve_cpu::paged_prefill_attention);
  // int8_rows_cpu.cpp
  m.def("int8_gemv(Tensor(a!) out, Tensor x, Tensor? x_scales, Tensor w, Tensor w_scales, Tensor w_sums, "
        "Tensor? bias) -> ()");
  m.impl("int8_gemv", c10::DispatchKey::CPU, &splitserve_cpu::int8_gemv);
  m.def("int8_gemv_available() -> bool");
  m.impl("int8_gemv_available", &splitserve_cpu::int8_gemv_available);
  m.def("quantize_rows_int8(Tensor(a!) q, Tensor(b!) scales, Tensor x) -> ()");
  m.impl("quantize_rows_int8", c10::DispatchKey::CPU, &splitserve_cpu::quantize_rows_int8);
  m.def("dequantize_rows(Tensor(a!) out, Tensor acc, Tensor row_scales, Tensor col_scales, Tensor? bias) -> ()");
  m.impl("dequantize_rows", c10::DispatchKey::CPU, &splitserve_cpu::dequantize_rows);
  // gemv_cpu.cpp
  m.def("gemv(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
  m.impl("gemv", c10::DispatchKey::CPU, &splitserve_cpu::gemv);
  m.def("gemv_available(ScalarType dtype) -> bool");
  m.impl("gemv_available", &splitserve_cpu::gemv_available);
  // layer_ops_cpu.cpp
  m.def("add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &splitserve_cpu::add_rms_norm);
  m.def("rotary_in_place(Tensor(a!) x, Tensor cos, Tensor signed_sin) -> ()");
  m.impl("rotary_in_place", c10::DispatchKey::CPU, &splitserve_cpu::rotary_in_place);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &splitserve_cpu::silu_and_mul);
  // argmax_cpu.cpp
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &splitserve_cpu::argmax_rows);
  // amx_linear_cpu.cpp
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor w, Tensor? bias) -> ()");
  m.impl("amx_linear", c10::DispatchKey::CPU, &splitserve_cpu::amx_linear);
  m.def("amx_linear_available() -> bool");
  m.impl("amx_linear_available", &splitserve_cpu::amx_linear_available);
  // panel_linear_cpu.cpp
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor panels, Tensor? bias) -> ()");
  m.impl("panel_linear", c10::DispatchKey::CPU, &splitserve_cpu::panel_linear);
  m.def("panel_linear_available() -> bool");
  m.impl("panel_linear_available", &splitserve_cpu::panel_linear_available);
  // int8_panel_linear_cpu.cpp
  m.def("int8_panel_linear(Tensor(a!) out, Tensor x, Tensor x_scales, Tensor panels, Tensor w_scales, "
        "Tensor? bias) -> ()");
  m.impl("int8_panel_linear", c10::DispatchKey::CPU, &splitserve_cpu::int8_panel_linear);
  m.def("int8_panel_linear_available() -> bool");
  m.impl("int8_panel_linear_available", &splitserve_cpu::int8_panel_linear_available);
}
