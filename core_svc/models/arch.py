"""Architectures we implement, as a data table, and the resolved shape of one checkpoint.

``ModelArchConfig.from_hf_config`` reads a transformers config object and fails, naming the problem and
what is supported, for anything our implementation would compute differently from transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from core_svc.errors import ModelLoadError


@dataclass(frozen=True)
class ArchFeatures:
    """How one architecture differs from Llama. A str value names the config attribute that holds it."""

    qkv_bias: bool | str
    o_bias: bool | str
    qk_norm: bool


SUPPORTED_ARCHITECTURES: dict[str, ArchFeatures] = {
    "LlamaForCausalLM": ArchFeatures(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=False),
    "MistralForCausalLM": ArchFeatures(qkv_bias=False, o_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": ArchFeatures(qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": ArchFeatures(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True),
    # Multimodal: the language model's features; its config is the checkpoint's text_config.
    "LlavaForConditionalGeneration": ArchFeatures(qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=False),
    "Qwen2VLForConditionalGeneration": ArchFeatures(qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen2_5_VLForConditionalGeneration": ArchFeatures(qkv_bias=True, o_bias=False, qk_norm=False),
}
# Multimodal architectures -> the model_type their text_config must have (the language model we run for them).
MULTIMODAL_TEXT_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": ("llama",),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl_text",),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl_text",),
}
# RoPE types whose frequency table does not depend on the sequence length (transformers' names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class AttentionDims:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rms_norm_eps: float
    sliding_window: int | None  # keys older than this many positions are not attended to; None = full


@dataclass(frozen=True)
class ModelArchConfig:
    """Everything the model code needs from a checkpoint's config.json, resolved and checked."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_size: int
    rms_norm_eps: float
    hidden_act: str
    mlp_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_attention: tuple[AttentionDims, ...]  # one per layer
    rope_inv_freq: torch.Tensor  # [head_size // 2] float32
    rope_attention_scaling: float
    dtype: torch.dtype  # the checkpoint's own dtype
    image_token_id: int | None = None  # multimodal models: the image placeholder token; None: text only
    hf_config: Any = field(default=None, compare=False, repr=False)  # the transformers config (vision settings)
    # Multimodal checkpoints: M-RoPE's [temporal, height, width] frequency sections (sum head_size // 2), and
    # transformers' vision sub-config (``config.vision_config``). None for text-only models.
    mrope_section: tuple[int, ...] | None = None
    vision_config: Any = field(default=None, compare=False, repr=False)
    # Multimodal checkpoints: their preprocessor_config.json (image size bounds), read by the loader; {} otherwise.
    image_processor: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_multimodal(self) -> bool:
        return self.image_token_id is not None

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArchConfig:
        """Resolve a transformers ``PretrainedConfig``.

        Raises:
            ModelLoadError: unsupported architecture, RoPE type, activation, layer type or quantization.
        """
        architectures = getattr(config, "architectures", None) or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"architecture {architectures or '(none in config.json)'} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if getattr(config, "quantization_config", None):
            raise ModelLoadError("quantized checkpoints (quantization_config) are not supported; use float weights")
        top_config, image_token_id = config, None
        if arch in MULTIMODAL_TEXT_MODEL_TYPES:
            config = top_config.text_config
            if config.model_type not in MULTIMODAL_TEXT_MODEL_TYPES[arch]:
                raise ModelLoadError(
                    f"{arch} with a {config.model_type!r} language model is not supported; supported: "
                    f"{', '.join(MULTIMODAL_TEXT_MODEL_TYPES[arch])}"
                )
            image_token_id = getattr(top_config, "image_token_id", None)
            if image_token_id is None:
                image_token_id = top_config.image_token_index
        hidden_act = config.hidden_act
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ModelLoadError(f"hidden_act {hidden_act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
        features = SUPPORTED_ARCHITECTURES[arch]
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        inv_freq, attention_scaling = _rope_frequencies(config, head_size)
        windows = _sliding_windows(config, arch)
        layer_attention = tuple(
            AttentionDims(
                hidden_size=config.hidden_size,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_size=head_size,
                qkv_bias=_feature(config, features.qkv_bias),
                o_bias=_feature(config, features.o_bias),
                qk_norm=features.qk_norm,
                rms_norm_eps=config.rms_norm_eps,
                sliding_window=window,
            )
            for window in windows
        )
        dtype = getattr(top_config, "dtype", None) or getattr(top_config, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_size=head_size,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=hidden_act,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(top_config, "tie_word_embeddings", False)),
            max_position_embeddings=config.max_position_embeddings,
            layer_attention=layer_attention,
            rope_inv_freq=inv_freq,
            rope_attention_scaling=attention_scaling,
            dtype=dtype,
            image_token_id=image_token_id,
            hf_config=top_config,
            mrope_section=_mrope_section(config, head_size),
            vision_config=getattr(top_config, "vision_config", None),
        )

    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V, all layers, for one token."""
        element_size = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_size * element_size


def _mrope_section(config: Any, head_size: int) -> tuple[int, ...] | None:
    """M-RoPE sections from the RoPE parameters (Qwen2-VL), checked against the head size; None without."""
    params = getattr(config, "rope_parameters", None) or {}
    section = params.get("mrope_section")
    if section is None:
        return None
    if len(section) != 3 or sum(section) != head_size // 2:
        raise ModelLoadError(f"mrope_section {section} must be 3 sizes summing to head_size // 2 = {head_size // 2}")
    return tuple(int(n) for n in section)


def _feature(config: Any, value: bool | str) -> bool:
    return bool(getattr(config, value, False)) if isinstance(value, str) else value


def _rope_frequencies(config: Any, head_size: int) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_size // 2] and cos/sin scaling, from transformers' own initializers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError("per-layer-type RoPE parameters are not supported")
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float) / head_size))
        return inv_freq, 1.0
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


def _sliding_windows(config: Any, arch: str) -> list[int | None]:
    """Per-layer sliding window: from ``layer_types`` where the config has it, else Mistral's global one."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ModelLoadError(
                f"layer_types {unknown} are not supported; supported: full_attention, sliding_attention"
            )
        return [window if t == "sliding_attention" else None for t in layer_types]
    if arch == "MistralForCausalLM":
        return [window] * num_layers
    return [None] * num_layers
