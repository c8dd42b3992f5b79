"""Seeded random-weight Qwen2-VL and Qwen2.5-VL checkpoints (``make-test-model --arch qwen2_vl|qwen2_5_vl``).

transformers' ``Qwen2VLConfig`` and ``Qwen2VLForConditionalGeneration`` saved with ``save_pretrained``, beside
the processor's files as ``Qwen2VLProcessor.save_pretrained`` writes them: ``preprocessor_config.json``
(``Qwen2VLImageProcessor`` with small ``min_pixels``/``max_pixels``, so an image makes a few dozen patches),
``processor_config.json``, and the tokenizer (a copy of a tokenizer folder, else the builtin one) with
``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>`` added and a chat template that
renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor then repeats
``<|image_pad|>`` once per merged patch). ``AutoImageProcessor`` and ``AutoTokenizer`` load them;
``AutoProcessor`` also wants ``Qwen2VLVideoProcessor``, which transformers builds only with torchvision.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")
# Qwen2-VL's template reduced to what the tests use: string or list contents, image and text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# arch -> (processor, config and model class names in transformers)
_CLASSES = {
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
}


@dataclass(frozen=True)
class VLPreset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    mrope_section: tuple[int, int, int]  # sums to head_size // 2
    vision_depth: int
    vision_embed_dim: int
    vision_num_heads: int
    patch_size: int
    min_pixels: int  # the image processor's bounds on resized width * height
    max_pixels: int


# tiny: a 64-wide, 2-layer Qwen2 under a 2-block, 32-wide ViT; an image makes 4 to 16 merged tokens.
VL_PRESET_TABLE: dict[str, VLPreset] = {
    "tiny": VLPreset(64, 128, 2, 4, 2, (2, 3, 3), 2, 32, 2, 14, 4 * 28 * 28, 16 * 28 * 28),
}


def make_qwen2_vl_test_model(
    out: Path,
    arch: str,
    preset: str,
    seed: int,
    dtype: str,
    sharpen: Callable[[Any, int], None],
) -> Any:
    """Add the vision tokens to the tokenizer already in ``out``, and write the processor files and a seeded
    ``Qwen2VLForConditionalGeneration`` (arch qwen2_vl) or ``Qwen2_5_VLForConditionalGeneration`` (qwen2_5_vl: its
    tower with 2 x 2-token attention windows, block 1 of 2 attending fully) in ``dtype`` to ``out``; returns the
    transformers model (for its parameter count). ``sharpen(model, seed)`` rescales the fresh weights as for the
    text models.

    Raises:
        ValueError: a preset without a Qwen2-VL shape.
    """
    import torch
    import transformers
    from transformers import AutoTokenizer

    if preset not in VL_PRESET_TABLE:
        raise ValueError(f"arch {arch} has presets {', '.join(VL_PRESET_TABLE)}, not {preset!r}")
    p = VL_PRESET_TABLE[preset]
    hf_tokenizer = AutoTokenizer.from_pretrained(out)
    hf_tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)
    vocab = hf_tokenizer.get_vocab()
    start_id, image_id, end_id, video_id = (vocab[token] for token in VISION_TOKENS)
    image_processor = transformers.models.qwen2_vl.Qwen2VLImageProcessorPil(
        min_pixels=p.min_pixels, max_pixels=p.max_pixels, patch_size=p.patch_size, merge_size=2, temporal_patch_size=2
    )
    image_processor.save_pretrained(out)
    processor_class, config_class, model_class = _CLASSES[arch]
    (out / "processor_config.json").write_text(json.dumps({"processor_class": processor_class}, indent=2) + "\n")
    vision_config: dict[str, Any] = dict(
        depth=p.vision_depth,
        num_heads=p.vision_num_heads,
        patch_size=p.patch_size,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if arch == "qwen2_vl":
        vision_config |= dict(embed_dim=p.vision_embed_dim, hidden_size=p.hidden_size, mlp_ratio=2)
    else:
        vision_config |= dict(
            hidden_size=p.vision_embed_dim,
            out_hidden_size=p.hidden_size,
            intermediate_size=2 * p.vision_embed_dim,
            window_size=2 * 2 * p.patch_size,  # windows of 2 x 2 merged tokens
            fullatt_block_indexes=[p.vision_depth - 1],
        )
    config = getattr(transformers, config_class)(
        text_config=dict(
            vocab_size=len(hf_tokenizer),
            hidden_size=p.hidden_size,
            intermediate_size=p.intermediate_size,
            num_hidden_layers=p.num_hidden_layers,
            num_attention_heads=p.num_attention_heads,
            num_key_value_heads=p.num_key_value_heads,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(p.mrope_section)},
            bos_token_id=hf_tokenizer.bos_token_id,
            eos_token_id=hf_tokenizer.eos_token_id,
        ),
        vision_config=vision_config,
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=start_id,
        vision_end_token_id=end_id,
    )
    config.architectures = [model_class]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    sharpen(model, seed)
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = hf_tokenizer.eos_token_id
    model.generation_config.bos_token_id = hf_tokenizer.bos_token_id
    model.save_pretrained(out)
    return model
