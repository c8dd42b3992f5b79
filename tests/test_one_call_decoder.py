"""The compiled decoders of decode steps (core_svc/models/one_call_decoder.py, kernels/attention/csrc/decoder_cpu.cpp),
for few rows and for batches, against the per-layer path they replace: the same outputs and the same stored keys and
values, bit for bit, for every kind of projection and layer they cover; and the models they must leave to the
per-layer path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from core_svc.models import layers, llama, one_call_decoder, quantization
from core_svc.models.arch import ModelArchConfig
from core_svc.models.layers import GEMV_MAX_ROWS, prepack_linear_weights
from core_svc.models.llama import LlamaModel
from core_svc.models.quantization import Int8Linear, int8_panel_ops, quantize_linear_weights, vnni_ops
from kernels import AttentionMetadata
from kernels.attention.torch_ref import TorchRefAttentionBackend
from tests.helpers import cpu_kernels_loaded

BLOCK_SIZE, NUM_BLOCKS = 4, 64
BATCH_ROWS = (5, 9)  # decode steps past GEMV_MAX_ROWS: the batch decoder's


def _kernels() -> None:
    if not cpu_kernels_loaded():
        pytest.skip("the CPU kernels cannot be built here")


def _model(variant: str, dtype: torch.dtype, weights: str) -> LlamaModel:
    """A 3-layer decoder of ``variant`` with seeded random weights, its projections as ``weights`` says: "dense"
    (prepacked plus the dense copies gemv reads), "packed" (prepacked only: in panels in float32 where the build has
    the panel kernel, else column-major; oneDNN's in bfloat16), "column-major" (float32 prepacked as without the
    panel kernel), "plain" (F.linear's weight as loaded), "int8" (int8 on this CPU's route) or "int8-panels" (int8
    in panels for int8_panel_linear, as on a CPU without int8 dot products)."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    from kernels.attention.cpu import CpuAttentionBackend
    from splitserve.base import envs

    shape = dict(vocab_size=300, hidden_size=256, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, max_position_embeddings=512)
    narrow = shape | dict(intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    hf = {
        "llama": LlamaConfig(**shape, architectures=["LlamaForCausalLM"]),
        # hidden wider than qkv and gate_up: the scratch row of int8 results under bfloat16 must fit o and down
        "narrow": LlamaConfig(**narrow, architectures=["LlamaForCausalLM"]),
        "biases": LlamaConfig(**shape, attention_bias=True, mlp_bias=True, architectures=["LlamaForCausalLM"]),
        "qwen3": Qwen3Config(**shape, head_dim=96, architectures=["Qwen3ForCausalLM"]),  # q/k norm, wider heads
        "mistral": MistralConfig(**shape, sliding_window=5, architectures=["MistralForCausalLM"]),
    }[variant]
    model = LlamaModel(ModelArchConfig.from_hf_config(hf), CpuAttentionBackend(envs.kernel_dir()), dtype).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale, offset = (0.3, 1.0) if "norm" in name else (0.08, 0.0)
            param.copy_((offset + scale * torch.randn(param.shape, generator=gen)).to(dtype))
    if variant == "qwen3":  # per-head norms with their own epsilon: each norm must use its own
        for layer in model.layers:
            layer.self_attn.q_norm.eps = layer.self_attn.k_norm.eps = 0.25
    if weights in ("int8", "int8-panels"):  # "int8-panels" under _int8_route's CPU without int8 dot products
        quantize_linear_weights(model)
        panels = [m.weight_panels is not None for m in model.modules() if isinstance(m, Int8Linear)]
        assert all(panels) if weights == "int8-panels" else not any(panels) or int8_panel_ops() is not None
    elif weights == "column-major":
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(layers, "compiled_panel_linear", lambda: None)
            prepack_linear_weights(model)
        assert all(m.panel_weight is None for m in model.modules() if isinstance(m, layers.Linear))
    elif weights != "plain" and not prepack_linear_weights(model, keep_dense=weights == "dense"):
        pytest.skip(f"torch has no oneDNN for {dtype} here")
    return model


def _step(
    model: LlamaModel, seq_lens: list[int], gen: torch.Generator, cache_dtype: torch.dtype | None = None
) -> tuple[Any, ...]:
    """A decode step of one new token per request (sequence lengths after it ``seq_lens``) over KV caches
    (``cache_dtype``, else the model's) holding random keys and values for the earlier tokens, in blocks scattered
    through the cache."""
    dims = model.layers[0].self_attn.dims
    dtype = cache_dtype or model.norm.weight.dtype
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, dims.num_kv_heads, dims.head_size)
    kv_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in model.layers]
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    order = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1  # block 0 is the null block
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for row, n in enumerate(seq_lens):
        used = -(-n // BLOCK_SIZE)
        block_table[row, :used] = order[row * max_blocks : row * max_blocks + used].int()
    metadata = AttentionMetadata.for_decodes(block_table, torch.tensor(seq_lens, dtype=torch.int32), BLOCK_SIZE)
    rows = len(seq_lens)
    input_ids = torch.randint(0, 300, (rows,), generator=gen)
    positions = torch.tensor([n - 1 for n in seq_lens])
    return input_ids, positions, kv_caches, metadata


def _not_called(*args: Any) -> None:
    raise AssertionError("the per-layer path ran")


WEIGHTS = [
    ("llama", torch.float32, "dense"),
    ("llama", torch.bfloat16, "dense"),
    ("llama", torch.float32, "packed"),
    ("llama", torch.float32, "column-major"),
    ("biases", torch.float32, "packed"),
    ("llama", torch.float32, "plain"),
    ("biases", torch.float32, "dense"),
    ("biases", torch.bfloat16, "packed"),
    ("biases", torch.bfloat16, "int8"),
    ("qwen3", torch.float32, "dense"),
    ("qwen3", torch.bfloat16, "dense"),
    ("mistral", torch.float32, "int8"),
    ("mistral", torch.bfloat16, "packed"),
    ("llama", torch.float32, "int8"),
    ("narrow", torch.bfloat16, "int8"),
    ("biases", torch.bfloat16, "int8-panels"),
    ("qwen3", torch.float32, "int8-panels"),
    ("mistral", torch.float32, "int8-panels"),
    ("narrow", torch.bfloat16, "int8-panels"),
]


def _int8_route(monkeypatch: Any, weights: str) -> None:
    """Skips where this build has no kernel for ``weights``' int8 route; for "int8-panels", has the CPU treated as
    one without int8 dot products (so the panels laid out at load are what Int8Linear multiplies)."""
    if weights == "int8" and vnni_ops() is None and int8_panel_ops() is None:
        pytest.skip("this build has neither int8_gemv (AVX-512 VNNI) nor int8_panel_linear (AVX2)")
    if weights == "int8-panels":
        if _int8_panel_kernel() is None:
            pytest.skip("this build has no int8_panel_linear (AVX2)")
        monkeypatch.setattr(quantization, "has_int8_dot_products", lambda: False)


def _int8_panel_kernel() -> Any:
    """The loaded CPU kernels when their build has int8_panel_linear (AVX2), whatever the CPU's int8 route."""
    return layers.compiled_ops_where("int8_panel_linear_available")


@pytest.mark.parametrize(("variant", "dtype", "weights"), WEIGHTS)
def test_one_call_equals_the_per_layer_path_bit_for_bit(monkeypatch, variant, dtype, weights):
    """Dense copies go to gemv where the build has it for the dtype; float32 panels to panel_linear, column-major
    weights (float32) to F.linear, packed ones (bfloat16) to oneDNN: each route the per-layer path takes."""
    _kernels()
    _int8_route(monkeypatch, weights)
    model = _model(variant, dtype, weights)
    assert model.one_call_decoder() is not None
    _compare(monkeypatch, model, dtype)
    # batches: one call wherever every projection's route is the same at every row count above GEMV_MAX_ROWS
    if _batch_routes_fixed(model):
        assert model.batch_decoder() is not None and model.batch_decoder().max_rows() == 2**63 - 1
        _compare(monkeypatch, model, dtype, rows_list=BATCH_ROWS)
    else:
        assert model.batch_decoder() is None
        _compare_per_layer(model, dtype)


def _batch_routes_fixed(model: LlamaModel) -> bool:
    """Whether the batch decoder covers ``model``: int8 projections in panels or, without them, on a CPU whose
    integer product is exact (W8A8 through torch._int_mm; elsewhere Int8Linear multiplies by the dequantized
    weight)."""
    projections = [m for m in model.modules() if isinstance(m, Int8Linear)]
    return all(m.weight_panels is not None for m in projections) or quantization.int_mm_is_exact()


def _compare_per_layer(model: LlamaModel, dtype: torch.dtype) -> None:
    """A batch step where the batch decoder does not apply runs layer by layer."""
    gen = torch.Generator().manual_seed(4)
    input_ids, positions, caches, metadata = _step(model, [9, 1, 13, 5, 17], gen)
    calls: list[int] = []
    per_layer = llama.DecoderLayer.forward_fused

    def counted(*args: Any) -> Any:
        calls.append(1)
        return per_layer(*args)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama.DecoderLayer, "forward_fused", counted)
        assert model(input_ids, positions, caches, metadata).dtype == dtype
    assert len(calls) == len(model.layers)


def test_without_gemv_the_column_major_weights_serve_every_row(monkeypatch):
    """A build without gemv and panel_linear (a CPU without AVX2): no dense copies are kept; float32's column-major
    weights go through F.linear at every row count."""
    _kernels()
    monkeypatch.setattr(layers, "compiled_gemv", lambda dtype: None)
    monkeypatch.setattr(one_call_decoder, "compiled_gemv", lambda dtype: None)
    monkeypatch.setattr(layers, "compiled_panel_linear", lambda: None)  # nor panel_linear (AVX-512F or AVX2)
    model = _model("biases", torch.float32, "dense")
    projections = [m for m in model.modules() if isinstance(m, layers.Linear)]
    assert all(m.dense_weight is None and m.weight.t().is_contiguous() for m in projections)
    assert model.one_call_decoder() is not None
    _compare(monkeypatch, model, torch.float32)


def _compare(
    monkeypatch: Any,
    model: LlamaModel,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None = None,
    rows_list: tuple[int, ...] = tuple(range(1, GEMV_MAX_ROWS + 1)),
) -> None:
    gen = torch.Generator().manual_seed(1)
    # requests at lengths across block edges, past the sliding window, at a first token
    for rows in rows_list:
        seq_lens = [9, 1, 13, 5, 17, 2, 4, 8, 12][:rows]
        input_ids, positions, caches, metadata = _step(model, seq_lens, gen, cache_dtype)
        reference_caches = [cache.clone() for cache in caches]
        with torch.no_grad(), monkeypatch.context() as patch:
            patch.setattr(llama.DecoderLayer, "forward_fused", _not_called)  # the step is one call
            fused = model(input_ids, positions, caches, metadata)
        with torch.no_grad():
            model.one_call_decoder_enabled = False
            reference = model(input_ids, positions, reference_caches, metadata)
            model.one_call_decoder_enabled = True
        assert fused.dtype == dtype and fused.shape == (rows, 256)
        assert torch.equal(fused, reference)
        for cache, expected in zip(caches, reference_caches, strict=True):
            assert torch.equal(cache, expected)  # the new keys and values in their slots, the rest untouched


@pytest.mark.parametrize("weights", ["dense", "packed"])
def test_a_bfloat16_kv_cache_under_float32_is_one_call_too(monkeypatch, weights):
    """``--kv-cache-dtype bfloat16``: the one call stores and reads the narrower cache as the per-layer path does."""
    _kernels()
    model = _model("llama", torch.float32, weights)
    assert model.one_call_decoder() is not None and model.batch_decoder() is not None
    _compare(monkeypatch, model, torch.float32, torch.bfloat16)
    _compare(monkeypatch, model, torch.float32, torch.bfloat16, rows_list=BATCH_ROWS)


def test_amx_weights_past_amx_max_rows_take_f_linear_in_one_call_too(monkeypatch):
    """bfloat16 laid out for the AMX kernel: amx_linear up to AMX_MAX_ROWS rows, F.linear above, in the batch
    decoder as in Linear.forward (AMX_MAX_ROWS lowered to 6 so that a 9-row step is above it)."""
    _kernels()
    if layers.compiled_amx_linear() is None:
        pytest.skip("this build or CPU has no AMX kernel")
    monkeypatch.setattr(layers, "AMX_MAX_ROWS", 6)
    monkeypatch.setattr(one_call_decoder, "AMX_MAX_ROWS", 6)
    model = _model("biases", torch.bfloat16, "packed")
    assert all(m.amx for m in model.modules() if isinstance(m, layers.Linear))
    _compare(monkeypatch, model, torch.bfloat16, rows_list=BATCH_ROWS)


def test_replaced_weights_rebuild_the_decoder(monkeypatch):
    """Weights prepacked or quantized after a first decode step: the decoder is built again over the new ones."""
    _kernels()
    model = _model("llama", torch.float32, "plain")
    first = model.one_call_decoder()
    assert first is not None
    if not prepack_linear_weights(model):
        pytest.skip("torch has no oneDNN for float32 here")
    assert model.one_call_decoder() is not None and model.one_call_decoder() is not first
    _compare(monkeypatch, model, torch.float32)


def test_models_it_does_not_cover_keep_the_per_layer_path(monkeypatch):
    _kernels()
    # an activation other than SiLU
    gelu = _model("llama", torch.float32, "plain")
    gelu.layers[1].mlp.silu = False
    assert gelu.one_call_decoder() is None
    # a projection in a wrapper other than LoRA's
    wrapped = _model("llama", torch.float32, "plain")
    wrapped.layers[2].self_attn.o_proj = torch.nn.Sequential(wrapped.layers[2].self_attn.o_proj)
    assert wrapped.one_call_decoder() is None
    # int8 weights on a CPU without the VNNI kernel or the AVX2 panels (torch._weight_int8pack_mm's route)
    monkeypatch.setattr(one_call_decoder, "vnni_ops", lambda: None)
    monkeypatch.setattr(quantization, "int8_panel_ops", lambda: None)
    assert _model("llama", torch.float32, "int8").one_call_decoder() is None
    # the reference attention backend
    other = _model("llama", torch.float32, "plain")
    for layer in other.layers:
        layer.self_attn.backend = TorchRefAttentionBackend()
    assert other.one_call_decoder() is None


@pytest.mark.parametrize("weights", ["dense", "int8", "int8-panels"])
def test_lora_wrapped_projections_take_one_call_only_in_steps_without_an_adapter(monkeypatch, weights):
    """An engine with --enable-lora: its projections wrapped (after a first decoder was built, which is then built
    again), a step without adapter rows is one call over the base projections, bit for bit the per-layer path's; a
    step with adapter rows takes the per-layer path, which adds them."""
    _kernels()
    _int8_route(monkeypatch, weights)
    from core_svc.lora.layers import LoRABatch, LoRASlots, wrap_lora_modules

    model = _model("llama", torch.float32, weights)
    first = model.one_call_decoder()
    holder = torch.nn.Module()
    holder.model = model  # wrap_lora_modules names projections as a causal LM holds them: model.layers.N...
    sizes = {"qkv_proj": [256, 128, 128], "gate_up_proj": [352, 352], "o_proj": [256], "down_proj": [256]}
    batch = LoRABatch()
    slots = LoRASlots(max_loras=1, max_lora_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    wrapped = wrap_lora_modules(holder, sizes, slots, batch)
    gen = torch.Generator().manual_seed(3)
    for (_, kind), module in wrapped.items():
        in_features = 352 if kind == "down_proj" else 256
        module.set_slot(
            0,
            [
                (torch.randn(4, in_features, generator=gen) * 0.1, torch.randn(size, 4, generator=gen))
                for size in sizes[kind]
            ],
        )
    assert model.one_call_decoder() is not None and model.one_call_decoder() is not first
    _compare(monkeypatch, model, torch.float32)  # no adapter rows in these steps
    if _batch_routes_fixed(model):  # and batches of them
        _compare(monkeypatch, model, torch.float32, rows_list=BATCH_ROWS)

    input_ids, positions, caches, metadata = _step(model, [9, 13], gen)
    calls: list[int] = []
    per_layer = llama.DecoderLayer.forward_fused

    def counted(*args: Any) -> Any:
        calls.append(1)
        return per_layer(*args)

    with torch.no_grad(), monkeypatch.context() as patch:
        patch.setattr(llama.DecoderLayer, "forward_fused", counted)
        base = model(input_ids, positions, [cache.clone() for cache in caches], metadata)
        assert calls == []  # one call
        batch.segments = [(0, 0, 2)]
        adapted = model(input_ids, positions, [cache.clone() for cache in caches], metadata)
        assert len(calls) == len(model.layers)  # layer by layer, with the adapter
        batch.segments = []
    assert (adapted - base).abs().max() > 1e-3  # the adapter's update is in the output


def test_malformed_inputs_are_refused_with_the_reason():
    _kernels()
    model = _model("llama", torch.float32, "plain")
    decoder = model.one_call_decoder()
    gen = torch.Generator().manual_seed(2)
    input_ids, positions, caches, metadata = _step(model, [3, 3, 3, 3, 3], gen)
    hidden = model.embed_tokens(input_ids)
    cos, sin = model.rotary.tables(positions)
    args = (metadata.slot_mapping, metadata.block_table, metadata.seq_lens)
    assert decoder.max_rows() == 2**63 - 1  # torch's products take any number of rows
    with pytest.raises(RuntimeError, match="at least one row, got 0"):
        decoder.forward(hidden[:0], cos[:0], sin[:0], caches, *args)
    if layers.compiled_gemv(torch.float32) is not None:  # dense copies through gemv: at most its 4 rows
        dense = _model("llama", torch.float32, "dense").one_call_decoder()
        assert dense.max_rows() == GEMV_MAX_ROWS
        with pytest.raises(RuntimeError, match=r"1 to 4 rows \(a projection of kind gemv or int8\), got 5"):
            dense.forward(hidden, cos, sin, caches, *args)
    with pytest.raises(RuntimeError, match="a KV cache per layer: 3, got 2"):
        decoder.forward(hidden[:1], cos[:1], sin[:1], caches[:2], *args)
    with pytest.raises(RuntimeError, match="final_norm's dtype"):
        decoder.forward(hidden[:1].double(), cos[:1], sin[:1], caches, *args)
    with pytest.raises(RuntimeError, match="projection name must be qkv, o, gate_up or down, got up"):
        decoder.add_projection("up", 8, "torch", torch.zeros(8, 256), None, 0, None, None, None)
    with pytest.raises(RuntimeError, match="gate_up: a weight"):
        decoder.add_projection("gate_up", 704, "torch", None, None, 0, None, None, None)
    with pytest.raises(RuntimeError, match=r"down: a contiguous weight \[256, 352\]"):
        decoder.add_projection("down", 256, "torch", torch.zeros(256, 351), None, 0, None, None, None)
    with pytest.raises(RuntimeError, match=r"down: a contiguous weight \[256, 352\] \(or, for kind torch"):
        decoder.add_projection("down", 256, "torch", torch.zeros(256, 704)[:, ::2], None, 0, None, None, None)
    with pytest.raises(RuntimeError, match=r"down: out_features 256 expected, got 255"):
        decoder.add_projection("down", 255, "panels", torch.zeros(8, 352, 32), None, 0, None, None, None)
    with pytest.raises(RuntimeError, match=r"down: contiguous float32 panels \[8, 352, 32\] under float32"):
        decoder.add_projection("down", 256, "panels", torch.zeros(8, 351, 32), None, 0, None, None, None)
    with pytest.raises(RuntimeError, match=r"down: contiguous float32 panels"):
        decoder.add_projection("down", 256, "panels", torch.zeros(8, 352, 32).bfloat16(), None, 0, None, None, None)
    # the panels' bias is checked where the build has the panel kernel (AVX-512F or AVX2); elsewhere the kind is
    # refused
    refusal = (
        "down: bias float32, one per output feature" if layers.compiled_panel_linear() else "kind panels needs a build"
    )
    with pytest.raises(RuntimeError, match=refusal):
        decoder.add_projection("down", 256, "panels", torch.zeros(8, 352, 32), None, 0, torch.zeros(255), None, None)
    panels = torch.zeros(16, 176, 16, 2, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="down: scales for kinds int8, int8_panels and w8a8 only"):
        decoder.add_projection("down", 256, "int8_panels", panels, None, 0, None, None, None)
    with pytest.raises(RuntimeError, match="down: the weight's dtype must be int8"):
        decoder.add_projection("down", 256, "w8a8", torch.zeros(256, 352), None, 0, None, torch.ones(256), None)
    with pytest.raises(RuntimeError, match="down: kind amx needs bfloat16 activations"):  # this decoder's: float32
        decoder.add_projection("down", 256, "amx", torch.zeros(256, 352), None, 256, None, None, None)
    with pytest.raises(RuntimeError, match=r"down: scales contiguous float32 \[256\]"):
        decoder.add_projection("down", 256, "int8_panels", panels, None, 0, None, torch.ones(255), None)
    if _int8_panel_kernel() is not None:
        with pytest.raises(RuntimeError, match=r"down: contiguous int8 panels \[16, 176, 16, 2\]"):
            decoder.add_projection("down", 256, "int8_panels", panels[:, :175], None, 0, None, torch.ones(256), None)
        with pytest.raises(RuntimeError, match=r"down: bias float32, one per output feature"):
            decoder.add_projection(
                "down", 256, "int8_panels", panels, None, 0, torch.zeros(256).double(), torch.ones(256), None
            )
    with pytest.raises(RuntimeError, match=r"down: a contiguous weight \[256, 352\]$"):  # column-major: torch only
        decoder.add_projection("down", 256, "gemv", torch.zeros(352, 256).t(), None, 0, None, None, None)
