"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``): a ViT
with 2-D rotary and a patch merger, and a Qwen2 decoder with M-RoPE, over a flattened batch with a paged KV cache.

Follows transformers' ``models/qwen2_vl/modeling_qwen2_vl.py`` (``Qwen2VisionTransformerPretrainedModel``,
``Qwen2VLTextModel``) and ``models/qwen2_5_vl/modeling_qwen2_5_vl.py`` (window attention, RMSNorm, gated MLP in
the tower), and vLLM's ``model_executor/models/qwen2_vl.py`` / ``qwen2_5_vl.py``. Parameter names are the checkpoint's
(``visual.*``, ``model.*``, ``lm_head``) except the language model's fused q/k/v and gate/up, as in ``llama.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from core_svc.image_processor_config import ImageProcessorConfig
from core_svc.models.arch import ModelArchConfig
from core_svc.models.interfaces import SupportsMultiModal
from core_svc.models.layers import Linear, RMSNorm, tied_lm_head
from core_svc.models.llama import LlamaModel, fused_param_name, fused_shard_sizes
from core_svc.models.mrope import MRotaryEmbedding, get_mrope_input_positions
from core_svc.models.multimodal import FLOAT_DTYPES, wire_tensor_violation
from core_svc.request import MultiModalFeature, MultiModalTensor
from kernels import AttentionBackend, AttentionMetadata

# Qwen2VLImageProcessor's default bound on an image's resized width * height, where the checkpoint gives none
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}


@dataclass(frozen=True)
class Qwen2VisionConfig:
    """The vision tower's shape, from transformers' ``Qwen2VLVisionConfig`` or ``Qwen2_5_VLVisionConfig``.

    Qwen2.5-VL's tower differs in data only: RMSNorm for LayerNorm, a gated MLP (gate/up/down with bias) for
    fc1/fc2, and attention within windows of ``window_size`` pixels except in ``fullatt_block_indexes``.
    """

    depth: int
    embed_dim: int
    hidden_size: int  # the language model's hidden size: the merger's output
    hidden_act: str
    intermediate_size: int  # the blocks' MLP width
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    rope_theta: float
    rms_norm: bool  # Qwen2.5-VL: RMSNorm in the blocks and the merger; Qwen2-VL: LayerNorm
    gated_mlp: bool  # Qwen2.5-VL: down(act(gate(x)) * up(x)); Qwen2-VL: fc2(act(fc1(x)))
    window_size: int | None  # Qwen2.5-VL: side of an attention window in pixels; None: per-frame attention only
    fullatt_block_indexes: tuple[int, ...]  # blocks that attend over the whole frame despite windows

    @classmethod
    def from_hf_config(cls, config: Any) -> Qwen2VisionConfig:
        rope = getattr(config, "rope_parameters", None) or {}
        common = dict(
            depth=config.depth,
            hidden_act=config.hidden_act,
            num_heads=config.num_heads,
            in_channels=config.in_channels,
            patch_size=config.patch_size,
            spatial_merge_size=config.spatial_merge_size,
            temporal_patch_size=config.temporal_patch_size,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if getattr(config, "out_hidden_size", None) is not None:  # Qwen2.5-VL: hidden_size is the tower's width
            return cls(
                **common,
                embed_dim=config.hidden_size,
                hidden_size=config.out_hidden_size,
                intermediate_size=config.intermediate_size,
                rms_norm=True,
                gated_mlp=True,
                window_size=config.window_size,
                fullatt_block_indexes=tuple(config.fullatt_block_indexes),
            )
        return cls(
            **common,
            embed_dim=config.embed_dim,
            hidden_size=config.hidden_size,
            intermediate_size=int(config.embed_dim * config.mlp_ratio),
            rms_norm=False,
            gated_mlp=False,
            window_size=None,
            fullatt_block_indexes=(),
        )

    @property
    def head_size(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: ``in_channels * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def vision_rotary_positions(grid_thw: torch.Tensor, spatial_merge_size: int) -> torch.Tensor:
    """(h, w) of every patch ``[num_patches, 2]`` int64, patches in the processor's order: frames, then merge
    windows row-major, then the ``merge x merge`` patches of a window row-major (transformers'
    ``vision_utils.get_vision_position_ids``). ``grid_thw``: ``[num_images, 3]`` int64."""
    rows = []
    for t, h, w in grid_thw.tolist():
        hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // spatial_merge_size, spatial_merge_size, w // spatial_merge_size, spatial_merge_size)
        hw = torch.stack([hpos.reshape(block).transpose(1, 2).flatten(), wpos.reshape(block).transpose(1, 2).flatten()])
        rows.append(hw.t().repeat(t, 1))
    return torch.cat(rows)


def vision_window_index(grid_thw: torch.Tensor, cfg: Qwen2VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's attention windows over merged tokens (transformers' ``vision_utils.get_vision_window_index``,
    vLLM's ``Qwen2_5_VisionTransformer.get_window_index``).

    Each frame's merged grid ``(h // merge, w // merge)`` is cut into squares of
    ``window_size // merge // patch_size`` merged tokens from the top left (the last row and column of windows
    may be partial). Returns the merged-token order that lists the windows one after another (frame by frame,
    windows row-major, tokens row-major within a window) ``[num_merged_tokens]`` int64, and the cumulative patch
    counts at window boundaries ``[num_windows + 1]`` (empty windows dropped).
    """
    if cfg.window_size is None:
        raise ValueError("vision_window_index needs a window_size")
    side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
    unit = cfg.spatial_merge_size**2
    order: list[torch.Tensor] = []
    cu_seqlens, first = [0], 0
    for t, h, w in grid_thw.tolist():
        grid_h, grid_w = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        index = torch.arange(first, first + t * grid_h * grid_w).view(t, grid_h, grid_w)
        for frame in index:
            for top in range(0, grid_h, side):
                for left in range(0, grid_w, side):
                    window = frame[top : top + side, left : left + side].flatten()
                    order.append(window)
                    cu_seqlens.append(cu_seqlens[-1] + len(window) * unit)
        first += t * grid_h * grid_w
    return torch.cat(order), cu_seqlens


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionAttention(nn.Module):
    """Full (non-causal) attention within each span of ``cu_seqlens`` (a frame of an image, or a Qwen2.5-VL
    window), one SDPA call per span as transformers' non-flash path; 2-D RoPE on q and k in float32."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_size = cfg.num_heads, cfg.head_size
        self.qkv = Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True, dtype=dtype)
        self.proj = Linear(cfg.embed_dim, cfg.embed_dim, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [num_patches, embed_dim]; rope: cos, sin [num_patches, 1, head_size] float32
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, self.head_size).unbind(1)
        cos, sin = rope
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        outs = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            # [1, heads, span, head_size] per span
            qi, ki, vi = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(num_patches, -1))


class VisionMlp(nn.Module):
    """Qwen2-VL: fc2(act(fc1(x)))."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.embed_dim, cfg.intermediate_size, bias=True, dtype=dtype)
        self.fc2 = Linear(cfg.intermediate_size, cfg.embed_dim, bias=True, dtype=dtype)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), with biases, under the checkpoint's unfused names."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.embed_dim, cfg.intermediate_size, bias=True, dtype=dtype)
        self.up_proj = Linear(cfg.embed_dim, cfg.intermediate_size, bias=True, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.embed_dim, bias=True, dtype=dtype)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _vision_norm(cfg: Qwen2VisionConfig, dtype: torch.dtype) -> nn.Module:
    if cfg.rms_norm:
        return RMSNorm(cfg.embed_dim, 1e-6, dtype)
    return nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype)


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _vision_norm(cfg, dtype)
        self.norm2 = _vision_norm(cfg, dtype)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp: nn.Module = VisionGatedMlp(cfg, dtype) if cfg.gated_mlp else VisionMlp(cfg, dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, rope)
        return x + self.mlp(self.norm2(x))


class _ConvWeight(nn.Module):
    """Holds a convolution's weight under the checkpoint's name (``proj.weight``)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class PatchEmbed(nn.Module):
    """transformers' Conv3d patch embedding (kernel = stride = patch) computed as one matmul over flattened
    patches; the weight keeps the checkpoint's ``[embed_dim, C, T, P, P]`` shape."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = _ConvWeight(shape, dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # [num_patches, C * T * P * P] -> [num_patches, embed_dim]
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class PatchMerger(nn.Module):
    """LayerNorm, then each ``merge x merge`` window's patches concatenated and projected by a GELU MLP to the
    language model's hidden size."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged_dim = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = _vision_norm(cfg, dtype)
        self.mlp = nn.Sequential(
            Linear(self.merged_dim, self.merged_dim, bias=True, dtype=dtype),
            nn.GELU(),
            Linear(self.merged_dim, cfg.hidden_size, bias=True, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_patches, embed_dim] -> [num_patches // merge**2, hidden_size]
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


class Qwen2VisionTransformer(nn.Module):
    """The Qwen2-VL ViT: pixel patches of one or more images -> their merged tokens' embeddings."""

    def __init__(self, cfg: Qwen2VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, dtype)

    def rope(self, grid_thw: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[num_patches, 1, head_size]`` float32: the h angles then the w angles, twice
        (transformers' ``Qwen2VLVisionRotaryEmbedding``, axial)."""
        spatial = self.cfg.head_size // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        inv_freq = (1.0 / (self.cfg.rope_theta**exponents)).to(device)
        positions = vision_rotary_positions(grid_thw, self.cfg.spatial_merge_size).to(device)
        freqs = positions[..., None].float() * inv_freq  # [num_patches, 2, head_size // 4]
        angles = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
        return angles.cos(), angles.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values`` ``[num_patches, C * T * P * P]`` of the images in order, ``grid_thw`` ``[num_images, 3]``
        int64 -> embeddings ``[num_patches // merge**2, hidden_size]`` in the model dtype.

        Raises:
            ValueError: the patch count or patch size disagrees with ``grid_thw`` and the config.
        """
        num_patches = int(grid_thw.prod(-1).sum())
        if pixel_values.shape != (num_patches, self.cfg.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, grid_thw {grid_thw.tolist()} implies "
                f"({num_patches}, {self.cfg.patch_dim})"
            )
        # Attention runs within each frame of each image (transformers' get_vision_cu_seqlens).
        frame_sizes = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        cu_seqlens = [0, *frame_sizes.cumsum(0).tolist()]
        hidden = self.patch_embed(pixel_values)
        cos, sin = self.rope(grid_thw, hidden.device)
        if self.cfg.window_size is None:
            for block in self.blocks:
                hidden = block(hidden, cu_seqlens, (cos, sin))
            return self.merger(hidden)
        # Qwen2.5-VL: patches regrouped window by window (whole merge groups move), attention within each window
        # but in the full-attention blocks, and the merged tokens put back in the processor's order.
        window_index, cu_window_seqlens = vision_window_index(grid_thw, self.cfg)
        unit = self.cfg.spatial_merge_size**2
        order = (window_index[:, None] * unit + torch.arange(unit)).flatten().to(hidden.device)
        hidden, rope = hidden[order], (cos[order], sin[order])
        for i, block in enumerate(self.blocks):
            full = i in self.cfg.fullatt_block_indexes
            hidden = block(hidden, cu_seqlens if full else cu_window_seqlens, rope)
        return self.merger(hidden)[torch.argsort(window_index).to(hidden.device)]


def image_max_pixels(image_processor: Mapping[str, Any], source: str = "the image processor settings") -> int:
    """The largest image area in pixels of an image processor's settings (``source`` names where they were read,
    for errors): ``ImageProcessorConfig.max_pixels``, else transformers' default.

    Raises:
        ValueError: naming ``source`` and the key: "size" not a JSON object, a bound not a positive integer.
    """
    return ImageProcessorConfig(image_processor, source).max_pixels() or DEFAULT_MAX_PIXELS


def tensor_from_wire(item: MultiModalTensor) -> torch.Tensor:
    """The tensor of a ``MultiModalTensor`` (row-major little-endian bytes), on the CPU.

    Raises:
        ValueError: unknown dtype, or a byte count that disagrees with the shape.
    """
    dtype = _TORCH_DTYPES.get(item.dtype)
    if dtype is None:
        raise ValueError(f"unknown tensor dtype {item.dtype!r}; known: {', '.join(_TORCH_DTYPES)}")
    flat = torch.frombuffer(bytearray(item.data), dtype=dtype) if item.data else torch.empty(0, dtype=dtype)
    if flat.numel() != int(torch.tensor(item.shape).prod()):
        raise ValueError(f"{len(item.data)} bytes of {item.dtype} do not make shape {item.shape}")
    return flat.view(item.shape)


class Qwen2VLForConditionalGeneration(SupportsMultiModal):
    """Serves ``Qwen2VLForConditionalGeneration`` and ``Qwen2_5_VLForConditionalGeneration`` checkpoints: images
    through ``embed_multimodal``, merged by the model runner into ``inputs_embeds``; positions ``[3, num_tokens]``
    (``uses_mrope``; 1-D positions serve text-only batches, all three streams being equal there)."""

    uses_mrope = True

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.vision_config is None:
            raise ValueError("Qwen2-VL needs a vision_config")
        self.cfg = cfg
        self.vision_cfg = Qwen2VisionConfig.from_hf_config(cfg.vision_config)
        self.visual = Qwen2VisionTransformer(self.vision_cfg, dtype)
        if cfg.mrope_section is None:
            raise ValueError("Qwen2-VL needs rope_parameters.mrope_section in its text_config")
        rotary = MRotaryEmbedding(
            cfg.rope_inv_freq, cfg.rope_attention_scaling, cfg.max_position_embeddings, dtype, cfg.mrope_section
        )
        self.model = LlamaModel(cfg, backend, dtype, rotary)  # the Qwen2 decoder under M-RoPE
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype=dtype)
        # The image processor resizes to multiples of patch * merge within max_pixels, but an image at the aspect
        # ratio limit keeps a short side of one unit: ImageProcessorConfig.max_image_tokens.
        unit = self.vision_cfg.patch_size * self.vision_cfg.spatial_merge_size
        processor = ImageProcessorConfig(cfg.image_processor, "the image processor settings")
        self._max_tokens_per_mm_item = processor.max_image_tokens(unit, DEFAULT_MAX_PIXELS)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[num_tokens, hidden_size]`` of ``input_ids`` ``[num_tokens]``."""
        return self.model.embed_tokens(input_ids)

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The embeddings ``[feature.length, hidden_size]`` (model dtype) of one image item: its ``pixel_values``
        ``[num_patches, C * T * P * P]`` and ``image_grid_thw`` ``[3]`` (or ``[1, 3]``) int64, as transformers'
        ``Qwen2VLImageProcessor`` makes them, through the vision tower.

        Raises:
            ValueError: a modality other than image, a missing tensor, or shapes that disagree with each other,
                the config or ``feature.length``.
        """
        if feature.modality != "image":
            raise ValueError(f"Qwen2-VL takes image items here, not {feature.modality!r}")
        missing = {"pixel_values", "image_grid_thw"} - set(feature.data)
        if missing:
            raise ValueError(f"image item {feature.identifier} lacks {sorted(missing)}")
        device = self.model.embed_tokens.weight.device
        grid_thw = tensor_from_wire(feature.data["image_grid_thw"]).long().reshape(1, 3)
        merge = self.vision_cfg.spatial_merge_size
        if int(grid_thw.prod()) // merge**2 != feature.length:
            raise ValueError(
                f"image item {feature.identifier}: grid {grid_thw[0].tolist()} makes "
                f"{int(grid_thw.prod()) // merge**2} tokens, its placeholder range has {feature.length}"
            )
        pixel_values = tensor_from_wire(feature.data["pixel_values"]).to(device)
        return self.visual(pixel_values, grid_thw)

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Images of any sizes through the tower in one call (it attends within each image by ``cu_seqlens``):
        ``[feature.length, hidden_size]`` each, as ``embed_multimodal``."""
        if len(features) < 2:
            return [self.embed_multimodal(feature) for feature in features]
        for feature in features:
            violation = self.mm_feature_violation(feature)
            if violation is not None:
                raise ValueError(f"image item {feature.identifier}: {violation}")
        device = self.model.embed_tokens.weight.device
        grids = torch.cat([tensor_from_wire(f.data["image_grid_thw"]).long().reshape(1, 3) for f in features])
        pixel_values = torch.cat([tensor_from_wire(f.data["pixel_values"]) for f in features]).to(device)
        embeddings = self.visual(pixel_values, grids)  # [sum of lengths, hidden_size]
        return list(embeddings.split([f.length for f in features]))

    @property
    def max_tokens_per_mm_item(self) -> int:
        return self._max_tokens_per_mm_item

    def dummy_mm_feature(self) -> MultiModalFeature:
        """An image of ``max_tokens_per_mm_item`` tokens: a merged grid 1 x n (patch grid 1 x merge x n * merge),
        zero pixels."""
        merge, num_tokens = self.vision_cfg.spatial_merge_size, self.max_tokens_per_mm_item
        grid = (1, merge, num_tokens * merge)
        shape = (num_tokens * merge * merge, self.vision_cfg.patch_dim)
        data = {
            "pixel_values": MultiModalTensor("float32", shape, bytes(4 * shape[0] * shape[1])),
            "image_grid_thw": MultiModalTensor("int64", (3,), torch.tensor(grid, dtype=torch.int64).numpy().tobytes()),
        }
        return MultiModalFeature("image", "profile", 0, num_tokens, data)

    def mm_feature_violation(self, feature: MultiModalFeature) -> str | None:
        """An image item: ``image_grid_thw`` int64 ``[3]`` (or ``[1, 3]``) with h and w multiples of the merge
        size, ``pixel_values`` ``[t * h * w, patch_dim]`` float, ``t * h * w // merge**2`` placeholder tokens, at
        most ``max_tokens_per_mm_item``."""
        if feature.modality != "image":
            return f"modality {feature.modality!r} is not supported by Qwen2-VL; it takes image"
        grid_tensor = feature.data.get("image_grid_thw")
        grid_shape = (1, 3) if grid_tensor is not None and tuple(grid_tensor.shape) == (1, 3) else (3,)
        violation = wire_tensor_violation("image_grid_thw", grid_tensor, grid_shape, ("int64",))
        if violation is not None or grid_tensor is None:  # (None always has a violation)
            return violation
        t, h, w = tensor_from_wire(grid_tensor).reshape(3).tolist()
        merge = self.vision_cfg.spatial_merge_size
        if min(t, h, w) < 1 or h % merge or w % merge:
            return f"data['image_grid_thw'] {[t, h, w]} must be positive, h and w multiples of {merge}"
        pixels = feature.data.get("pixel_values")
        violation = wire_tensor_violation("pixel_values", pixels, (t * h * w, self.vision_cfg.patch_dim), FLOAT_DTYPES)
        if violation is not None:
            return violation
        num_tokens = t * h * w // merge**2
        if feature.length != num_tokens:
            return f"length {feature.length}: grid {[t, h, w]} makes {num_tokens} placeholder tokens"
        if num_tokens > self.max_tokens_per_mm_item:
            return (
                f"length {feature.length}: larger than this model's largest image ({self.max_tokens_per_mm_item} "
                f"tokens, from its image processor's max_pixels and min_pixels)"
            )
        return None

    def get_mrope_input_positions(
        self, prompt_len: int, mm_features: Sequence[MultiModalFeature]
    ) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, prompt_len]`` int64 of a prompt and its ``mrope_position_delta``
        (``mrope.get_mrope_input_positions`` over its image items' offsets and ``image_grid_thw``). Computed once
        per request, while its items still carry their data.

        Raises:
            ValueError: an image item without ``image_grid_thw``, or placeholder ranges that do not fit the grids.
        """
        items = []
        for feature in mm_features:
            if feature.modality != "image":
                continue
            if "image_grid_thw" not in feature.data:
                raise ValueError(f"image item {feature.identifier} lacks image_grid_thw, which its positions need")
            grid = tensor_from_wire(feature.data["image_grid_thw"]).reshape(3).tolist()
            items.append((feature.offset, grid))
        return get_mrope_input_positions(prompt_len, items, self.vision_cfg.spatial_merge_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids`` ``[num_tokens]`` (unused where ``inputs_embeds`` ``[num_tokens, hidden_size]`` is given),
        ``positions`` ``[3, num_tokens]`` int64 (or ``[num_tokens]`` for text) -> hidden
        ``[num_tokens, hidden_size]``."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]."""
        if self.lm_head is None:  # tied: the embedding
            return tied_lm_head(hidden, self.model.embed_tokens.weight)
        return self.lm_head(hidden).float()

    def checkpoint_param_name(self, name: str) -> tuple[str, int | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard index or None); None for names to skip.
        Takes the saved layout (``visual.``, ``model.``) and transformers' in-memory one (``model.visual.``,
        ``model.language_model.``)."""
        if name.startswith("model.visual."):
            name = name.removeprefix("model.")
        elif name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        if name.startswith("model."):
            return fused_param_name(name)
        return name, None

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Output rows of each shard of a fused parameter, in shard order."""
        return fused_shard_sizes(self.cfg, fused_name)
