// A decode step through a whole Llama-family decoder in one call (OneCallDecoder.forward), for
// core_svc/models/llama.py: the layers of LlamaModel's fused path (DecoderLayer.forward_fused), their kernels
// and products called from here, in its order and on its values, so the results are that path's bit for bit.
//
// Why: with every matrix product a compiled pass over its weight, one request's decode step still spent
// milliseconds between the passes, in Python and in torch's dispatch of 20-odd calls per layer (allocations, views,
// argument parsing), each after a weight pass had pushed its code and data out of the core's caches
// (docs/benchmarks.md, "One call per decode step"). Here a layer is ten C++ calls on buffers allocated once per step.
// A batch's step spends the same time between the passes: one call took 0.80-0.92x the time of a 16- to 64-row
// step's forward of small ("One call per decode step of a batch").
//
// What it covers (the Python side decides, core_svc/models/one_call_decoder.py): rows that are each one request's
// one new token (a decode-only step), 1-4 of them where a projection runs gemv or int8_gemv (those kernels' limit),
// any number where every projection runs panel_linear, int8_panel_linear, amx_linear or torch's products (the kinds
// Projection lists); RMSNorm, optional per-head q/k RMSNorm (Qwen3), RoPE from the step's cos / signed-sin rows,
// GQA, sliding windows, SiLU-gated MLPs.
#include "cpu_ops.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace {

constexpr int64_t kGemvMaxRows = 4;  // gemv's and int8_gemv's limit
constexpr int64_t kAnyRows = std::numeric_limits<int64_t>::max();

// oneDNN's product with a weight reordered into its own layout (torch.ops.mkldnn._linear_pointwise, what
// core_svc/models/layers.py's Linear runs on a prepacked weight), found once.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                            c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
}

// A step's buffers for int8 weights, sized for its widest projection: wide, float32, the results under non-float32
// activations (int8_gemv's and int8_panel_linear's, then rounded once, as Int8Linear's .to(dtype)); x_int8 (int8)
// and x_scales (float32, one per row): the activations quantized for int8_panel_linear.
struct Scratch {
  at::Tensor wide, x_int8, x_scales;

  // wide's first out.numel() values as out's shape.
  at::Tensor wide_rows(const at::Tensor& out) const { return wide.narrow(0, 0, out.numel()).view(out.sizes()); }
};

// One linear layer, run as Linear.forward / Int8Linear.forward run it at 1-4 rows:
// - kGemv: weight dense [out_features, in_features] in the activations' dtype, through gemv; bias float32;
// - kInt8: weight int8 with float32 scales and int32 row sums, through int8_gemv; bias float32;
// - kPanels: weight float32 in panels of 32 output features ([ceil(out_features / 32), in_features, 32]), through
//   panel_linear; bias float32;
// - kInt8Panels: weight int8 in panels of 16 output features ([ceil(out_features / 16), ceil(in_features / 2), 16,
//   2]) with float32 scales per output feature, through quantize_rows_int8 and int8_panel_linear; bias float32;
// - kTorch: torch's own products: at::linear on the weight (row- or column-major) up to dense_max_rows rows, else
//   oneDNN's on the packed one (either may be absent where the other serves every row count); bias in the
//   activations' dtype;
// - kW8A8: weight int8 [out_features, in_features] with float32 scales per output feature, the activations quantized
//   per row (quantize_rows_int8), torch's exact int32 product (at::_int_mm), then dequantize_rows; bias float32
//   (quantization.py's int8_linear_w8a8, Int8Linear's route above 4 rows where that product is exact);
// - kAmx: weight dense bfloat16 through amx_linear up to dense_max_rows rows (layers.py's AMX_MAX_ROWS), at::linear
//   above (layers.py's amx_linear); bias float32 (rounded back to bfloat16 for at::linear: the module's own).
struct Projection {
  enum class Kind { kGemv, kInt8, kTorch, kPanels, kInt8Panels, kW8A8, kAmx };
  Kind kind = Kind::kGemv;
  at::Tensor weight, packed;
  int64_t features = 0;  // out_features
  int64_t dense_max_rows = 0;
  c10::optional<at::Tensor> bias, scales, sums;

  bool defined() const { return weight.defined() || packed.defined(); }
  int64_t out_features() const { return features; }

  // out [rows, out_features] in the activations' dtype; x [rows, in_features] contiguous; scratch: the step's
  // buffers for int8 weights.
  void apply(const at::Tensor& out, const at::Tensor& x, const Scratch& scratch) const {
    switch (kind) {
      case Kind::kGemv:
        splitserve_cpu::gemv(out, x, weight, bias);
        return;
      case Kind::kPanels:
        splitserve_cpu::panel_linear(out, x, weight, bias);
        return;
      case Kind::kInt8:
      case Kind::kInt8Panels:
      case Kind::kW8A8: {
        const at::Tensor result = out.scalar_type() == at::kFloat ? out : scratch.wide_rows(out);
        if (kind == Kind::kInt8) {
          splitserve_cpu::int8_gemv(result, x, c10::nullopt, weight, *scales, *sums, bias);
        } else {
          const at::Tensor x_int8 = scratch.x_int8.narrow(0, 0, x.numel()).view(x.sizes());
          const at::Tensor x_scales = scratch.x_scales.narrow(0, 0, x.size(0));
          splitserve_cpu::quantize_rows_int8(x_int8, x_scales, x);
          if (kind == Kind::kInt8Panels) {
            splitserve_cpu::int8_panel_linear(result, x_int8, x_scales, weight, *scales, bias);
          } else {
            splitserve_cpu::dequantize_rows(result, at::_int_mm(x_int8, weight.t()), x_scales, *scales, bias);
          }
        }
        if (!result.is_same(out)) out.copy_(result);
        return;
      }
      case Kind::kAmx:
        if (x.size(0) <= dense_max_rows) {
          splitserve_cpu::amx_linear(out, x, weight, bias);
        } else {
          const c10::optional<at::Tensor> narrow_bias =
              bias.has_value() ? c10::optional<at::Tensor>(bias->to(x.scalar_type())) : c10::nullopt;
          out.copy_(at::linear(x, weight, narrow_bias));
        }
        return;
      case Kind::kTorch:
        if (weight.defined() && x.size(0) <= dense_max_rows) {
          out.copy_(at::linear(x, weight, bias));
        } else {
          out.copy_(onednn_linear(x, packed, bias));
        }
        return;
    }
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  c10::optional<at::Tensor> q_norm, k_norm;
  double qk_eps = 0.0;
  int64_t sliding_window = 0;  // <= 0: full attention
  Projection qkv, o, gate_up, down;

  bool complete() const { return qkv.defined() && o.defined() && gate_up.defined() && down.defined(); }
};

class OneCallDecoder : public torch::CustomClassHolder {
 public:
  // final_norm: [hidden_size] in the activations' dtype; eps: the decoder norms' epsilon; scale: attention's
  // softmax scale; the head counts and size those of every layer.
  OneCallDecoder(at::Tensor final_norm, double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                double scale)
      : final_norm_(std::move(final_norm)),
        eps_(eps),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_size_(head_size),
        scale_(scale) {
    TORCH_CHECK(final_norm_.dim() == 1 && final_norm_.is_contiguous(), "final_norm: contiguous [hidden_size]");
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_size > 0 &&
                    head_size % 2 == 0,
                "num_heads must be a positive multiple of num_kv_heads, head_size positive and even");
  }

  // Appends a layer; its four projections follow through add_projection.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, double qk_eps, int64_t sliding_window) {
    for (const at::Tensor* norm : {&input_norm, &post_norm}) {
      TORCH_CHECK(norm->dim() == 1 && norm->numel() == hidden_size() && norm->is_contiguous() &&
                      norm->scalar_type() == dtype(),
                  "layer norms: contiguous [hidden_size] in final_norm's dtype");
    }
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm: both or neither");
    TORCH_CHECK(layers_.empty() || layers_.front().q_norm.has_value() == q_norm.has_value(),
                "q/k norms in every layer or in none");
    TORCH_CHECK(layers_.empty() || layers_.back().complete(), "add_layer before the last layer's four projections");
    if (q_norm.has_value()) {
      for (const at::Tensor* norm : {&*q_norm, &*k_norm}) {
        TORCH_CHECK(norm->dim() == 1 && norm->numel() == head_size_ && norm->is_contiguous() &&
                        norm->scalar_type() == dtype(),
                    "q_norm, k_norm: contiguous [head_size] in final_norm's dtype");
      }
    }
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm),
                            qk_eps, sliding_window});
  }

  // The last added layer's projection `name` (qkv, o, gate_up, down) of out_features outputs, of `kind`
  // (Projection's): "gemv" (weight dense in final_norm's dtype, bias float32; "amx" the same in bfloat16, through
  // amx_linear up to dense_max_rows rows), "int8" (weight int8, scales float32 and sums int32 per output feature,
  // bias float32; "w8a8" the same without sums, through torch's integer product), "int8_panels" (weight int8 in
  // panels of 16, scales float32 per output feature, bias float32), "panels" (weight float32 in panels, bias
  // float32) or "torch" (weight row- or column-major and used up to dense_max_rows rows, and / or packed by oneDNN
  // for more; bias in final_norm's dtype).
  void add_projection(const std::string& name, int64_t out_features, const std::string& kind,
                      c10::optional<at::Tensor> weight, c10::optional<at::Tensor> packed, int64_t dense_max_rows,
                      c10::optional<at::Tensor> bias, c10::optional<at::Tensor> scales,
                      c10::optional<at::Tensor> sums) {
    TORCH_CHECK(!layers_.empty(), "add_projection before add_layer");
    Layer& layer = layers_.back();
    const int64_t q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
    const bool int8 = kind == "int8", int8_panels = kind == "int8_panels", torch_kind = kind == "torch",
               panels = kind == "panels", amx = kind == "amx", w8a8 = kind == "w8a8";
    TORCH_CHECK(int8 || int8_panels || torch_kind || panels || amx || w8a8 || kind == "gemv", name,
                ": kind must be gemv, amx, int8, int8_panels, w8a8, panels or torch, got ", kind);
    TORCH_CHECK(weight.has_value() || (torch_kind && packed.has_value()), name, ": a weight");
    Projection* slot = nullptr;
    std::array<int64_t, 2> shape{};
    if (name == "qkv") {
      slot = &layer.qkv, shape = {q_size + 2 * kv_size, hidden_size()};
    } else if (name == "o") {
      slot = &layer.o, shape = {hidden_size(), q_size};
    } else if (name == "gate_up") {
      const int64_t rows = layers_.size() > 1 ? layers_.front().gate_up.out_features() : out_features;
      slot = &layer.gate_up, shape = {rows, hidden_size()};
      TORCH_CHECK(rows % 2 == 0, "gate_up: an even number of output features (gate, then up), the same in every layer");
    } else if (name == "down") {
      TORCH_CHECK(layer.gate_up.defined(), "down after gate_up");
      slot = &layer.down, shape = {hidden_size(), layer.gate_up.out_features() / 2};
    } else {
      TORCH_CHECK(false, "projection name must be qkv, o, gate_up or down, got ", name);
    }
    TORCH_CHECK(out_features == shape[0], name, ": out_features ", shape[0], " expected, got ", out_features);
    Projection projection;
    projection.kind = int8          ? Projection::Kind::kInt8
                      : int8_panels ? Projection::Kind::kInt8Panels
                      : torch_kind  ? Projection::Kind::kTorch
                      : panels      ? Projection::Kind::kPanels
                      : amx         ? Projection::Kind::kAmx
                      : w8a8        ? Projection::Kind::kW8A8
                                    : Projection::Kind::kGemv;
    projection.features = shape[0];
    TORCH_CHECK(!packed.has_value() || torch_kind, name, ": a packed weight only of kind torch");
    TORCH_CHECK((int8 || int8_panels || w8a8) == scales.has_value() && int8 == sums.has_value(), name,
                ": scales for kinds int8, int8_panels and w8a8 only, sums for kind int8 only");
    if (scales.has_value()) {
      TORCH_CHECK(scales->dim() == 1 && scales->numel() == shape[0] && scales->is_contiguous() &&
                      scales->scalar_type() == at::kFloat,
                  name, ": scales contiguous float32 [", shape[0], "]");
    }
    if (weight.has_value() && int8_panels) {
      const int64_t num_panels = (shape[0] + 15) / 16, pairs = (shape[1] + 1) / 2;
      TORCH_CHECK(weight->dim() == 4 && weight->size(0) == num_panels && weight->size(1) == pairs &&
                      weight->size(2) == 16 && weight->size(3) == 2 && weight->is_contiguous() &&
                      weight->scalar_type() == at::kChar,
                  name, ": contiguous int8 panels [", num_panels, ", ", pairs, ", 16, 2]");
      projection.weight = *std::move(weight);
    } else if (weight.has_value() && panels) {
      TORCH_CHECK(weight->dim() == 3 && weight->size(0) == (shape[0] + 31) / 32 && weight->size(1) == shape[1] &&
                      weight->size(2) == 32 && weight->is_contiguous() && weight->scalar_type() == at::kFloat &&
                      dtype() == at::kFloat,
                  name, ": contiguous float32 panels [", (shape[0] + 31) / 32, ", ", shape[1],
                  ", 32] under float32 activations");
      projection.weight = *std::move(weight);
    } else if (weight.has_value()) {
      // kind torch also takes a column-major weight (a transposed view of [in_features, out_features]: float32's
      // layout for batches, core_svc/models/layers.py's Linear), which at::linear multiplies as it is
      const bool column_major = torch_kind && weight->dim() == 2 && weight->t().is_contiguous();
      TORCH_CHECK(weight->dim() == 2 && weight->size(0) == shape[0] && weight->size(1) == shape[1] &&
                      (weight->is_contiguous() || column_major),
                  name, ": a contiguous weight [", shape[0], ", ", shape[1], "]",
                  torch_kind ? " (or, for kind torch, a transposed view of a contiguous one)" : "");
      TORCH_CHECK(weight->scalar_type() == (int8 || w8a8 ? at::kChar : dtype()), name,
                  ": the weight's dtype must be ", int8 || w8a8 ? "int8" : "final_norm's");
      projection.weight = *std::move(weight);
    }
    if (packed.has_value()) {
      TORCH_CHECK(packed->is_mkldnn() && packed->dim() == 2 && packed->size(0) == shape[0] &&
                      packed->size(1) == shape[1] && packed->scalar_type() == dtype(),
                  name, ": a packed weight (torch.ops.mkldnn._reorder_linear_weight's) [", shape[0], ", ", shape[1],
                  "] in final_norm's dtype");
      projection.packed = *std::move(packed);
    }
    projection.dense_max_rows = projection.packed.defined() || amx ? dense_max_rows : kAnyRows;
    TORCH_CHECK(!int8 || splitserve_cpu::int8_gemv_available(), name, ": kind int8 needs a build with int8_gemv");
    TORCH_CHECK(!int8_panels || splitserve_cpu::int8_panel_linear_available(), name,
                ": kind int8_panels needs a build with int8_panel_linear");
    TORCH_CHECK(!panels || splitserve_cpu::panel_linear_available(), name,
                ": kind panels needs a build with panel_linear");
    TORCH_CHECK(!amx || (dtype() == at::kBFloat16 && splitserve_cpu::amx_linear_available()), name,
                ": kind amx needs bfloat16 activations and a build and CPU with amx_linear");
    TORCH_CHECK(int8 || int8_panels || w8a8 || torch_kind || panels || amx || splitserve_cpu::gemv_available(dtype()),
                name, ": kind gemv needs a build with gemv for final_norm's dtype");
    if (bias.has_value()) {
      const at::ScalarType bias_dtype = torch_kind ? dtype() : at::kFloat;
      TORCH_CHECK(bias->scalar_type() == bias_dtype && bias->numel() == shape[0] && bias->is_contiguous(), name,
                  ": bias ", torch_kind ? "in final_norm's dtype" : "float32", ", one per output feature");
    }
    projection.bias = std::move(bias), projection.scales = std::move(scales), projection.sums = std::move(sums);
    if (int8_panels || w8a8) quantizes_rows_ = true;
    if (int8 || kind == "gemv") max_rows_ = kGemvMaxRows;
    *slot = std::move(projection);
  }

  // hidden: [rows, hidden_size] (1 to max_rows() rows, the embeddings of one new token per request), contiguous, in
  // final_norm's dtype; cos, signed_sin: [rows, head_size] rows of RotaryEmbedding.tables, contiguous;
  // kv_caches: a [2, num_blocks, block_size, num_kv_heads, head_size] cache per layer; slot_mapping [>= rows] int64;
  // block_table [>= rows, max_blocks] int32; seq_lens [>= rows] int32 (AttentionMetadata's). Stores each layer's
  // new keys and values and returns the final norm's output [rows, hidden_size].
  at::Tensor forward(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& signed_sin,
                     const std::vector<at::Tensor>& kv_caches, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& seq_lens) {
    const int64_t rows = hidden.size(0), q_size = num_heads_ * head_size_, kv_size = num_kv_heads_ * head_size_;
    TORCH_CHECK(!layers_.empty() && layers_.back().complete(), "a layer without its four projections");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_size() && hidden.is_contiguous() &&
                    hidden.scalar_type() == dtype(),
                "hidden: contiguous [rows, hidden_size] in final_norm's dtype");
    TORCH_CHECK(rows >= 1, "OneCallDecoder takes at least one row, got ", rows);
    TORCH_CHECK(rows <= max_rows_, "OneCallDecoder takes 1 to ", max_rows_,
                " rows (a projection of kind gemv or int8), got ", rows);
    TORCH_CHECK(hidden.device().is_cpu() && cos.device().is_cpu() && signed_sin.device().is_cpu() &&
                    slot_mapping.device().is_cpu() && block_table.device().is_cpu() && seq_lens.device().is_cpu(),
                "CPU tensors only");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "a KV cache per layer: ", layers_.size(), ", got ",
                kv_caches.size());
    const auto options = hidden.options();
    const int64_t qkv_width = q_size + 2 * kv_size, inter = layers_.front().gate_up.out_features() / 2;
    at::Tensor residual = hidden.clone();
    at::Tensor normed = at::empty({rows, hidden_size()}, options), mlp_out = at::empty({rows, hidden_size()}, options);
    at::Tensor qkv = at::empty({rows, qkv_width}, options), attn = at::empty({rows, num_heads_, head_size_}, options);
    at::Tensor gate_up = at::empty({rows, 2 * inter}, options), act = at::empty({rows, inter}, options);
    Scratch scratch;
    if (dtype() != at::kFloat) {
      scratch.wide = at::empty({rows * std::max({qkv_width, 2 * inter, hidden_size()})}, options.dtype(at::kFloat));
    }
    if (quantizes_rows_) {
      scratch.x_int8 = at::empty({rows * std::max({hidden_size(), q_size, inter})}, options.dtype(at::kChar));
      scratch.x_scales = at::empty({rows}, options.dtype(at::kFloat));
    }
    // Views of qkv: q and k heads together for RoPE, each alone for attention and the q/k norms.
    const at::Tensor qk = qkv.as_strided({rows, num_heads_ + num_kv_heads_, head_size_}, {qkv_width, head_size_, 1});
    const at::Tensor q = qk.narrow(1, 0, num_heads_), k = qk.narrow(1, num_heads_, num_kv_heads_);
    const at::Tensor v = qkv.as_strided({rows, num_kv_heads_, head_size_}, {qkv_width, head_size_, 1}, q_size + kv_size);
    const at::Tensor attn_rows = attn.view({rows, q_size});
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const at::Tensor& cache = kv_caches[i];
      TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.device().is_cpu(), "kv_caches[", i,
                  "]: [2, num_blocks, block_size, num_kv_heads, head_size] on the CPU");
      if (i == 0) {
        splitserve_cpu::add_rms_norm(normed, hidden, c10::nullopt, layer.input_norm, eps_);
      } else {
        splitserve_cpu::add_rms_norm(normed, mlp_out, residual, layer.input_norm, eps_);
      }
      layer.qkv.apply(qkv, normed, scratch);
      if (layer.q_norm.has_value()) {
        splitserve_cpu::add_rms_norm(q, q, c10::nullopt, *layer.q_norm, layer.qk_eps);
        splitserve_cpu::add_rms_norm(k, k, c10::nullopt, *layer.k_norm, layer.qk_eps);
      }
      splitserve_cpu::rotary_in_place(qk, cos, signed_sin);
      splitserve_cpu::decode_attention_with_kv_write(attn, q, k, v, cache.select(0, 0), cache.select(0, 1),
                                                     slot_mapping, block_table, seq_lens, scale_,
                                                     layer.sliding_window);
      layer.o.apply(mlp_out, attn_rows, scratch);
      splitserve_cpu::add_rms_norm(normed, mlp_out, residual, layer.post_norm, eps_);
      layer.gate_up.apply(gate_up, normed, scratch);
      splitserve_cpu::silu_and_mul(act, gate_up);
      layer.down.apply(mlp_out, act, scratch);
    }
    at::Tensor out = at::empty({rows, hidden_size()}, options);
    splitserve_cpu::add_rms_norm(out, mlp_out, residual, final_norm_, eps_);
    return out;
  }

  // The most rows forward takes: 4 with a projection of kind gemv or int8, else any number (INT64_MAX).
  int64_t max_rows() const { return max_rows_; }

 private:
  int64_t hidden_size() const { return final_norm_.numel(); }
  at::ScalarType dtype() const { return final_norm_.scalar_type(); }

  at::Tensor final_norm_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_size_;
  double scale_;
  std::vector<Layer> layers_;
  bool quantizes_rows_ = false;  // a projection of kind int8_panels or w8a8: forward quantizes activations in scratch
  int64_t max_rows_ = kAnyRows;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(splitserve_cpu, m) {
  m.class_<OneCallDecoder>("OneCallDecoder")
      .def(torch::init<at::Tensor, double, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &OneCallDecoder::add_layer)
      .def("add_projection", &OneCallDecoder::add_projection)
      .def("forward", &OneCallDecoder::forward)
      .def("max_rows", &OneCallDecoder::max_rows);
}
