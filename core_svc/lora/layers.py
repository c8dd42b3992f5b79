"""The low-rank update inside the projections, for a batch that mixes adapters (punica's / vLLM's
``PunicaWrapper`` shrink and expand, in plain torch).

Every adapted projection (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` of each decoder layer)
becomes a ``LoRALinear``: the base projection plus ``max_loras`` slots of stacked weights, A
``[max_loras, num_slices * max_lora_rank, in_features]`` and a block-diagonal B
``[max_loras, out_features, num_slices * max_lora_rank]`` (slice s of a fused projection: rows of its output
slice, columns ``s * max_lora_rank ...``). The model runner orders a step's requests by adapter (within decodes
and within prefills), so a step's ``LoRABatch`` is a few segments of consecutive token rows, each under one slot
(punica's SGMV segments): each segment's rows are shrunk (``x @ A.T``), expanded (``@ B.T``) and added to the base
output in place. Rows of requests without an adapter are left as the base computed them, and a step in which no
request uses an adapter runs the base projection only (one attribute check per projection).

Why a loop over segments rather than one gather of per-token weights (punica's BGMV) or every token against
every adapter (masked): gathering ``[num_tokens, rank, in_features]`` weights costs memory and bandwidth per token
that dwarf the update itself on CPU, and the masked form multiplies by every adapter of the step; the loop runs
at most two pairs of dense matmuls per adapter of the step (docs/benchmarks.md has the measurement). The same code
runs on CUDA tensors (no Triton kernel: the segments' matmuls are cuBLAS calls).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from core_svc.lora.adapter import NUM_SLICES
from core_svc.models.layers import AdapterWrapper, notify_weights_replaced

# A decoder projection the core adapts: "model.layers.3.self_attn.qkv_proj" -> (3, "qkv_proj").
_MODULE = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class LoRASlots:
    """The size and place of every projection's adapter slots."""

    max_loras: int  # slots: adapters one step can use
    max_lora_rank: int  # columns per slice; lower ranks are zero-padded
    dtype: torch.dtype  # the model's activations'
    device: torch.device


@dataclass
class LoRABatch:
    """One step's adapter rows, shared by every ``LoRALinear`` (set by the model runner before the forward;
    vLLM's ``LoRAMapping`` / punica metadata)."""

    # (slot, first token row, end row) of each run of consecutive rows under one adapter; empty: none this step
    segments: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return bool(self.segments)


class LoRALinear(AdapterWrapper):
    """A projection with ``max_loras`` adapter slots (see the module docstring).

    Args:
        base: the projection (``Linear``, quantized or prepacked alike): ``[num_tokens, in_features]`` ->
            ``[num_tokens, out_features]``.
        slice_sizes: output features of each slice, in order (q, k, v for ``qkv_proj``; gate, up).
        batch: the step's rows, shared with the model runner.
    """

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slice_sizes: list[int],
        slots: LoRASlots,
        batch: LoRABatch,
    ) -> None:
        super().__init__()
        self.base = base
        self.slice_sizes = slice_sizes
        self.max_lora_rank = slots.max_lora_rank
        self.batch = batch
        width = len(slice_sizes) * slots.max_lora_rank
        self.lora_a: torch.Tensor  # [max_loras, num_slices * max_lora_rank, in_features]
        self.lora_b: torch.Tensor  # [max_loras, out_features, num_slices * max_lora_rank]
        dtype, device = slots.dtype, slots.device
        self.register_buffer("lora_a", torch.zeros(slots.max_loras, width, in_features, dtype=dtype, device=device))
        out_features = sum(slice_sizes)
        self.register_buffer("lora_b", torch.zeros(slots.max_loras, out_features, width, dtype=dtype, device=device))

    def set_slot(self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> None:
        """Put an adapter's slices (``LoRAModel.weights`` of this module; None: it leaves the module alone) in
        ``slot``; ranks below ``max_lora_rank`` are zero-padded."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if slices is None:
            return
        row = 0
        for s, (size, pair) in enumerate(zip(self.slice_sizes, slices, strict=True)):
            if pair is not None:
                a, b = pair  # [rank, in_features], [size, rank]
                rank, column = a.shape[0], s * self.max_lora_rank
                self.lora_a[slot, column : column + rank].copy_(a)
                self.lora_b[slot, row : row + size, column : column + rank].copy_(b)
            row += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # [num_tokens, out_features]
        if self.batch.segments:
            add_lora(out, x, self.lora_a, self.lora_b, self.batch.segments)
        return out


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    segments: list[tuple[int, int, int]],
) -> None:
    """``out[start:end] += (x[start:end] @ lora_a[slot].T) @ lora_b[slot].T`` for each (slot, start, end):
    punica's SGMV shrink then expand. ``out`` ``[num_tokens, out_features]``, ``x`` ``[num_tokens, in_features]``,
    ``lora_a`` ``[max_loras, width, in_features]``, ``lora_b`` ``[max_loras, out_features, width]``; in place."""
    for slot, start, end in segments:
        shrunk = x[start:end] @ lora_a[slot].t()  # [end - start, num_slices * max_lora_rank]
        out[start:end].add_(shrunk @ lora_b[slot].t())


def wrap_lora_modules(
    model: nn.Module, slice_sizes: dict[str, list[int]], slots: LoRASlots, batch: LoRABatch
) -> dict[tuple[int, str], LoRALinear]:
    """Replace every adaptable decoder projection of a Llama-family ``model`` by a ``LoRALinear`` around it.

    Args:
        slice_sizes: core module name -> its slices' output features (``core_svc.models.llama.fused_shard_sizes``).

    Returns:
        (layer index, module name) -> its ``LoRALinear``.

    Raises:
        ValueError: the model has no adaptable projection (not a Llama-family decoder).
    """
    wrapped: dict[tuple[int, str], LoRALinear] = {}
    for name, module in list(model.named_modules()):
        match = _MODULE.match(name)
        if match is None:
            continue
        layer, kind = int(match[1]), match[2]
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        in_features = _in_features(module)
        sizes = slice_sizes[kind]
        if len(sizes) != NUM_SLICES[kind]:
            raise ValueError(f"{name}: {len(sizes)} slices, LoRA expects {NUM_SLICES[kind]}")
        lora_module = LoRALinear(module, in_features, sizes, slots, batch)
        setattr(parent, kind, lora_module)
        wrapped[(layer, kind)] = lora_module
    if not wrapped:
        raise ValueError("the model has no decoder projection LoRA adapters apply to (Llama-family models only)")
    notify_weights_replaced(model)  # a one-call decoder built before holds the projections without their adapters
    return wrapped


def _in_features(module: nn.Module) -> int:
    value = getattr(module, "in_features", None)
    if not isinstance(value, int):
        raise ValueError(f"{type(module).__name__} does not say its in_features")
    return value
