"""LLaVA-1.5 (``LlavaForConditionalGeneration``): a CLIP ViT, an MLP projector and our Llama language model.

As transformers' ``LlavaModel.get_image_features`` and vLLM's ``model_executor/models/llava.py``: the image goes
through CLIP's embeddings (patch conv, class embedding, position embeddings) and pre-LayerNorm, then the encoder
layers up to ``vision_feature_layer`` (hidden_states index: 0 is the embeddings, -2 the second-to-last layer's
output; a list concatenates several); strategy "default" drops the CLS row, "full" keeps it; the projector
(linear, ``projector_hidden_act``, linear) maps each row to the language model's hidden size. Those rows replace
the prompt's ``<image>`` placeholder embeddings (the model runner merges them, ``embed_multimodal``).

Layers past the deepest selected one and CLIP's ``post_layernorm`` are never used: not built, their checkpoint
tensors skipped (vLLM does the same). Checkpoint names: what transformers 5 saves (``vision_tower.embeddings.*``,
``multi_modal_projector.*``, ``language_model.model.*``, ``language_model.lm_head.*``), the hub's llava-hf
layout (``vision_tower.vision_model.*``), and transformers 5's module names (``model.vision_tower.*``,
``model.multi_modal_projector.*``, ``model.language_model.*``, ``lm_head.*``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from core_svc.models.arch import ModelArchConfig
from core_svc.models.interfaces import SupportsMultiModal
from core_svc.models.layers import Linear
from core_svc.models.llama import LlamaForCausalLM
from core_svc.models.multimodal import FLOAT_DTYPES, wire_tensor_to_torch, wire_tensor_violation
from core_svc.request import MultiModalFeature, MultiModalTensor
from kernels import AttentionBackend, AttentionMetadata

# checkpoint name prefix -> ours (transformers 5's layout first, then the older one, which maps to itself)
_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.", "vision_tower."),
    ("multi_modal_projector.", "multi_modal_projector."),
    ("language_model.", "language_model."),
)


class CLIPAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = Linear(hidden_size, hidden_size, dtype=dtype)
        self.k_proj = Linear(hidden_size, hidden_size, dtype=dtype)
        self.v_proj = Linear(hidden_size, hidden_size, dtype=dtype)
        self.out_proj = Linear(hidden_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_images, seq_len, hidden] -> same; full (unmasked) attention within each image, scale 1/sqrt(d)
        batch, seq_len, hidden = x.shape
        flat = x.reshape(batch * seq_len, hidden)

        def heads(proj: Linear) -> torch.Tensor:
            return proj(flat).view(batch, seq_len, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return self.out_proj(out.transpose(1, 2).reshape(batch * seq_len, hidden)).view(batch, seq_len, hidden)


class CLIPMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = Linear(hidden_size, intermediate_size, dtype=dtype)
        self.act = ACT2FN[act]
        self.fc2 = Linear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_rows, hidden] -> [num_rows, hidden]
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoder(nn.Module):
    def __init__(self, vision_config: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(vision_config, dtype) for _ in range(num_layers))


class CLIPEncoderLayer(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(x)) with fc1, the config's act, fc2."""

    def __init__(self, vision_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = vision_config.hidden_size, vision_config.layer_norm_eps
        self.self_attn = CLIPAttention(hidden, vision_config.num_attention_heads, dtype)
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = CLIPMLP(hidden, vision_config.intermediate_size, vision_config.hidden_act, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        batch, seq_len, hidden = x.shape
        h = self.layer_norm2(x).reshape(batch * seq_len, hidden)
        return x + self.mlp(h).view(batch, seq_len, hidden)


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, vision_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = vision_config.hidden_size, vision_config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype))
        self.patch_embedding = nn.Conv2d(
            vision_config.num_channels, hidden, kernel_size=patch, stride=patch, bias=False, dtype=dtype
        )
        num_positions = (vision_config.image_size // patch) ** 2 + 1
        self.position_embedding = nn.Embedding(
            num_positions, hidden, _weight=torch.empty(num_positions, hidden, dtype=dtype)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # pixel_values [num_images, 3, H, W] -> [num_images, 1 + num_patches, hidden]: CLS row first
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionModel(nn.Module):
    """CLIP's vision transformer up to layer ``num_layers`` (transformers' ``CLIPVisionTransformer``)."""

    def __init__(self, vision_config: Any, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(vision_config, dtype)
        self.pre_layrnorm = nn.LayerNorm(vision_config.hidden_size, eps=vision_config.layer_norm_eps, dtype=dtype)
        self.encoder = CLIPEncoder(vision_config, num_layers, dtype)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """hidden_states as transformers numbers them: [embeddings, layer 1's output, ...], each
        [num_images, 1 + num_patches, hidden]."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return states


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, out_features: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = Linear(in_features, out_features, bias=bias, dtype=dtype)
        self.act = ACT2FN[act]
        self.linear_2 = Linear(out_features, out_features, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [num_rows, in_features] -> [num_rows, out_features]
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(SupportsMultiModal):
    """Serves ``LlavaForConditionalGeneration`` checkpoints with a Llama language model (LLaVA-1.5)."""

    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        hf = cfg.hf_config
        vision = hf.vision_config
        layers = hf.vision_feature_layer
        layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        num_states = vision.num_hidden_layers + 1  # embeddings + each layer's output
        # hidden_states indices counted from the front: our tower stops at the deepest one
        self.feature_layers: list[int] = [i if i >= 0 else num_states + i for i in layers]
        self.num_layers = max(self.feature_layers)  # layers to run
        self.select_strategy: str = hf.vision_feature_select_strategy
        self.image_size: int = vision.image_size
        self.num_channels: int = vision.num_channels
        num_patches = (vision.image_size // vision.patch_size) ** 2
        self.num_image_tokens = num_patches + (1 if self.select_strategy == "full" else 0)
        self.vision_tower = CLIPVisionModel(vision, self.num_layers, dtype)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size * len(self.feature_layers),
            cfg.hidden_size,
            hf.projector_hidden_act,
            bool(getattr(hf, "multimodal_projector_bias", True)),
            dtype,
        )
        self.language_model = LlamaForCausalLM(cfg, backend, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The language model's final hidden states [num_tokens, hidden_size]; ``inputs_embeds`` (with image rows
        merged by the runner) replaces the token embeddings when given."""
        return self.language_model(input_ids, positions, kv_caches, metadata, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """One image's embeddings [num_image_tokens, hidden_size] from its ``pixel_values`` [3, H, W]
        (transformers' ``LlavaModel.get_image_features``)."""
        return self.embed_multimodal_batch([feature])[0]

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """Images (all of the tower's size, as ``mm_feature_violation`` ensures) through the tower in one batch:
        [num_image_tokens, hidden_size] each."""
        param = self.multi_modal_projector.linear_1.bias
        param = param if param is not None else self.language_model.model.norm.weight
        pixel_values = torch.stack(
            [wire_tensor_to_torch(f.data["pixel_values"], param.device, param.dtype) for f in features]
        )  # [num_images, 3, H, W]
        states = self.vision_tower(pixel_values)
        selected = [states[i] for i in self.feature_layers]
        if self.select_strategy == "default":
            selected = [s[:, 1:] for s in selected]  # drop the CLS row
        rows = torch.cat(selected, dim=-1)  # [num_images, num_image_tokens, vision_hidden * len(feature_layers)]
        num_images, num_tokens, width = rows.shape
        embeddings = self.multi_modal_projector(rows.reshape(num_images * num_tokens, width))
        return list(embeddings.view(num_images, num_tokens, -1).unbind(0))

    @property
    def max_tokens_per_mm_item(self) -> int:
        return self.num_image_tokens

    def dummy_mm_feature(self) -> MultiModalFeature:
        shape = (self.num_channels, self.image_size, self.image_size)
        pixels = MultiModalTensor("float32", shape, bytes(4 * math.prod(shape)))
        return MultiModalFeature("image", "profile", 0, self.num_image_tokens, {"pixel_values": pixels})

    def mm_feature_violation(self, feature: MultiModalFeature) -> str | None:
        if feature.modality != "image":
            return f"modality {feature.modality!r} is not supported by LlavaForConditionalGeneration; it takes image"
        shape = (self.num_channels, self.image_size, self.image_size)
        violation = wire_tensor_violation("pixel_values", feature.data.get("pixel_values"), shape, FLOAT_DTYPES)
        if violation is not None:
            return violation
        if feature.length != self.num_image_tokens:
            return f"length {feature.length}: an image is {self.num_image_tokens} placeholder tokens for this model"
        return None

    def checkpoint_param_name(self, name: str) -> tuple[str, int | None] | None:
        for prefix, ours in _PREFIXES:
            if name.startswith(prefix):
                name = ours + name.removeprefix(prefix)
                break
        if name.startswith("language_model."):
            target = self.language_model.checkpoint_param_name(name.removeprefix("language_model."))
            return None if target is None else ("language_model." + target[0], target[1])
        if name.startswith("vision_tower.post_layernorm."):
            return None  # after the selected layer: unused
        layers_prefix = "vision_tower.encoder.layers."
        if name.startswith(layers_prefix) and int(name.removeprefix(layers_prefix).split(".")[0]) >= self.num_layers:
            return None
        if name.endswith("position_ids"):
            return None  # a buffer some checkpoints carry
        return name, None

    def shard_sizes(self, fused_name: str) -> list[int]:
        return self.language_model.shard_sizes(fused_name.removeprefix("language_model."))
