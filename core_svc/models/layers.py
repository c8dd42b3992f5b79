"""Building blocks of Llama-family decoders, written to match transformers' arithmetic op for op in float32.

On CPU, once the compiled kernels are loaded, every forward runs each layer's elementwise work in fused calls
(``fused_layer_ops``), equal to the ops here up to the order of RMSNorm's sum of squares and SiLU's exp (a few
float32 ulps), and ``--dense-decode-weights`` runs the matrix products of forwards of at most ``GEMV_MAX_ROWS``
rows (a decode step of a few requests) through the compiled matrix-vector kernel (``gemv``: float32 sums in another
order). bfloat16 weights on a CPU with AMX stay dense and need no flag for that: ``gemv`` up to ``GEMV_MAX_ROWS``
rows, the compiled AMX kernel up to ``AMX_MAX_ROWS`` (``amx_linear``), oneDNN above.

Shapes at boundaries: hidden ``[num_tokens, hidden_size]``, per-head ``[num_tokens, num_heads, head_size]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from core_svc.models.arch import AttentionDims
from kernels import AttentionBackend, AttentionMetadata
from kernels.attention.cpu_ops import loaded_ops

# Rows up to which a ``Linear`` with a dense copy (``prepack(keep_dense=True)``) uses the compiled matrix-vector
# kernel (``gemv``, kernels/attention/csrc/gemv_cpu.cpp; its limit), where the build has one for the weight's dtype:
# faster than the packed weight at 1-4 rows in bfloat16, and than the column-major weight at 2-4 rows in float32
# (about the same at one row; docs/benchmarks.md).
GEMV_MAX_ROWS = 4


def compiled_ops_where(probe: str, *args: Any) -> Any:
    """The CPU kernels' ops (``kernels.attention.cpu_ops.loaded_ops``) when they are loaded and their ``probe``
    op (``gemv_available``, ``amx_linear_available``, ...) answers true for ``args``, else None; each answer asked
    once per process (a build per process)."""
    ops = loaded_ops()
    if ops is None:
        return None
    key = (probe, *args)
    if key not in _AVAILABLE:
        _AVAILABLE[key] = bool(getattr(ops, probe)(*args))
    return ops if _AVAILABLE[key] else None


_AVAILABLE: dict[tuple[Any, ...], bool] = {}


def compiled_gemv(dtype: torch.dtype) -> Any:
    """The CPU kernels' ops when they are loaded and their build has a matrix-vector kernel for ``dtype`` (float32
    with AVX-512F, bfloat16 with AVX512_BF16), else None."""
    return compiled_ops_where("gemv_available", dtype)


# The compiled AMX kernel's shape limits (kernels/attention/csrc/amx_linear_cpu.cpp): in_features a multiple of a
# tile's 32 bfloat16 values, out_features of a tile's 16 rows.
AMX_IN_FEATURES_MULTIPLE = 32
AMX_OUT_FEATURES_MULTIPLE = 16
# Rows up to which a bfloat16 product over a dense weight goes to the AMX kernel (at 256 rows 0.94x the time of
# oneDNN's product over a prepacked weight on small's projections, where oneDNN's product of the dense weight, which
# it repacks per call, took 1.31x). Above, that F.linear: at 512 and 2048 rows (prefill chunks) it and the AMX kernel
# were each within about 10% of the packed product, which of the two ahead changing from run to run
# (docs/benchmarks.md, "bfloat16 on AMX over the dense weight").
AMX_MAX_ROWS = 256


def compiled_amx_linear() -> Any:
    """The CPU kernels' ops (``kernels.attention.cpu_ops.loaded_ops``) when they are loaded and their build can
    multiply bfloat16 on AMX over a dense weight (``amx_linear``: AMX-BF16 and AVX512_BF16 in the build, the tile
    registers granted by the kernel), else None."""
    return compiled_ops_where("amx_linear_available")


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether ``amx_linear`` takes ``weight`` as it is: a contiguous bfloat16 CPU [out_features, in_features] within
    the kernel's shape limits (``AMX_*_MULTIPLE``)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[0] > 0
        and weight.shape[1] > 0
        and weight.shape[0] % AMX_OUT_FEATURES_MULTIPLE == 0
        and weight.shape[1] % AMX_IN_FEATURES_MULTIPLE == 0
    )


def amx_linear(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., in_features] bfloat16 and ``weight`` dense bfloat16
    [out_features, in_features] that ``amx_fits`` -> bfloat16 [..., out_features]: through ``ops.amx_linear``
    (``compiled_amx_linear``; float32 sums and bias, rounded once to bfloat16) for 1 to ``AMX_MAX_ROWS`` rows, through
    ``F.linear`` for more."""
    rows = x.numel() // x.shape[-1]
    if not 1 <= rows <= AMX_MAX_ROWS:
        return F.linear(x, weight, bias)
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows, weight.shape[0], dtype=torch.bfloat16)
    ops.amx_linear(out, x2, weight, None if bias is None else bias.float())
    return out if x2 is x else out.view(*x.shape[:-1], weight.shape[0])


# Output features per panel of float32's batch layout (kernels/attention/csrc/panel_linear_cpu.cpp's kPanel).
PANEL_WIDTH = 32


def compiled_panel_linear() -> Any:
    """The CPU kernels' ops (``kernels.attention.cpu_ops.loaded_ops``) when they are loaded and their build can
    multiply float32 over a weight in panels (``panel_linear``: AVX-512F, or AVX2 with FMA, in the build), else
    None."""
    return compiled_ops_where("panel_linear_available")


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out_features, in_features] -> contiguous [ceil(out_features / PANEL_WIDTH), in_features,
    PANEL_WIDTH] in its dtype, ``panels[p, k, j] = weight[PANEL_WIDTH * p + j, k]``, the last panel's missing
    features zero: the layout ``panel_linear`` multiplies (each panel one contiguous stream of the weight)."""
    out_features, in_features = weight.shape
    full, tail = divmod(out_features, PANEL_WIDTH)
    panels = weight.new_empty(full + (tail > 0), in_features, PANEL_WIDTH)  # one copy of the weight, no more
    panels[:full].copy_(weight[: full * PANEL_WIDTH].view(full, PANEL_WIDTH, in_features).transpose(1, 2))
    if tail:
        panels[full].zero_()
        panels[full, :, :tail].copy_(weight[full * PANEL_WIDTH :].t())
    return panels


def panel_linear(
    ops: Any, x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 ``x`` [..., in_features] and ``panels = pack_panels(weight)``
    (float32; ``out_features`` its weight's) -> float32 [..., out_features], through ``ops.panel_linear``
    (``compiled_panel_linear``): each output one float32 sum over in_features in order, plus the bias, whatever
    the number of rows (a row's result does not depend on the rows beside it)."""
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32)
    if x2.shape[0] == 0:
        return out.view(*x.shape[:-1], out_features)
    ops.panel_linear(out, x2, panels, bias)
    return out if x2 is x else out.view(*x.shape[:-1], out_features)


def gemv(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``ops.gemv`` (``compiled_gemv``): ``x`` [..., in_features] of at most
    ``GEMV_MAX_ROWS`` rows in ``weight``'s dtype, ``weight`` dense [out_features, in_features] -> [...,
    out_features] in that dtype; float32 sums (and bias), rounded once to the dtype."""
    # a decode step's rows are 2-D and contiguous: no reshape, view or cast there (each torch call costs)
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=weight.dtype)
    ops.gemv(out, x2, weight, bias if bias is None or bias.dtype == torch.float32 else bias.float())
    return out if x2 is x else out.view(*x.shape[:-1], weight.shape[0])


def gemv_route(x: torch.Tensor, weight: torch.Tensor) -> Any:
    """``compiled_gemv``'s ops when ``gemv(ops, x, weight, ...)`` applies: 1 to ``GEMV_MAX_ROWS`` rows of ``x`` in
    the dtype of ``weight``, a contiguous CPU weight, a kernel for that dtype in the loaded build; else None."""
    rows = x.numel() // x.shape[-1]
    if not 1 <= rows <= GEMV_MAX_ROWS or weight.device.type != "cpu" or x.dtype != weight.dtype:
        return None
    return compiled_gemv(weight.dtype) if weight.is_contiguous() else None


def fused_layer_ops(hidden: torch.Tensor) -> Any:
    """The CPU kernels' ops (``kernels.attention.cpu_ops.loaded_ops``) for a forward of ``hidden`` [num_tokens,
    hidden_size] on CPU once they are loaded, else None. With them a decoder layer runs its elementwise work between
    matrix products in one call each (``add_rms_norm``, ``rotary_in_place``, ``silu_and_mul``;
    kernels/attention/csrc/layer_ops_cpu.cpp). One request: after a product has streamed its weights through the
    caches, every torch operator pays to bring its own code and data back, so a decode step spent milliseconds in
    20-odd small operators per layer. A batch: each operator reads and writes the whole activation again (the
    64-request float32 run of ``bench throughput`` spent 1.3 s of its 16.7 s of operators in norms, RoPE, SiLU and
    residual adds, 0.46 s fused; docs/benchmarks.md, "Fused layer ops for batches"). The values are
    transformers' up to the order of RMSNorm's sum of squares and SiLU's exp (a few float32 ulps)."""
    if hidden.device.type != "cpu" or hidden.shape[0] < 1:
        return None
    return loaded_ops()


def tied_lm_head(hidden: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
    """Logits through a tied LM head: ``hidden`` [num_rows, hidden_size] times the token embedding ``embedding``
    [vocab_size, hidden_size] (dense: it also serves lookups, so it is never prepacked) -> float32 [num_rows,
    vocab_size]. Few rows on CPU go through the compiled matrix-vector kernel where the build has one for the dtype
    (``compiled_gemv``; no copy needed), more rows in bfloat16 through the AMX kernel where it has that
    (``compiled_amx_linear``), the rest through ``F.linear``."""
    ops = gemv_route(hidden, embedding)
    if ops is not None:
        return gemv(ops, hidden, embedding, None).float()
    amx = compiled_amx_linear() if hidden.dtype == torch.bfloat16 and amx_fits(embedding) else None
    return (F.linear(hidden, embedding) if amx is None else amx_linear(amx, hidden, embedding, None)).float()


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be laid out once for the CPU's fastest product (``prepack()``).

    torch's CPU ``F.linear`` in float32 goes to MKL's sgemm, which with the weight as stored ([out_features,
    in_features], the product's transposed operand) repacks it on every call. These layouts avoid that, each
    measured faster where it is used (``small``, one thread, this project's 2-core AVX-512 machine;
    docs/benchmarks.md):

    - panels (float32, every ``Linear``, where the build has the panel kernel: AVX-512F, or AVX2 with FMA):
      ``pack_panels``'s [ceil(out_features / 32), in_features, 32], multiplied by the compiled ``panel_linear`` at
      every row count. Over the column-major layout below, small's 33 weight matrices took 0.63-0.72x the time at
      16 rows, 0.89-1.01x at 64, 0.90-0.98x at 256, about the same at one row, and the projections 0.95-1.14x at a
      1458-row prefill chunk ("float32 products over weight panels"). On an AVX2 AMD Zen 3 core they took 0.87x the
      time of the faster of the two layouts below at one row, 0.60-0.61x at two to four and 0.8x at 64 (the packed
      one beat the column-major one from three rows there; "float32 panels on AVX2"). Sums in order over
      in_features, so rounding differs from sgemm's in the order only (~1e-7 relative) and a row's result does not
      depend on the batch beside it.
    - column-major (float32's projections without the panel kernel: no AVX2): the same values stored as [in_features,
      out_features] (``weight`` is their transposed view), which sgemm multiplies as they are: a decode step's
      projections at 32-128 rows took 1.1-1.4x less time than oneDNN's packed weight, at one row 1.35x less (about
      the compiled matrix-vector kernel's rate); 2048-row prefill chunks the same alone, 1.1x more in the engine
      ("Column-major float32 weights, and a bfloat16 KV cache"). F.linear's values (bit for bit in the case
      checked; MKL sums in the same order).
    - oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, what torch's own inductor does for frozen
      CPU models): bfloat16 without AMX (AVX-512 BF16), and float32's LM head without the panel kernel, whose
      32,000-wide product it ran 1.2-1.4x faster than the column-major one from 4 rows up (1.15x slower at one
      row). Rounding differs from sgemm's in the summation order only: ~1e-7 relative.

    And one that keeps the weight as loaded: bfloat16 on a CPU with AMX (``prepack(amx=True)``), multiplied by the
    matrix-vector kernel up to ``GEMV_MAX_ROWS`` rows (one request: about twice oneDNN's packed one-row rate), by
    the compiled AMX kernel up to ``AMX_MAX_ROWS`` (decode batches: about oneDNN's packed product's time), and by
    oneDNN's own product of it above (prefill chunks: about the packed one's time), so one weight serves every step
    (``amx_linear``).
    """

    packed_weight: torch.Tensor | None = None  # oneDNN's layout; ``weight`` is then None
    panel_weight: torch.Tensor | None = None  # float32 in panels (``pack_panels``); ``weight`` is then None
    amx: bool = False  # ``weight`` dense bfloat16 for ``amx_linear`` above GEMV_MAX_ROWS rows
    # [out_features, in_features], kept beside the batch layout by prepack(keep_dense=True) for few-row inputs
    dense_weight: torch.Tensor | None = None

    def prepack(
        self, keep_dense: bool = False, column_major: bool = False, amx: bool = False, panels: bool = False
    ) -> None:
        """Lay the weight out for batches: ``amx``, as it is (bfloat16 that ``amx_fits``; the kernels must be
        loaded), for the AMX kernel, and for the matrix-vector kernel at few rows (``dense_weight`` is ``weight``
        itself: no copy); ``panels``, float32 in panels of ``PANEL_WIDTH`` output features for the panel kernel
        (``pack_panels``; ``weight`` is dropped, the panels replace it; the kernels must be loaded);
        ``column_major``, its values stored transposed (``weight`` becomes a view [out_features, in_features] of
        them, strides (1, out_features)); else oneDNN's layout (``weight`` is dropped, the packed one replaces it
        rather than doubling it). ``keep_dense``: keep the row-major weight as well (twice its memory) for inputs of
        at most ``GEMV_MAX_ROWS`` rows, through the compiled matrix-vector kernel.

        Raises:
            ValueError: ``amx`` or ``panels`` where the loaded kernels have no such kernel, or for a weight it does
                not take.
        """
        weight = self.weight.detach()
        if amx:
            if compiled_amx_linear() is None:
                raise ValueError("prepack(amx=True): the loaded CPU kernels have no AMX kernel (or none are loaded)")
            if not amx_fits(weight):
                raise ValueError(
                    f"prepack(amx=True): the AMX kernel takes a contiguous bfloat16 CPU weight with out_features a "
                    f"multiple of {AMX_OUT_FEATURES_MULTIPLE} and in_features of {AMX_IN_FEATURES_MULTIPLE}, got "
                    f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
                )
            self.amx = True
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.dense_weight = self.weight.detach() if compiled_gemv(weight.dtype) is not None else None
            return
        if panels:
            if compiled_panel_linear() is None:
                raise ValueError(
                    "prepack(panels=True): the loaded CPU kernels have no panel kernel (or none are loaded)"
                )
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() == 0:
                raise ValueError(
                    f"prepack(panels=True): the panel kernel takes a non-empty float32 CPU weight, got "
                    f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
                )
            self.dense_weight = weight if keep_dense else None
            self.panel_weight = pack_panels(weight)
            self.register_parameter("weight", None)
            return
        self.dense_weight = weight if keep_dense else None
        if column_major:
            self.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
            return
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.register_parameter("weight", None)  # what ``self.weight = None`` does to a parameter, typed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        if self.dense_weight is not None:
            ops = gemv_route(x, self.dense_weight)
            if ops is not None:
                return gemv(ops, x, self.dense_weight, self.bias)
        if self.amx and x.dtype == torch.bfloat16 and (ops := compiled_amx_linear()) is not None:
            return amx_linear(ops, x, self.weight, self.bias)
        if self.panel_weight is not None:  # laid out so only where the loaded kernels have panel_linear
            return panel_linear(loaded_ops(), x, self.panel_weight, self.out_features, self.bias)
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def prepack_linear_weights(model: nn.Module, keep_dense: bool = False) -> bool:
    """``Linear.prepack`` every ``Linear`` of a CPU model in float32 or bfloat16; returns whether it did. Float32
    weights take the panel layout where the loaded build has the panel kernel (``compiled_panel_linear``; the
    kernels must be loaded before this call, as ``model_loader.load_model`` does), else the projections take the
    column-major layout and the LM head oneDNN's (``Linear``) where torch has it. bfloat16
    weights stay as loaded for the AMX kernel where the loaded build has it (``compiled_amx_linear``; the kernels
    must be loaded before this call, as the CPU attention backend does) and the weight's shape fits
    (``amx_fits``), else take oneDNN's layout. Other dtypes and devices, and what needs oneDNN where torch has
    none, keep ``F.linear`` on the weight as loaded.

    ``keep_dense``: layers keep their dense weight for few-row inputs where the compiled matrix-vector kernel is in
    the loaded build for the dtype (``compiled_gemv``; the kernels must be loaded before this call, as
    ``model_loader.load_model`` does): every ``Linear`` but the LM head (a vision tower's and projector's included),
    and in bfloat16 the LM head too (in float32 the packed LM head was as fast as the kernel in a decode step;
    oneDNN's one-row bfloat16 path reads its weight at about 0.6x the kernel's rate). Without the kernel nothing is
    kept: the column-major float32 weight is as fast through MKL at 1-2 rows as a dense copy was."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears:
        return False
    weight = linears[0].weight
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    onednn = torch.backends.mkldnn.is_available()
    if weight.dtype == torch.bfloat16 and not (onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False  # oneDNN's bfloat16 needs AVX-512 (or AVX-NE-CONVERT); F.linear serves it then
    kernel = compiled_gemv(weight.dtype) is not None
    amx = weight.dtype == torch.bfloat16 and compiled_amx_linear() is not None
    panels = weight.dtype == torch.float32 and compiled_panel_linear() is not None
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if amx and amx_fits(module.weight):
                module.prepack(amx=True)
                continue
            lm_head = name.rpartition(".")[2] == "lm_head"
            dense = kernel and (not lm_head or weight.dtype == torch.bfloat16)
            if panels:
                module.prepack(keep_dense=keep_dense and dense, panels=True)
                continue
            column_major = weight.dtype == torch.float32 and not lm_head
            if column_major or onednn:  # a float32 LM head without oneDNN keeps F.linear on its weight
                module.prepack(keep_dense=keep_dense and dense, column_major=column_major)
    notify_weights_replaced(model)
    return True


def notify_weights_replaced(model: nn.Module) -> None:
    """Tell every module of ``model`` that keeps objects built over its weight tensors (``LlamaModel``'s few-row
    decoder, through its ``weights_replaced``) that those tensors were replaced, so they are built again when next
    used. ``prepack_linear_weights`` and ``quantize_linear_weights`` call it."""
    for module in model.modules():
        hook = getattr(module, "weights_replaced", None)
        if callable(hook):
            hook()


class AdapterWrapper(nn.Module):
    """A projection wrapped for adapters (``core_svc.lora.layers.LoRALinear``, whose package imports this one): its
    ``base`` projection, and ``batch``, the step's adapter rows shared by every wrapper of the model (``LoRABatch``:
    ``active`` when a row of the step uses an adapter). ``OneCallDecoder`` runs the base projection in steps where
    ``batch`` is not active."""

    base: nn.Module
    batch: Any


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in float32 as transformers' LlamaRMSNorm."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype == torch.float32 and x.dtype == self.weight.dtype:
            # torch's rms_norm runs the same ops (pow, mean, add, rsqrt, mul, mul) in one call from C++: the same
            # values bit for bit in float32, without six Python-level dispatches per norm. In other dtypes it rounds
            # elsewhere than transformers (it casts back after the weight's product, not before).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def forward_fused(self, ops: Any, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``fused_layer_ops``' path: ``residual += x`` in place when given, then the norm of ``residual`` (else of
        ``x``), in one call. x, residual: [num_tokens, hidden_size] in the weight's dtype."""
        out = torch.empty_like(x)
        ops.add_rms_norm(out, x, residual, self.weight, self.eps)
        return out

    def forward_in_place(self, ops: Any, x: torch.Tensor) -> None:
        """``fused_layer_ops``' norm of each row of ``x``, written over it: ``forward_fused`` without a residual.
        x: [rows, hidden_size] (rows at any stride, each contiguous) or [num_tokens, num_heads, head_size] with a
        token's heads contiguous (per-head q/k norms over a view of the fused qkv)."""
        ops.add_rms_norm(x, x, None, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al. 2021, RoFormer) with a precomputed cos/sin table.

    ``inv_freq`` and ``attention_scaling`` come from transformers' RoPE initializers, so every rope_type they
    define with a position-independent frequency table (default, linear, llama3, yarn) matches exactly.
    """

    cos: torch.Tensor  # [max_position, head_size], a buffer
    sin: torch.Tensor  # [max_position, head_size], a buffer

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, max_position: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.inv_freq = inv_freq.float().cpu()  # [head_size // 2]
        self.attention_scaling = attention_scaling
        self.max_position = max_position
        self.register_buffer("cos", torch.empty(max_position, 2 * len(inv_freq), dtype=dtype), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, 2 * len(inv_freq), dtype=dtype), persistent=False)
        if self.cos.device.type != "meta":
            self.build_table()

    def build_table(self) -> None:
        """Fill the cos/sin tables ``[max_position, head_size]`` (again after ``to_empty``), as transformers
        computes them: float32 angles, scaled, then cast to the model dtype."""
        positions = torch.arange(self.max_position, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.attention_scaling).to(device=self.cos.device, dtype=self.cos.dtype)
        self.sin = (emb.sin() * self.attention_scaling).to(device=self.sin.device, dtype=self.sin.dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` rows of ``positions`` ``[num_tokens]`` as ``[num_tokens, 1, head_size]``, gathered once per
        forward for every layer, with the first half of ``sin`` negated for ``apply_rotary``."""
        half = self.sin.shape[-1] // 2
        cos, sin = self.cos[positions], self.sin[positions].clone()
        sin[:, :half].neg_()
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[num_tokens, heads, head_size]`` with ``RotaryEmbedding.tables``: transformers'
    ``x * cos + rotate_half(x) * sin`` where ``rotate_half(x) = cat(-x2, x1)``, computed as
    ``x * cos + roll(x, half) * signed_sin``, the same products bit for bit (negation is exact) in fewer ops."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    """Self-attention with fused q/k/v projection, optional per-head q/k RMSNorm (Qwen3), RoPE, GQA, and a
    paged KV cache handled by an attention backend."""

    def __init__(
        self,
        dims: AttentionDims,
        backend: AttentionBackend,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.dims = dims
        self.q_size = dims.num_heads * dims.head_size
        self.kv_size = dims.num_kv_heads * dims.head_size
        self.qkv_proj = Linear(dims.hidden_size, self.q_size + 2 * self.kv_size, bias=dims.qkv_bias, dtype=dtype)
        self.o_proj = Linear(self.q_size, dims.hidden_size, bias=dims.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(dims.head_size, dims.rms_norm_eps, dtype) if dims.qk_norm else None
        self.k_norm = RMSNorm(dims.head_size, dims.rms_norm_eps, dtype) if dims.qk_norm else None
        self.backend = backend
        self.scale = dims.head_size**-0.5

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        ops: Any = None,
    ) -> torch.Tensor:
        # rope: RotaryEmbedding.tables of this step's positions; hidden: [num_tokens, hidden_size];
        # ops: fused_layer_ops'
        num_tokens, dims = hidden.shape[0], self.dims
        qkv = self.qkv_proj(hidden)
        # q and k as one [num_tokens, num_heads + num_kv_heads, head_size] view, so RoPE is one pass
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, dims.num_heads + dims.num_kv_heads, dims.head_size)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, dims.num_kv_heads, dims.head_size)
        if self.q_norm is not None and self.k_norm is not None:
            if ops is None:
                qk = torch.cat((self.q_norm(qk[:, : dims.num_heads]), self.k_norm(qk[:, dims.num_heads :])), dim=1)
            else:  # in place in qkv, a call per norm over every token's heads, as OneCallDecoder does
                self.q_norm.forward_in_place(ops, qk[:, : dims.num_heads])
                self.k_norm.forward_in_place(ops, qk[:, dims.num_heads :])
        if ops is None:
            qk = apply_rotary(qk, *rope)
        else:
            ops.rotary_in_place(qk, *rope)  # into qkv (or the normed copy): the same products, one call
        q, k = qk[:, : dims.num_heads], qk[:, dims.num_heads :]
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale, dims.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused in one projection (SwiGLU when act is SiLU)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        bias: bool,
        dtype: torch.dtype,
        silu: bool = False,
    ) -> None:
        """``silu``: ``act`` is SiLU (``hidden_act`` "silu"), which ``fused_layer_ops``' path fuses with the product."""
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.act = act
        self.silu = silu

    def forward(self, x: torch.Tensor, ops: Any = None) -> torch.Tensor:
        # x: [num_tokens, hidden_size]; ops: fused_layer_ops'
        gate_up = self.gate_up_proj(x)
        if ops is not None and self.silu:
            out = torch.empty(*gate_up.shape[:-1], self.intermediate_size, dtype=gate_up.dtype)
            ops.silu_and_mul(out, gate_up.contiguous())
            return self.down_proj(out)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))
