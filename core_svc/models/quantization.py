"""int8 for the decoder's linear layers on CPU (``--quantization int8``).

Each output channel (row of a ``[out_features, in_features]`` weight) is quantized symmetrically at load from the
float checkpoint: ``scale = max|w_row| / 127``, ``q = round(w / scale)`` in [-127, 127] (the per-channel absmax
scheme of LLM.int8()'s weights and CTranslate2's int8 weights).

The matmul takes one of two routes by the number of rows (``python -m benchmarks.int8_matmul``, in
``docs/benchmarks.md``):
- up to ``INT8PACK_MAX_ROWS`` rows (one request's decode step), on a CPU with AVX-512 VNNI once the compiled CPU
  kernels are loaded: the activations quantized per row as below, then ``int8_gemv`` (integer dot products,
  each weight row read once for all rows; the W8A8 path's values bit for bit); one request's int8 decode took
  0.6x the time of the weight-only kernel's. Elsewhere weight-only, torch's CPU kernel
  ``torch._weight_int8pack_mm`` reading the int8 weight directly, with bfloat16 activations and scales (its float32
  instantiation is scalar code, 10-100x slower); it reads a quarter of float32's weight bytes, so this
  memory-bound case runs about 2x float32's oneDNN matmul. It is used only where ``in_features`` is a multiple of
  16: with 2 or 4 rows and other widths torch 2.13's kernel reads out of bounds (a segmentation fault);
- more rows (batches, prefill): the activations are quantized too, per row (dynamic, symmetric: llama.cpp's q8_0
  and CTranslate2's int8 do the same), and ``torch._int_mm`` multiplies int8 by int8 into int32 (oneDNN: AMX or
  VNNI where the CPU has them), 2-7x float32's speed at 64 rows; the weight-only kernel has no blocking over rows
  and falls behind float32 from about 16 rows.

On x86 CPUs without int8 dot products (AVX2 without VNNI: ``has_int8_dot_products``), where oneDNN's int8 product
saturates its sums or runs slowly, every row count goes to the compiled AVX2 kernel ``int8_panel_linear`` over a
second copy of the weight laid out in panels of 16 output features (``pack_int8_panels``): the W8A8 values above,
its int32 sums from ``vpmaddwd`` exact. Over small's five matrices on a Zen 3 core (``python -m
benchmarks.int8_matmul``, one thread) it took 0.42-0.69x the time of float32's MKL product at 64 and 256 rows
(0.49-0.63x that of float32's own panel kernel, which float32 takes on that CPU too), and over the five
together 0.83x the weight-only kernel's time at one row, 0.54x at four (before its one- and two-row walk, which
took 0.4-0.6x the time of its blocks at one row). Without that kernel (no AVX2, or the kernels
not loaded) the routes above run: few rows through ``torch._weight_int8pack_mm``, more through ``torch._int_mm``
where it is exact (on that Zen 3 about 70x slower than the kernel) or else the dequantized weight in float.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core_svc.cpu_dtype import INT8_DOT_FLAGS, cpu_flags
from core_svc.models.layers import Linear, compiled_ops_where, notify_weights_replaced
from kernels.attention.cpu_ops import loaded_ops

INT8PACK_MAX_ROWS = 4  # most rows sent to torch._weight_int8pack_mm; more go through int8_linear_w8a8
INT8PACK_IN_FEATURES_MULTIPLE = 16  # torch._weight_int8pack_mm only for in_features a multiple of this (see above)
INT8_PANEL_WIDTH = 16  # output features per panel of int8_panel_linear (two AVX2 vectors of int32 sums)


def quantize_int8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 of activations ``x`` [num_rows, in_features] (float32 or bfloat16), one scale per row
    (per token: as llama.cpp's q8_0 activations, per block of 32 there, and CTranslate2's int8 GEMM inputs).

    Returns ``(q, scales)``: ``q`` int8 [num_rows, in_features] in [-127, 127], ``scales`` float32 [num_rows, 1],
    ``x ~= q * scales`` (error at most ``scales / 2`` per element); an all-zero row gets ``q`` 0.
    """
    x = x.float()
    scales = x.abs().amax(dim=1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny) / 127.0
    return torch.round(x / scales).to(torch.int8), scales


def int8_linear_w8a8(
    x: torch.Tensor, weight_int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ (weight_int8 * scales[:, None]).T + bias`` with ``x`` quantized per row too and the product in integers:
    ``torch._int_mm`` (int8 x int8 -> int32; oneDNN on CPU, AMX or VNNI where the CPU has them), then rescaled by
    the row scale times the channel scale (the W8A8 scheme of LLM.int8() without its outlier split, SmoothQuant's
    per-token / per-channel case).

    ``x`` [num_rows, in_features] float32 or bfloat16; ``weight_int8`` [out_features, in_features] int8;
    ``scales`` [out_features] float32; ``bias`` [out_features] or None -> [num_rows, out_features] in ``x``'s dtype.
    The int32 sums are exact (|sum| <= in_features * 127^2 < 2^31 up to in_features 133,000).
    """
    ops = _row_kernels()
    if ops is None or not x.is_contiguous():
        x_int8, x_scales = quantize_int8_per_row(x)
        out = torch._int_mm(x_int8, weight_int8.t()).float().mul_(x_scales).mul_(scales)
        if bias is not None:
            out += bias
        return out.to(x.dtype)
    x_int8, x_scales = _quantize_rows(ops, x)
    acc = torch._int_mm(x_int8, weight_int8.t())
    out = torch.empty(acc.shape, dtype=torch.float32)
    ops.dequantize_rows(out, acc, x_scales, scales, None if bias is None else bias.float())
    return out.to(x.dtype)


def _quantize_rows(ops: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8_per_row`` through the compiled pass: ``x`` [num_rows, in_features] contiguous -> int8 of its
    shape and float32 [num_rows] scales."""
    x_int8 = torch.empty(x.shape, dtype=torch.int8)
    x_scales = torch.empty(x.shape[0], dtype=torch.float32)
    ops.quantize_rows_int8(x_int8, x_scales, x)
    return x_int8, x_scales


def _row_kernels() -> Any:
    """``torch.ops.splitserve_cpu`` once the CPU kernels' library (``kernels/attention/cpu_ops.py``) is loaded
    (the CPU attention backend loads it when the engine starts), with its one-pass row kernels: the values of
    ``quantize_int8_per_row`` bit for bit and the same products rounded once each, in a pass each instead of
    torch's six and four (30% of an int8 batch step's time, profiled on ``small``). None while it is not loaded:
    the torch ops above then."""
    return loaded_ops()


_VNNI_OPS: Any = None


def vnni_ops() -> Any:
    """The compiled ops (``_row_kernels``) when their build has the AVX-512 VNNI matrix-vector kernel
    (``int8_gemv``), else None: few rows then go to ``torch._weight_int8pack_mm``."""
    global _VNNI_OPS
    if _VNNI_OPS is None:
        ops = _row_kernels()
        if ops is None or not ops.int8_gemv_available():
            return None
        _VNNI_OPS = ops
    return _VNNI_OPS


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` on this CPU returns exact int32 sums, checked once per process on products that
    reach int16's limits.

    oneDNN's int8 matmul on CPUs without VNNI or AMX int8 (AVX2 only; AVX-512 without VNNI, as Skylake) multiplies
    u8 by s8 pairs into saturating int16 (``vpmaddubsw``): with ``ONEDNN_MAX_CPU_ISA=AVX2`` on the project's AMX
    machine, 16,383 of 16,384 sums of a random [64, 512] by [512, 256] product were wrong, by up to 130,077. There
    W8A8 would be wrong, so ``Int8Linear`` multiplies by its dequantized weight instead.
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (256, 32), dtype=torch.int8, generator=generator)
    a[0], b[:, 0] = 127, 127  # 256 * 127^2: every pair of products over int16's range
    exact = (a.double() @ b.double()).to(torch.int64)
    try:
        return bool(torch.equal(torch._int_mm(a, b).to(torch.int64), exact))
    except RuntimeError:  # a build without an int8 matmul on this CPU
        return False


@functools.cache
def has_int8_dot_products() -> bool:
    """Whether this CPU's ``/proc/cpuinfo`` flags name int8 dot-product instructions (``INT8_DOT_FLAGS``),
    which oneDNN's int8 product (``torch._int_mm``) and ``int8_gemv`` run on. Without them oneDNN's product either
    saturates its sums (``int_mm_is_exact``: an Intel Xeon held to AVX2) or is exact and slow (an AMD Zen 3: 124 ms
    for 64 rows of small's gate_up projection, against 1.6 ms through ``int8_panel_linear``)."""
    return bool(cpu_flags() & INT8_DOT_FLAGS)


def int8_panel_ops() -> Any:
    """The compiled ops (``_row_kernels``) when int8 products on this CPU go to ``int8_panel_linear``: its build has
    the AVX2 kernel and the CPU has no int8 dot products (``has_int8_dot_products``; with them oneDNN's int8 product
    runs on them, and ``int8_gemv`` too where they are AVX-512 VNNI). Else None."""
    return None if has_int8_dot_products() else compiled_ops_where("int8_panel_linear_available")


def pack_int8_panels(weight_int8: torch.Tensor) -> torch.Tensor:
    """int8 ``weight_int8`` [out_features, in_features] -> contiguous int8 [ceil(out_features / 16),
    ceil(in_features / 2), 16, 2] with ``panels[p, j, f, i] = weight_int8[16 p + f, 2 j + i]``, zero past
    out_features and in_features: the layout ``int8_panel_linear`` multiplies (per pair of in_features, a panel's
    16 output features in 32 contiguous bytes)."""
    out_features, in_features = weight_int8.shape
    num_panels, pairs = -(-out_features // INT8_PANEL_WIDTH), -(-in_features // 2)
    padded = weight_int8.new_zeros(num_panels * INT8_PANEL_WIDTH, pairs * 2)
    padded[:out_features, :in_features] = weight_int8
    return padded.view(num_panels, INT8_PANEL_WIDTH, pairs, 2).transpose(1, 2).contiguous()


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

    With ``panels`` (where ``int8_panel_ops`` holds: AVX2 without int8 dot products) it keeps a second copy in
    panels (``pack_int8_panels``), which every row count multiplies through ``int8_panel_linear`` (W8A8). Otherwise
    few rows: ``int8_gemv`` (VNNI) or weight-only (``torch._weight_int8pack_mm``); more: W8A8
    (``int8_linear_w8a8``), or on a CPU where ``torch._int_mm`` is not exact (``int_mm_is_exact``) the dequantized
    weight.

    ``x`` [..., in_features] in float32 or bfloat16 -> [..., out_features] in ``x``'s dtype.
    """

    weight_int8: torch.Tensor  # [out_features, in_features] int8, a buffer
    weight_sums: torch.Tensor  # [out_features] int32: each row's sum, a buffer
    scales: torch.Tensor  # [out_features] float32, a buffer
    scales_bf16: torch.Tensor  # [out_features] bfloat16: torch._weight_int8pack_mm wants the activations' dtype
    weight_panels: torch.Tensor | None  # pack_int8_panels(weight_int8) where int8_panel_linear serves, a buffer

    def __init__(self, linear: nn.Linear, panels: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_int8_per_channel(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))
        self.register_buffer("weight_sums", q.sum(dim=1, dtype=torch.int32))  # int8_gemv's u8 offset correction
        self.register_buffer("weight_panels", pack_int8_panels(q) if panels else None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        panel_ops = int8_panel_ops() if self.weight_panels is not None else None
        if panel_ops is not None:
            return self._forward_panels(panel_ops, x)
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        vnni = vnni_ops() if 1 <= x.shape[0] <= INT8PACK_MAX_ROWS and x.is_contiguous() else None
        if vnni is not None:
            return self._forward_vnni(vnni, x)
        if x.shape[0] <= INT8PACK_MAX_ROWS and self.in_features % INT8PACK_IN_FEATURES_MULTIPLE == 0:
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight_int8, self.scales_bf16).to(x.dtype)
            return out if self.bias is None else out + self.bias
        if int_mm_is_exact():
            return int8_linear_w8a8(x, self.weight_int8, self.scales, self.bias)
        weight = self.dequantized_weight().to(x.dtype)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def _forward_vnni(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        """Few rows on a CPU with AVX-512 VNNI: the compiled matrix-vector kernel (``int8_gemv``) quantizes the
        activations per row as in W8A8 and reads each int8 weight row once with integer dot products, in one call."""
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
        ops.int8_gemv(out, x, None, self.weight_int8, self.scales, self.weight_sums, bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _forward_panels(self, ops: Any, x: torch.Tensor) -> torch.Tensor:
        """Any number of rows on a CPU without VNNI: the activations quantized per row as in W8A8, then
        ``int8_panel_linear`` over ``weight_panels`` (exact int32 sums, each rescaled once)."""
        x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        if x2.shape[0] > 0:
            x_int8, x_scales = _quantize_rows(ops, x2)
            bias = self.bias if self.bias is None or self.bias.dtype == torch.float32 else self.bias.float()
            ops.int8_panel_linear(out, x_int8, x_scales, self.weight_panels, self.scales, bias)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """``q * scales[:, None]`` [out_features, in_features] float32: the weight this layer multiplies by."""
        return self.weight_int8.float() * self.scales[:, None]


def quantize_linear_weights(model: nn.Module) -> int:
    """Replace every ``Linear`` of a CPU ``model`` (the decoders' fused qkv, o, gate_up and down projections,
    an untied LM head, a vision tower's) by its ``Int8Linear``, with int8 panels where ``int8_panel_ops`` holds (so
    load the compiled kernels first); returns how many. Call it after the weights are loaded and instead of
    ``prepack_linear_weights``.

    Raises:
        ValueError: a weight on a device other than the CPU (``torch._weight_int8pack_mm`` is CPU-only here).
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    panels = int8_panel_ops() is not None
    for name, module in targets:
        if module.weight.device.type != "cpu":
            raise ValueError(f"int8 quantization runs on CPU only; {name} is on {module.weight.device}")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int8Linear(module, panels=panels))
    notify_weights_replaced(model)
    return len(targets)
