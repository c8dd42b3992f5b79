"""Seeded random-weight Hugging Face checkpoints for tests, benchmarks and the demo (``make-test-model``).

Each checkpoint is made by transformers' own config and model classes and saved with ``save_pretrained``
(config.json, model.safetensors, generation_config.json) beside tokenizer files: the builtin tokenizer, or
a copy of a tokenizer folder. The vocabulary size is that of the tokenizer transformers' ``AutoTokenizer``
loads from the finished checkpoint.

Random weights give near-uniform logits, where greedy decoding is a coin toss between near-tied tokens. So
after transformers' initialization the weights are rescaled (larger embedding and output scale, norms and
biases away from their trivial 1 and 0) to make the next-token distribution peaked and every parameter matter.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.entrypoints.builtin_tokenizer import save_builtin_tokenizer
from splitserve.entrypoints.test_model_qwen2_vl import VL_PRESET_TABLE, make_qwen2_vl_test_model

TEXT_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
QWEN2_VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")  # their presets: test_model_qwen2_vl.VL_PRESET_TABLE
ARCHS = (*TEXT_ARCHS, "llava", *QWEN2_VL_ARCHS)
LLAVA_PRESETS = ("tiny", "small", "medium")
PRESETS = ("tiny", "small", "medium", "qwen2.5-0.5b")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    sliding_window: int  # used by mistral only, small enough that long test prompts cross it
    # None: the tokenizer's size. A fixed size may exceed it (rows no prompt uses, as Qwen2.5 pads 151665 tokens to
    # 151936 rows); it may not be smaller.
    vocab_size: int | None = None
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool | None = None  # None: tied for qwen3 only, so both paths are exercised
    rope_theta: float | None = None  # None: transformers' default for the architecture
    dtype: str = "float32"  # of the saved weights, unless make_test_model is given one


# tiny: unit tests (~1M parameters with the builtin tokenizer); small: ~60M with a 32000 vocabulary;
# medium: ~200M with a 32000 vocabulary. qwen2.5-0.5b: the shape of Qwen2.5-0.5B's config.json (494,032,768
# parameters with arch qwen2), for GPU benchmarks; about 1 GB in bfloat16, never built by the test suite.
PRESET_TABLE: dict[str, Preset] = {
    "tiny": Preset(64, 192, 4, 4, 2, 2048, 128),
    "small": Preset(512, 1408, 8, 8, 4, 4096, 1024),
    "medium": Preset(1024, 2816, 12, 16, 8, 4096, 2048),
    "qwen2.5-0.5b": Preset(
        896,
        4864,
        24,
        14,
        2,
        32768,
        4096,
        vocab_size=151936,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        dtype="bfloat16",
    ),
}

_ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_test_model(
    out_dir: Path | str,
    arch: str = "llama",
    preset: str = "tiny",
    tokenizer: Path | str | None = None,
    seed: int = 0,
    dtype: str | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a seeded random checkpoint to ``out_dir`` and return its path.

    Args:
        arch: llama, mistral, qwen2, qwen3, llava (``LlavaForConditionalGeneration``: a CLIP vision tower of
            ``VISION_PRESET_TABLE``, an MLP projector and the preset's Llama, with a ``LlavaProcessor``), or
            qwen2_vl / qwen2_5_vl (Qwen2-VL / Qwen2.5-VL with their image processor files).
        preset: a name in ``PRESETS`` (sizes in ``PRESET_TABLE``); llava: tiny, small or medium; qwen2_vl /
            qwen2_5_vl: a name in ``VL_PRESET_TABLE`` (tiny).
        tokenizer: a folder with Hugging Face tokenizer files to copy; None trains the builtin tokenizer.
        dtype: float32 or bfloat16, the dtype of the saved weights; None: the preset's.
        config_overrides: extra config fields (e.g. ``rope_parameters``), applied last.

    Raises:
        ValueError: unknown arch, preset or dtype, a tokenizer folder without tokenizer files, or a tokenizer larger
            than the preset's fixed vocabulary (checked before any weight is made).
    """
    import torch
    import transformers
    from transformers import AutoTokenizer

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if preset not in PRESETS or (arch == "llava" and preset not in LLAVA_PRESETS):
        choices = LLAVA_PRESETS if arch == "llava" else PRESETS
        raise ValueError(f"unknown preset {preset!r} for {arch}; choose from {', '.join(choices)}")
    if arch in QWEN2_VL_ARCHS and preset not in VL_PRESET_TABLE:
        raise ValueError(f"arch {arch} has presets {', '.join(VL_PRESET_TABLE)}, not {preset!r}")
    dtype = dtype or PRESET_TABLE[preset].dtype
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        save_builtin_tokenizer(out)
    else:
        _copy_tokenizer(Path(tokenizer), out)
    if arch == "llava":
        return _make_llava(out, preset, seed, dtype)
    if arch in QWEN2_VL_ARCHS:
        model = make_qwen2_vl_test_model(out, arch, preset, seed, dtype, _sharpen)
        _write_info(out, arch, preset, seed, dtype, model)
        return out
    # transformers picks the tokenizer class by the config's model_type too (Qwen2Tokenizer for qwen2/qwen3 adds
    # its own special token), so size the vocabulary by the tokenizer as loaded beside the final config.
    config = build_config(arch, preset, 0, None, None, config_overrides)
    config.save_pretrained(out)
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    fixed_vocab_size = PRESET_TABLE[preset].vocab_size
    if fixed_vocab_size is not None and fixed_vocab_size < len(hf_tokenizer):
        raise ValueError(
            f"preset {preset!r} has {fixed_vocab_size} vocabulary rows, fewer than the tokenizer's {len(hf_tokenizer)}"
        )
    config = build_config(
        arch, preset, len(hf_tokenizer), hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, config_overrides
    )
    model_class_name = _ARCH_CLASSES[arch][1]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class_name)(config)
    _sharpen(model, seed)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = hf_tokenizer.eos_token_id
    model.generation_config.bos_token_id = hf_tokenizer.bos_token_id
    model.save_pretrained(out)
    _write_info(out, arch, preset, seed, dtype, model)
    return out


def _write_info(out: Path, arch: str, preset: str, seed: int, dtype: str, model: Any) -> None:
    (out / "splitserve_test_model.json").write_text(
        json.dumps(
            {
                "arch": arch,
                "preset": preset,
                "seed": seed,
                "dtype": dtype,
                "num_parameters": sum(t.numel() for t in model.parameters()),
            },
            indent=2,
        )
        + "\n"
    )


def build_config(
    arch: str,
    preset: str,
    vocab_size: int,
    bos_token_id: int | None,
    eos_token_id: int | None,
    config_overrides: dict[str, Any] | None = None,
) -> Any:
    """The transformers config of a test checkpoint: ``PRESET_TABLE`` sizes, and ``vocab_size`` (the tokenizer's)
    unless the preset fixes its own."""
    import transformers

    p = PRESET_TABLE[preset]
    config_class_name, model_class_name = _ARCH_CLASSES[arch]
    fields: dict[str, Any] = dict(
        vocab_size=p.vocab_size or vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        head_dim=p.head_dim or p.hidden_size // p.num_attention_heads,
        max_position_embeddings=p.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=arch == "qwen3" if p.tie_word_embeddings is None else p.tie_word_embeddings,
    )
    if p.rope_theta is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": p.rope_theta}
    if arch == "mistral":
        fields["sliding_window"] = p.sliding_window
    fields.update(config_overrides or {})
    config = getattr(transformers, config_class_name)(**fields)
    config.architectures = [model_class_name]
    return config


def _sharpen(model: Any, seed: int) -> None:
    """Rescale freshly initialized weights so logits are peaked and norms/biases are not trivial."""
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
            elif "embed_tokens" in name or name.startswith("lm_head"):
                param.mul_(25.0)


def _copy_tokenizer(src: Path, out: Path) -> None:
    found = [name for name in _TOKENIZER_FILES if (src / name).is_file()]
    if not found:
        raise ValueError(f"{src} holds no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})")
    for name in found:
        shutil.copy(src / name, out / name)


# --- LLaVA-1.5 ------------------------------------------------------------------------------------------------

LLAVA_IMAGE_TOKEN = "<image>"
# LLaVA-1.5's conversation format (llava-hf's chat template): "USER: <image>\n{text} ASSISTANT:", images first.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


@dataclass(frozen=True)
class VisionPreset:
    """A CLIP vision tower's sizes (``CLIPVisionConfig``); image_size is a multiple of patch_size."""

    image_size: int  # pixels per side of the processed (resized, center-cropped) image
    patch_size: int  # pixels per side of a patch: (image_size / patch_size)^2 image tokens
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int


# tiny: 32 px, 8 px patches: 16 image tokens per image (LLaVA-1.5: 336 px, 14 px patches, 576 tokens).
VISION_PRESET_TABLE: dict[str, VisionPreset] = {
    "tiny": VisionPreset(32, 8, 32, 64, 2, 4),
    "small": VisionPreset(56, 14, 128, 512, 4, 4),
    "medium": VisionPreset(336, 14, 256, 1024, 6, 8),
}


def _make_llava(out: Path, preset: str, seed: int, dtype: str) -> Path:
    """A random ``LlavaForConditionalGeneration`` (vision_feature_layer -2, select strategy "default", gelu
    projector, as LLaVA-1.5) and its ``LlavaProcessor`` (``CLIPImageProcessor`` sized for the tower, the tokenizer
    already in ``out`` with ``<image>`` added, LLaVA-1.5's chat template), so ``AutoProcessor`` loads it."""
    import torch
    import transformers
    from transformers import AddedToken, AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    hf_tokenizer.add_tokens([AddedToken(LLAVA_IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    image_token_id = hf_tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN)
    if not isinstance(image_token_id, int):
        raise TypeError(f"the tokenizer maps {LLAVA_IMAGE_TOKEN} to {image_token_id!r}, not one id")
    vision = VISION_PRESET_TABLE[preset]
    num_image_tokens = (vision.image_size // vision.patch_size) ** 2  # the CLS token is dropped ("default")
    text_config = build_config("llama", preset, len(hf_tokenizer), hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)
    vision_config = transformers.CLIPVisionConfig(
        hidden_size=vision.hidden_size,
        intermediate_size=vision.intermediate_size,
        num_hidden_layers=vision.num_hidden_layers,
        num_attention_heads=vision.num_attention_heads,
        image_size=vision.image_size,
        patch_size=vision.patch_size,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    config = transformers.LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        image_seq_length=num_image_tokens,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config)
    _sharpen(model, seed)
    with torch.no_grad():  # image embeddings as large as the (sharpened) token embeddings, so images matter
        model.model.multi_modal_projector.linear_2.weight.mul_(25.0)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = hf_tokenizer.eos_token_id
    model.generation_config.bos_token_id = hf_tokenizer.bos_token_id
    model.save_pretrained(out)
    image_processor = transformers.CLIPImageProcessorPil(  # PIL backend: no torchvision needed
        size={"shortest_edge": vision.image_size},
        crop_size={"height": vision.image_size, "width": vision.image_size},
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=hf_tokenizer,
        patch_size=vision.patch_size,
        vision_feature_select_strategy="default",
        image_token=LLAVA_IMAGE_TOKEN,
        num_additional_image_tokens=1,  # the CLS token, which "default" drops
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    (out / "splitserve_test_model.json").write_text(
        json.dumps(
            {
                "arch": "llava",
                "preset": preset,
                "seed": seed,
                "dtype": dtype,
                "num_parameters": sum(t.numel() for t in model.parameters()),
                "image_token_id": image_token_id,
                "image_seq_length": num_image_tokens,
            },
            indent=2,
        )
        + "\n"
    )
    return out
