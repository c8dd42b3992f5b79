"""How large a request message the core takes when ``--max-receive-message-mib`` is not given: the text part's
16 MiB (``grpc_runtime.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES``: an ``EngineCoreRequest`` of a 1M-token prompt is
about 5 MiB) plus the float32 pixel tensors of the most images one request can carry to this model. Plain
arithmetic on JSON files: ``core_svc/server.py`` applies it to the gRPC server (``model_message_limits``).

Why here, from the model folder's JSON files, and not from the loaded model: the gRPC server's receive limit is
fixed when the server is made, and the core listens (health NOT_SERVING) while its weights load. config.json and
preprocessor_config.json are all it takes: the item's tensor shape follows from the vision config and the image
processor's bounds, as the frontend's processor makes it (``frontend_svc/mm_processor.py``), and the model's
``mm_feature_violation`` refuses any larger item.

The images one request can carry are bounded twice, and the smaller bound is taken: ``--limit-mm-per-prompt``
(the core's own flag, 999 by default as vLLM's) times the largest item, and the prompt's room (max_model_len - 1
tokens) times the largest item's bytes per placeholder token (every image token of a prompt belongs to an item).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core_svc.config import CoreConfig
from core_svc.models.qwen2_vl import image_max_pixels

# What an item costs on the wire besides its pixels: its identifier (64 hex digits), modality, tensor names,
# dtypes and shapes, placeholder range and Qwen2-VL's image_grid_thw (24 bytes); about 200 bytes, rounded up.
ITEM_OVERHEAD_BYTES = 1024
FLOAT32_BYTES = 4  # the frontend sends pixel values as float32
# transformers' defaults where a config leaves them out (CLIPVisionConfig image_size / patch_size, Qwen2-VL's
# vision config temporal_patch_size / spatial_merge_size / patch_size).
CLIP_DEFAULT_IMAGE_SIZE = 224
CLIP_DEFAULT_PATCH_SIZE = 32
QWEN2_VL_DEFAULT_TEMPORAL_PATCH_SIZE = 2
QWEN2_VL_DEFAULT_MERGE_SIZE = 2
QWEN2_VL_DEFAULT_PATCH_SIZE = 14


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


def image_item_size(
    model_type: str | None, config: dict[str, Any], preprocessor: dict[str, Any]
) -> ImageItemSize | None:
    """The largest image item of a model (config.json and preprocessor_config.json as dicts); None for a model
    that takes no images. LLaVA: its CLIP crop, [3, image_size, image_size] float32, (image_size / patch_size)**2
    tokens. Qwen2-VL / Qwen2.5-VL: max_pixels (``image_max_pixels``) // (patch_size * merge_size)**2 tokens, each
    of (patch_size * merge_size)**2 pixels at 3 * temporal_patch_size float32 values a pixel (a still image's
    patch is repeated temporal_patch_size times): 18816 bytes a token.
    """
    vision = config.get("vision_config") or {}
    if model_type == "llava":
        image_size = int(vision.get("image_size", CLIP_DEFAULT_IMAGE_SIZE))
        patch_size = int(vision.get("patch_size", CLIP_DEFAULT_PATCH_SIZE))
        max_bytes, max_tokens = 3 * image_size**2 * FLOAT32_BYTES, max(1, (image_size // patch_size) ** 2)
        return ImageItemSize(max_bytes, max_tokens, math.ceil(max_bytes / max_tokens))
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        temporal = int(vision.get("temporal_patch_size", QWEN2_VL_DEFAULT_TEMPORAL_PATCH_SIZE))
        unit = int(vision.get("patch_size", QWEN2_VL_DEFAULT_PATCH_SIZE)) * int(
            vision.get("spatial_merge_size", QWEN2_VL_DEFAULT_MERGE_SIZE)
        )
        # The processor resizes to width * height <= max_pixels, both multiples of unit: whole tokens of unit**2
        # pixels, each 3 * temporal float32 values a pixel.
        max_tokens = max(1, image_max_pixels(preprocessor) // unit**2)
        bytes_per_token = unit**2 * 3 * temporal * FLOAT32_BYTES
        return ImageItemSize(max_tokens * bytes_per_token, max_tokens, bytes_per_token)
    return None


def model_receive_limit(model_path: Path, config: CoreConfig, text_bytes: int, max_message_bytes: int) -> ReceiveLimit:
    """The receive limit for the model at ``model_path`` (a folder holding config.json) served with ``config``
    (its ``limit_mm_per_prompt`` and ``max_model_len``): ``text_bytes`` (the servers' default,
    ``grpc_runtime.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES``) for a text model; for an image model that plus the images
    one request can carry (the module docstring), capped at ``max_message_bytes`` (gRPC's largest, 2 GiB - 1).

    Raises:
        ValueError: config.json or preprocessor_config.json is not a JSON object.
    """
    hf_config = _json_object(model_path / "config.json")
    base = text_bytes
    item = image_item_size(
        hf_config.get("model_type"), hf_config, _json_object(model_path / "preprocessor_config.json")
    )
    if item is None:
        return ReceiveLimit(base, f"{_mib(base)} for a text model's requests")
    limit = config.image_limit
    by_count = limit * (item.max_bytes + ITEM_OVERHEAD_BYTES)
    text_config = hf_config.get("text_config") or {}
    max_model_len = config.max_model_len or text_config.get("max_position_embeddings")
    max_model_len = max_model_len or hf_config.get("max_position_embeddings")
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


def _json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; {} when there is no such file.

    Raises:
        ValueError: the file is unreadable or not a JSON object, naming it.
    """
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is unreadable: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file} is not a JSON object")
    return value


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
