"""How large a request message the core takes when ``--max-receive-message-mib`` is not given: the text part's
16 MiB (``grpc_runtime.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES``: an ``EngineCoreRequest`` of a 1M-token prompt is
about 5 MiB) plus the float32 pixel tensors of the most images one request can carry to this model. Arithmetic on
the model folder's configs: ``core_svc/server.py`` applies it to the gRPC server (``model_message_limits``).

Why here, from the model folder's config files, and not from the loaded model: the gRPC server's receive limit is
fixed when the server is made, and the core listens (health NOT_SERVING) while its weights load. config.json (read
by transformers' ``AutoConfig``, whose config classes give the defaults it leaves out, as the core's models get
them) and the image processor settings (``core_svc/image_processor_config.py``, read as the frontend's processor
reads them) are all it takes: the item's tensor shape follows from the vision config and the image processor's
bounds, as the frontend's processor makes it (``frontend_svc/mm_processor.py``), and the model's
``mm_feature_violation`` refuses any larger item.

The images one request can carry are bounded twice, and the smaller bound is taken: ``--limit-mm-per-prompt``
(the core's own flag, 999 by default as vLLM's) times the largest item, and the prompt's room (max_model_len - 1
tokens) times the largest item's bytes per placeholder token (every image token of a prompt belongs to an item).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core_svc.config import CoreConfig
from core_svc.image_processor_config import (
    QWEN2_VL_MODEL_TYPES,
    ImageProcessorConfig,
    json_object,
    read_image_processor_config,
)
from core_svc.models.qwen2_vl import DEFAULT_MAX_PIXELS

# What an item costs on the wire besides its pixels: its identifier (64 hex digits), modality, tensor names,
# dtypes and shapes, placeholder range and Qwen2-VL's image_grid_thw (24 bytes); about 200 bytes, rounded up.
ITEM_OVERHEAD_BYTES = 1024
FLOAT32_BYTES = 4  # the frontend sends pixel values as float32
IMAGE_MODEL_TYPES = ("llava", *QWEN2_VL_MODEL_TYPES)


@dataclass(frozen=True)
class ImageItemSize:
    """The largest image item a model takes: its float32 pixel tensor in bytes and its placeholder tokens."""

    max_bytes: int
    max_tokens: int
    bytes_per_token: int  # the most pixel bytes of one placeholder token (Qwen2-VL: merge_size**2 patch rows)


@dataclass(frozen=True)
class ReceiveLimit:
    """The core's receive limit in bytes, and why (a line for the startup log)."""

    receive_bytes: int
    reason: str


def image_item_size(hf_config: Any, image_processor: ImageProcessorConfig, source: str) -> ImageItemSize | None:
    """The largest image item of a model (its transformers config, ``AutoConfig``, whose config classes fill in
    the defaults a config.json leaves out, as the core's models read them; and its image processor settings,
    ``read_image_processor_config``); None for a model that takes no images. ``source`` names config.json for
    errors. LLaVA: its CLIP crop, [3, image_size, image_size] float32, (image_size / patch_size)**2 tokens.
    Qwen2-VL / Qwen2.5-VL: max_pixels (``ImageProcessorConfig.max_pixels``) // (patch_size * merge_size)**2
    tokens, each of (patch_size * merge_size)**2 pixels at 3 * temporal_patch_size float32 values a pixel (a still
    image's patch is repeated temporal_patch_size times): 18816 bytes a token.

    Raises:
        ValueError: naming the file and key: a vision setting or image size bound that is not a positive integer,
            or a preprocessor "size" that is not a JSON object (Qwen2-VL).
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in IMAGE_MODEL_TYPES:
        return None
    vision = getattr(hf_config, "vision_config", None)

    def setting(key: str) -> int:
        value = getattr(vision, key, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{source}: 'vision_config.{key}' must be a positive integer, got {value!r}")
        return value

    if model_type == "llava":
        image_size, patch_size = setting("image_size"), setting("patch_size")
        max_bytes, max_tokens = 3 * image_size**2 * FLOAT32_BYTES, max(1, (image_size // patch_size) ** 2)
        return ImageItemSize(max_bytes, max_tokens, math.ceil(max_bytes / max_tokens))
    temporal = setting("temporal_patch_size")
    unit = setting("patch_size") * setting("spatial_merge_size")
    # The processor resizes to width * height <= max_pixels, both multiples of unit: whole tokens of unit**2
    # pixels, each 3 * temporal float32 values a pixel.
    max_tokens = image_processor.max_image_tokens(unit, DEFAULT_MAX_PIXELS)
    bytes_per_token = unit**2 * 3 * temporal * FLOAT32_BYTES
    return ImageItemSize(max_tokens * bytes_per_token, max_tokens, bytes_per_token)


def model_receive_limit(model_path: Path, config: CoreConfig, text_bytes: int, max_message_bytes: int) -> ReceiveLimit:
    """The receive limit for the model at ``model_path`` (a folder holding config.json) served with ``config``
    (its ``limit_mm_per_prompt`` and ``max_model_len``): ``text_bytes`` (the servers' default,
    ``grpc_runtime.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES``) for a text model; for an image model that plus the images
    one request can carry (the module docstring), capped at ``max_message_bytes`` (gRPC's largest, 2 GiB - 1).

    Raises:
        ValueError: config.json unreadable by transformers, an image processor config that is not a JSON object,
            or a vision setting or image bound of the wrong type (``image_item_size``), naming the file and key.
    """
    config_file = model_path / "config.json"
    base = text_bytes
    if json_object(config_file).get("model_type") not in IMAGE_MODEL_TYPES:
        return ReceiveLimit(base, f"{_mib(base)} for a text model's requests")
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    except Exception as e:  # transformers raises many kinds: OSError, ValueError, strict-dataclass validation errors
        raise ValueError(f"{config_file} cannot be read as a transformers config: {' '.join(str(e).split())}") from e
    item = image_item_size(hf_config, read_image_processor_config(model_path), str(config_file))
    if item is None:
        return ReceiveLimit(base, f"{_mib(base)} for a text model's requests")
    limit = config.image_limit
    by_count = limit * (item.max_bytes + ITEM_OVERHEAD_BYTES)
    max_model_len = config.max_model_len or getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    images = f"{limit} image{'' if limit == 1 else 's'}"
    pixel_bytes, why = by_count, f"{images} (--limit-mm-per-prompt) of at most {_mib(item.max_bytes)}"
    if max_model_len:
        room = int(max_model_len) - 1
        # Every placeholder token belongs to an item, and an item is at least one token.
        by_tokens = room * item.bytes_per_token + min(limit, room) * ITEM_OVERHEAD_BYTES
        if by_tokens < by_count:
            pixel_bytes = by_tokens
            why = (
                f"the pixels of {room} image tokens (max_model_len - 1) at {item.bytes_per_token} bytes a token "
                f"(images of at most {_mib(item.max_bytes)}, {item.max_tokens} tokens)"
            )
    receive_bytes = min(base + pixel_bytes, max_message_bytes)
    capped = ", capped at gRPC's largest message" if receive_bytes < base + pixel_bytes else ""
    return ReceiveLimit(receive_bytes, f"{_mib(base)} of text and {_mib(pixel_bytes)} of float32 pixels: {why}{capped}")


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
