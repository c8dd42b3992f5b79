"""One compiled call per decode step on CPU: ``OneCallDecoder`` (kernels/attention/csrc/decoder_cpu.cpp) over a
``LlamaModel``'s own weight tensors.

``LlamaModel.forward`` hands it a decode-only step (each row one request's one new token) once the CPU kernels are
loaded: steps of 1 to ``GEMV_MAX_ROWS`` rows to the one-call decoder (``build_one_call_decoder``), larger ones to the
batch decoder (``build_one_call_decoder(model, batch=True)``). Either runs ``DecoderLayer.forward_fused`` for every
layer, and the final norm, with the same kernels and products in the same order, so its output and the keys and
values it stores are that path's bit for bit; what it removes is Python and torch's dispatch between them (about
0.3 ms per layer of ``small``: 2.5 of one request's 11 ms float32 forward; a 16- to 64-row step's forward in
0.80-0.92x the time; docs/benchmarks.md, "One call per decode step" and "One call per decode step of a batch").

At few rows it covers every projection ``Linear`` and ``Int8Linear`` run there (``gemv`` on dense copies, torch's
``F.linear`` and oneDNN's packed product, ``panel_linear`` on float32 panels, ``int8_gemv``, ``int8_panel_linear`` on
int8 panels); for batches the projections whose route above ``GEMV_MAX_ROWS`` rows it has too (``panel_linear``,
``int8_panel_linear``, ``amx_linear`` and ``F.linear`` above ``AMX_MAX_ROWS``, torch's products, int8 W8A8 through
``torch._int_mm`` where it is exact), so not int8 multiplied by its dequantized weight (a CPU whose integer product
saturates). Both take per-head q/k norms (Qwen3: ``add_rms_norm`` over every row's heads in one call), SiLU-gated MLPs
and the ``cpu`` attention backend, and a projection wrapped for LoRA adapters (``AdapterWrapper``) by its base
projection, so a step in which no request uses an adapter (``lora_batches``: ``LlamaModel.forward`` checks) is one call
too. Anything else (int8 on ``torch._weight_int8pack_mm``'s route, another activation or backend, another wrapper) keeps
the per-layer path.
"""

from __future__ import annotations

from typing import Any

import torch

from core_svc.models.layers import (
    AMX_MAX_ROWS,
    GEMV_MAX_ROWS,
    AdapterWrapper,
    Linear,
    compiled_amx_linear,
    compiled_gemv,
)
from core_svc.models.quantization import INT8PACK_MAX_ROWS, Int8Linear, int8_panel_ops, int_mm_is_exact, vnni_ops
from kernels.attention.cpu_ops import loaded_ops


def build_one_call_decoder(model: Any, batch: bool = False) -> Any:
    """``torch.classes.splitserve_cpu.OneCallDecoder`` over ``model``'s (a ``LlamaModel``) weights, holding the same
    tensors (no copies but float32 casts of non-float32 biases), or None when the kernels are not loaded or any
    layer is outside what it covers (module docstring). ``batch``: for steps of more than ``GEMV_MAX_ROWS`` rows
    (its ``max_rows()`` is then unbounded), else for 1 to ``GEMV_MAX_ROWS``."""
    if loaded_ops() is None or not model.layers:
        return None
    norms = [model.norm]
    for layer in model.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
    dims = model.layers[0].self_attn.dims
    for layer in model.layers:
        attn = layer.self_attn
        if (
            getattr(attn.backend, "name", None) != "cpu"
            or not layer.mlp.silu
            or (attn.q_norm is None) != (model.layers[0].self_attn.q_norm is None)
            or (attn.dims.num_heads, attn.dims.num_kv_heads, attn.dims.head_size)
            != (dims.num_heads, dims.num_kv_heads, dims.head_size)
        ):
            return None
    if any(norm.eps != model.norm.eps or norm.weight.dtype != model.norm.weight.dtype for norm in norms):
        return None
    first = model.layers[0].self_attn
    decoder = torch.classes.splitserve_cpu.OneCallDecoder(
        model.norm.weight, model.norm.eps, dims.num_heads, dims.num_kv_heads, dims.head_size, first.scale
    )
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = attn.q_norm, attn.k_norm
        if q_norm is not None and k_norm is not None and not _same_norms(q_norm, k_norm, model.norm.weight.dtype):
            return None
        decoder.add_layer(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            dims.rms_norm_eps if q_norm is None else q_norm.eps,
            attn.dims.sliding_window or 0,
        )
        for name, module in (
            ("qkv", attn.qkv_proj),
            ("o", attn.o_proj),
            ("gate_up", mlp.gate_up_proj),
            ("down", mlp.down_proj),
        ):
            projection = _projection(module, model.norm.weight.dtype, batch)
            if projection is None:
                return None
            decoder.add_projection(name, *projection)
    return decoder


def lora_batches(model: Any) -> tuple[Any, ...]:
    """The step batches (``LoRABatch``) of ``model``'s projections wrapped for LoRA adapters (``AdapterWrapper``),
    each once: the decoder runs their base projections only, so a step may take it only while none is active."""
    batches = {id(m.batch): m.batch for m in model.modules() if isinstance(m, AdapterWrapper)}
    return tuple(batches.values())


def _same_norms(q_norm: Any, k_norm: Any, dtype: torch.dtype) -> bool:
    """Whether a layer's q and k norms share an epsilon (the decoder takes one per layer) and the activations'
    dtype."""
    return q_norm.eps == k_norm.eps and q_norm.weight.dtype == k_norm.weight.dtype == dtype


def _projection(module: Any, dtype: torch.dtype, batch: bool = False) -> tuple[Any, ...] | None:
    """``add_projection``'s (out_features, kind, weight, packed, dense_max_rows, bias, scales, sums) for a
    projection run as ``Linear.forward`` and ``Int8Linear.forward`` run it at 1 to ``GEMV_MAX_ROWS`` rows (``batch``:
    at every row count above): ``gemv`` on a dense copy where the build has it for ``dtype`` (not ``batch``); else
    ``amx_linear`` on a bfloat16 weight laid out for it (``F.linear`` above ``AMX_MAX_ROWS``), ``panel_linear`` on
    float32 panels, or torch's products (``F.linear`` on the weight as loaded or column-major, oneDNN's on the packed
    weight); ``int8_panel_linear`` on int8 panels, else ``int8_gemv`` (``batch``: W8A8 through ``torch._int_mm``
    where that product is exact); a ``LoRALinear``'s base projection. None for anything else (another wrapper, int8
    on ``torch._weight_int8pack_mm``'s route or, in a batch, through its dequantized weight, a weight in another
    dtype)."""
    if isinstance(module, AdapterWrapper):
        module = module.base
    if type(module) is Int8Linear:
        bias = None if module.bias is None else module.bias.detach().float()
        if module.weight_panels is not None and int8_panel_ops() is not None:  # Int8Linear's _forward_panels
            return module.out_features, "int8_panels", module.weight_panels, None, 0, bias, module.scales, None
        if batch:  # above INT8PACK_MAX_ROWS rows Int8Linear's W8A8 where torch's integer product is exact
            if INT8PACK_MAX_ROWS > GEMV_MAX_ROWS or not int_mm_is_exact():
                return None
            return module.out_features, "w8a8", module.weight_int8, None, 0, bias, module.scales, None
        if vnni_ops() is None or INT8PACK_MAX_ROWS < GEMV_MAX_ROWS:  # int8_gemv to INT8PACK_MAX_ROWS rows
            return None
        return module.out_features, "int8", module.weight_int8, None, 0, bias, module.scales, module.weight_sums
    if type(module) is not Linear:
        return None
    n = module.out_features
    bias = None if module.bias is None else module.bias.detach()
    dense = module.dense_weight
    if dense is not None and compiled_gemv(dtype) is not None and not batch:
        usable = dense.dtype == dtype and dense.is_contiguous()
        return (n, "gemv", dense, None, 0, None if bias is None else bias.float(), None, None) if usable else None
    if module.amx and dtype == torch.bfloat16 and compiled_amx_linear() is not None:  # layers.amx_linear's routes
        weight = module.weight.detach()
        return n, "amx", weight, None, AMX_MAX_ROWS, None if bias is None else bias.float(), None, None
    if module.panel_weight is not None:
        usable = module.panel_weight.dtype == dtype == torch.float32
        return (n, "panels", module.panel_weight, None, 0, bias, None, None) if usable else None
    if module.packed_weight is None:  # F.linear on the weight (row- or column-major) at every row count
        weight = module.weight.detach()
        usable = weight.dtype == dtype and (weight.is_contiguous() or weight.t().is_contiguous())
        return (n, "torch", weight, None, 0, bias, None, None) if usable else None
    packed = module.packed_weight
    return (n, "torch", None, packed, 0, bias, None, None) if packed.dtype == dtype else None
