"""Weight-only int8 for the decoder's linear layers on CPU (``--quantization int8``).

Each output channel (row of a ``[out_features, in_features]`` weight) is quantized symmetrically at load from the
float checkpoint: ``scale = max|w_row| / 127``, ``q = round(w / scale)`` in [-127, 127] (the per-channel absmax
scheme of LLM.int8()'s weights and CTranslate2's int8 weights). Activations stay in floating point.

The matmul takes one of two routes by the number of rows (measured in ``docs/benchmarks.md``):
- up to ``INT8PACK_MAX_ROWS`` rows (one request's decode step): torch's CPU weight-only kernel
  ``torch._weight_int8pack_mm`` reads the int8 weight directly, with bfloat16 activations and scales (its float32
  instantiation is scalar code, 10-100x slower); it reads a quarter of float32's weight bytes, so this
  memory-bound case runs about 2x float32's oneDNN matmul on AVX2 and AVX-512 machines alike;
- more rows: the kernel has no blocking over rows and falls behind float32 from about 16 rows, so the weight is
  dequantized to the activations' dtype and multiplied with ``F.linear``; same values as the reference
  ``x @ (q * scale).T``, at about float32's speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from core_svc.models.layers import Linear

INT8PACK_MAX_ROWS = 4  # most rows sent to torch._weight_int8pack_mm; more go through the dequantized weight


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight`` [out_features, in_features] (any float dtype).

    Returns ``(q, scales)``: ``q`` int8 [out_features, in_features] in [-127, 127], ``scales`` float32
    [out_features], with ``weight ~= q * scales[:, None]`` (error at most ``scales / 2`` per element). An all-zero
    row gets scale 1 (its ``q`` is 0).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


class Int8Linear(nn.Module):
    """A ``Linear`` whose weight is int8 per output channel (``quantize_int8_per_channel``); bias kept as is.

    ``x`` [num_rows, in_features] in float32 or bfloat16 -> [num_rows, out_features] in ``x``'s dtype.
    """

    weight_int8: torch.Tensor  # [out_features, in_features] int8, a buffer
    scales: torch.Tensor  # [out_features] float32, a buffer
    scales_bf16: torch.Tensor  # [out_features] bfloat16: torch._weight_int8pack_mm wants the activations' dtype

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8_per_channel(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= INT8PACK_MAX_ROWS:
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scales_bf16).to(x.dtype)
            return out if self.bias is None else out + self.bias
        weight = self.weight_int8.to(x.dtype) * self.scales.to(x.dtype)[:, None]
        return F.linear(x, weight, self.bias)

    def dequantized_weight(self) -> torch.Tensor:
        """``q * scales[:, None]`` [out_features, in_features] float32: the weight this layer multiplies by."""
        return self.weight_int8.float() * self.scales[:, None]


def quantize_linear_weights(model: nn.Module) -> int:
    """Replace every ``Linear`` of a CPU ``model`` (the decoders' fused qkv, o, gate_up and down projections,
    an untied LM head, a vision tower's) by its ``Int8Linear``; returns how many. Call it after the weights are
    loaded and instead of ``prepack_linear_weights``.

    Raises:
        ValueError: a weight on a device other than the CPU (``torch._weight_int8pack_mm`` is CPU-only here).
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    for name, module in targets:
        if module.weight.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on CPU only; {name} is on {module.weight.device}")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int8Linear(module))
    return len(targets)
