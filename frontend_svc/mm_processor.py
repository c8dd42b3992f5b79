"""Images in, model inputs out (vLLM's multimodal processor, ``vllm/multimodal/processing.py``): decode each image,
run the model's transformers processor on it (numpy outputs, no torch), expand each image placeholder of the prompt
to the processor's number of tokens, and hash each item (vLLM's ``mm_hash``) for the core's encoder cache and
prefix cache."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from frontend_svc.engine_types import MultiModalFeature
from frontend_svc.errors import ValidationError
from splitserve.base.mm_limits import DEFAULT_LIMIT_PER_PROMPT, IMAGE

logger = logging.getLogger(__name__)

# config.json model_type -> the model families the core runs images for (issue 17): LLaVA-1.5, Qwen2-VL,
# Qwen2.5-VL. Another model type with images is text-only here: its image inputs are refused.
SUPPORTED_MODEL_TYPES = frozenset({"llava", "qwen2_vl", "qwen2_5_vl"})
# The MIME types an encoded image may say (empty: any of these formats, told by its bytes) -> PIL's format name.
MIME_FORMATS = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",  # not registered, but common
    "image/webp": "WEBP",
    "image/gif": "GIF",
    "image/bmp": "BMP",
    "image/tiff": "TIFF",
}
# The pixels one request's images may hold in all, read from their headers before any is decoded: a few KiB of
# PNG can claim 13000 x 13000 pixels, and a 16 MiB request could otherwise hold dozens such (--limit-mm-per-prompt
# is 999). Images are then decoded and processed one at a time, so the frontend's memory per request is bounded by
# its largest image (``MultiModalProcessor.preprocess_peak_bytes``: about 15 bytes a decoded pixel, 0.9 GiB at 64
# megapixels) plus the items' tensors. The models' own inputs are far smaller (Qwen2-VL's max_pixels is 12.8
# megapixels, LLaVA-1.5 crops to 336 x 336): 64 megapixels is five 12-megapixel photos.
MAX_REQUEST_PIXELS = 64_000_000
# The pixels of one image, beyond which it is refused from its header: the request's budget, which is below PIL's
# DecompressionBombError bound (2 * Image.MAX_IMAGE_PIXELS, 179 megapixels).
MAX_IMAGE_PIXELS = min(MAX_REQUEST_PIXELS, 2 * (Image.MAX_IMAGE_PIXELS or 89_478_485))
# The memory preprocessing one image takes at its peak, by phase (``MultiModalProcessor.preprocess_peak_bytes``),
# measured with scripts/measure_preprocess_memory.py (ru_maxrss of a fresh process around one call, a 4032 x 3024
# JPEG, transformers 5 Pil processors; docs/operations.md, "Memory"):
# - Resizing, per decoded pixel (as we read transformers' Pil path): PIL's decoded RGB (4 bytes a pixel), its
#   uint8 numpy copy (3), its channels-first copy (3) and the PIL image it resizes (4). Measured 13.65 bytes a pixel
#   (LLaVA-1.5's CLIPImageProcessorPil: 158.7 MiB) and 14.22 (Qwen2VLImageProcessorPil at its default max_pixels
#   1003520, resizing to 964320 pixels: 165.4 MiB); 15 taken.
PREPROCESS_RESIZE_BYTES_PER_DECODED_PIXEL = 15
# - Qwen2-VL's float32 phase, per resized pixel, beside the decoded image (4 bytes a pixel, still held): rescaled and
#   normalized float32 copies and the patchified rows before they are concatenated, 40 bytes, besides the 24 bytes
#   a pixel the item keeps (``item_bytes``). Measured: 782.0 MiB at max_pixels 12845056, no downscale (67.25 bytes a
#   pixel: 4 decoded + 63.25); 4 + 40 + 24 = 68 taken. LLaVA's float copies are of its 336 x 336 crop: negligible.
DECODED_BYTES_PER_PIXEL = 4
QWEN2_VL_FLOAT_BYTES_PER_RESIZED_PIXEL = 40
# Rows of a decoded image hashed at once (``image_hash``): a band's bytes, not the whole image's, are copied.
HASH_BAND_ROWS = 64
_ASCII_WHITESPACE = str.maketrans("", "", " \t\n\r\f\v")
# transformers' image processor backend (``from_pretrained(backend=...)``, transformers 5). Left unset it takes the
# torchvision one whenever torchvision is importable: that imports torch into the frontend and resizes with other
# kernels, so the same picture would make other tensors under one item hash.
IMAGE_PROCESSOR_BACKEND = "pil"


@dataclass(frozen=True)
class EncodedImage:
    """An image as a client sent it: encoded bytes (PNG, JPEG, ...) and their MIME type ("" when not told)."""

    data: bytes
    mime_type: str = ""
    field: str = "images"  # where the request held it, for error messages: "images[0]", "messages[1].content[0]"


def image_from_url(url: str, mime_type: str, field: str) -> EncodedImage:
    """The image of a ``data:`` URI (RFC 2397, base64). The server never fetches URLs: it has no network access by
    design.

    Raises:
        ValidationError: naming ``field``: an http(s) or other URL, a data URI that is not base64 or not valid.
    """
    if url.startswith(("http://", "https://")):
        raise ValidationError(
            field,
            "URLs are not fetched (the server has no network access by design); pass the image bytes or a "
            "data: URI (data:image/png;base64,...)",
        )
    if not url.startswith("data:"):
        raise ValidationError(field, "must be a data: URI (data:image/png;base64,...); other URLs are not fetched")
    header, sep, payload = url[5:].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValidationError(field, "a data: URI must be base64: data:<mime type>;base64,<data>")
    # MIME-style base64 (RFC 2045) wraps its lines: ASCII whitespace is dropped, every other character validated.
    payload = payload.translate(_ASCII_WHITESPACE)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValidationError(field, f"the data: URI's base64 is not valid ({e})") from None
    return EncodedImage(data, header.removesuffix(";base64") or mime_type, field)


def open_image(image: Any, field: str) -> Image.Image:
    """A PIL image from a PIL image or an ``EncodedImage``; encoded bytes are only opened (their header read: size
    and mode known, pixels not decoded; ``load_image`` decodes).

    Raises:
        ValidationError: naming ``field``: another type, a MIME type not in ``MIME_FORMATS``, bytes that are not an
            image of those formats, or an image of more than ``MAX_IMAGE_PIXELS`` pixels.
    """
    if isinstance(image, Image.Image):
        opened = image
    elif not isinstance(image, EncodedImage):
        raise ValidationError(field, f"must be a PIL image or encoded image bytes, got {type(image).__name__}")
    else:
        field = image.field
        mime_type = image.mime_type.lower()
        if mime_type and mime_type not in MIME_FORMATS:
            raise ValidationError(
                f"{field}.mime_type", f"{image.mime_type!r} is not supported; use one of {sorted(MIME_FORMATS)}"
            )
        if not image.data:
            raise ValidationError(field, "holds no image data")
        try:
            # In memory (BytesIO): nothing to close. Only the header is read here.
            opened = Image.open(io.BytesIO(image.data), formats=list(MIME_FORMATS.values()))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
            raise ValidationError(field, f"cannot be decoded as an image ({e})") from None
    if opened.width * opened.height > MAX_IMAGE_PIXELS:
        raise ValidationError(
            field, f"is {opened.width}x{opened.height} pixels, more than the {MAX_IMAGE_PIXELS} this server decodes"
        )
    return opened


def load_image(image: Image.Image, field: str) -> Image.Image:
    """``image`` (from ``open_image``) fully decoded, so a truncated file fails here.

    Raises:
        ValidationError: naming ``field``: bytes that cannot be decoded.
    """
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValidationError(field, f"cannot be decoded as an image ({e})") from None
    return image


def image_hash(image: Image.Image, settings: str) -> str:
    """The item's content hash (vLLM's ``MultiModalHasher``: the decoded pixels, mode and size, and the settings
    that change the processor's output), a sha256 hex digest.

    Decoded pixels, not the file's bytes: one picture sent as PNG, as a data: URI or as a PIL image is one item
    to the encoder cache. ``settings`` (``MultiModalProcessor.settings``) go in because the core's encoder cache
    and prefix cache outlive a frontend: a frontend started with another preprocessor_config.json (another size,
    max_pixels, mean/std) makes other tensors and tokens of the same picture, which must not share its entries.
    The pixels are hashed ``HASH_BAND_ROWS`` rows at a time: the digest of ``image.tobytes()`` (raw rows one after
    another), without its full copy.
    """
    digest = hashlib.sha256()
    digest.update(settings.encode())
    digest.update(f"\0{image.mode}\0{image.width}x{image.height}\0".encode())
    if image.mode in ("P", "PA"):  # palette indices mean nothing without the palette and its transparency
        digest.update(bytes(image.getpalette() or []))
        digest.update(repr(image.info.get("transparency")).encode())
    for top in range(0, image.height, HASH_BAND_ROWS):
        digest.update(image.crop((0, top, image.width, min(top + HASH_BAND_ROWS, image.height))).tobytes())
    return digest.hexdigest()


class MultiModalProcessor:
    """A model's transformers processor (``AutoProcessor``: LlavaProcessor, Qwen2VLProcessor), run on numpy
    (``return_tensors="np"``), for the images of prompts.

    Args:
        processor: the loaded processor; its ``image_token`` / ``image_token_id`` is the prompt's placeholder
            (LLaVA ``<image>``; Qwen2-VL ``<|image_pad|>``, between ``<|vision_start|>`` and ``<|vision_end|>``).
        limits: modality -> the most items one prompt may hold (``--limit-mm-per-prompt``); unset: 999.
    """

    def __init__(self, processor: Any, model_type: str, limits: Mapping[str, int] | None = None) -> None:
        self.processor = processor
        self.model_type = model_type
        self.image_token: str = processor.image_token
        self.image_token_id: int = processor.image_token_id
        self.limits = dict(limits or {})
        # What changes the output for one picture (``image_hash``): the image processor's settings (size, crop,
        # resample, rescale, normalization, min/max_pixels, patch and merge sizes) and the processor's own.
        own = {
            name: getattr(processor, name, None)
            for name in ("patch_size", "vision_feature_select_strategy", "num_additional_image_tokens")
        }
        # The class too: to_dict()'s image_processor_type names the base class whatever the backend, and another
        # backend resizes differently.
        self.settings = json.dumps(
            {
                "model_type": model_type,
                "image_processor": processor.image_processor.to_dict(),
                "image_processor_class": type(processor.image_processor).__name__,
                "processor": own,
            },
            sort_keys=True,
            default=str,
        )

    @property
    def max_image_bytes(self) -> int | None:
        """The largest float32 pixel tensor one image can make, in bytes: LLaVA's crop, 3 x H x W x 4; Qwen2-VL's
        max_pixels (``size["longest_edge"]``) x 3 channels x temporal_patch_size x 4 (a still image's patches are
        repeated temporal_patch_size times). None: not known for this image processor."""
        image_processor = self.processor.image_processor
        max_pixels = getattr(getattr(image_processor, "size", None), "longest_edge", None)
        temporal = getattr(image_processor, "temporal_patch_size", None)
        if temporal is not None and max_pixels:
            return int(max_pixels) * 3 * int(temporal) * 4
        crop = getattr(image_processor, "crop_size", None)
        height, width = getattr(crop, "height", None), getattr(crop, "width", None)
        if getattr(image_processor, "do_center_crop", False) and height and width:
            return int(height) * int(width) * 3 * 4
        return None

    def resized_pixels(self, width: int, height: int) -> int | None:
        """The pixels Qwen2-VL's processor resizes a ``width`` x ``height`` image to (transformers'
        ``smart_resize``, as the processor resizes); None for another image processor.

        Raises:
            ValueError: a size the image processor refuses (an aspect ratio over 200).
        """
        image_processor = self.processor.image_processor
        temporal = getattr(image_processor, "temporal_patch_size", None)
        size = getattr(image_processor, "size", None)
        min_pixels, max_pixels = getattr(size, "shortest_edge", None), getattr(size, "longest_edge", None)
        if temporal is None or not min_pixels or not max_pixels:
            return None
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = int(image_processor.patch_size) * int(image_processor.merge_size)
        resized_height, resized_width = smart_resize(height, width, factor, int(min_pixels), int(max_pixels))
        return resized_height * resized_width

    def item_bytes(self, width: int, height: int) -> int:
        """The bytes of the tensors the image processor makes of a ``width`` x ``height`` image: Qwen2-VL its
        resized pixels (``resized_pixels``) at 3 x temporal_patch_size float32 values each, and image_grid_thw (3
        int64); LLaVA its crop, 3 x H x W float32; otherwise float32 RGB at the image's size.

        Raises:
            ValueError: a size the image processor refuses (Qwen2-VL: an aspect ratio over 200).
        """
        image_processor = self.processor.image_processor
        resized = self.resized_pixels(width, height)
        if resized is not None:
            return resized * 3 * int(image_processor.temporal_patch_size) * 4 + 3 * 8
        crop = getattr(image_processor, "crop_size", None)
        crop_height, crop_width = getattr(crop, "height", None), getattr(crop, "width", None)
        if getattr(image_processor, "do_center_crop", False) and crop_height and crop_width:
            return int(crop_height) * int(crop_width) * 3 * 4
        return width * height * 3 * 4

    def preprocess_peak_bytes(self, width: int, height: int) -> int:
        """The memory decoding and processing a ``width`` x ``height`` image takes at its peak, besides the tensors
        kept (``item_bytes``): the larger of its resize phase (``PREPROCESS_RESIZE_BYTES_PER_DECODED_PIXEL``) and,
        for Qwen2-VL, its float32 phase (the decoded image and ``QWEN2_VL_FLOAT_BYTES_PER_RESIZED_PIXEL`` a
        resized pixel). Constants measured by scripts/measure_preprocess_memory.py.

        Raises:
            ValueError: a size the image processor refuses (Qwen2-VL: an aspect ratio over 200).
        """
        decoded = width * height
        peak = PREPROCESS_RESIZE_BYTES_PER_DECODED_PIXEL * decoded
        resized = self.resized_pixels(width, height)
        if resized is not None:
            peak = max(peak, DECODED_BYTES_PER_PIXEL * decoded + QWEN2_VL_FLOAT_BYTES_PER_RESIZED_PIXEL * resized)
        return peak

    def preprocess_memory_bytes(self, images: Sequence[Any], field: str) -> int:
        """The memory ``process`` takes at its peak for ``images``, estimated from their headers alone (PIL opens an
        image without decoding it): the largest image decoded and processed (``preprocess_peak_bytes``; images are
        processed one at a time) and every item's tensors (``item_bytes``), kept until the request is sent.

        Raises:
            ValidationError: naming the image: as ``check_headers``. Every image is checked, the last as the
                first, so a request is refused whole before it is charged or anything is decoded.
        """
        checked = self.check_headers(images, field)
        return max((peak for _, _, peak in checked), default=0) + sum(kept for _, kept, _ in checked)

    def check_headers(self, images: Sequence[Any], field: str) -> list[tuple[Image.Image, int, int]]:
        """Every image opened from its header (nothing decoded), with its item's bytes (``item_bytes``) and its
        preprocessing peak (``preprocess_peak_bytes``), after checking them all: each decodable as far as its
        header, within ``MAX_IMAGE_PIXELS``, all within ``MAX_REQUEST_PIXELS``, and each of a size the image
        processor takes.

        Raises:
            ValidationError: naming the image (``images[3]``), or ``field`` for the pixels in all: as
                ``open_image``, ``check_pixels``, or a size the image processor refuses (Qwen2-VL: an aspect
                ratio over 200).
        """
        fields = _image_fields(images, field)
        opened = [open_image(image, fields[i]) for i, image in enumerate(images)]
        self.check_pixels(opened, field)
        checked: list[tuple[Image.Image, int, int]] = []
        for image, image_field in zip(opened, fields, strict=True):
            try:
                kept = self.item_bytes(image.width, image.height)
                peak = self.preprocess_peak_bytes(image.width, image.height)
            except ValueError as e:
                raise ValidationError(image_field, f"the model's image processor refused an image ({e})") from None
            checked.append((image, kept, peak))
        return checked

    @property
    def max_image_tokens(self) -> int:
        """The placeholder tokens of the largest image: Qwen2-VL max_pixels // (patch_size * merge_size)**2 (its
        resize keeps width * height <= max_pixels in whole tokens); otherwise the count the processor gives an
        image of its crop size (LLaVA: every image is the crop)."""
        image_processor = self.processor.image_processor
        max_pixels = getattr(getattr(image_processor, "size", None), "longest_edge", None)
        if getattr(image_processor, "temporal_patch_size", None) is not None and max_pixels:
            unit = int(image_processor.patch_size) * int(image_processor.merge_size)
            return max(1, int(max_pixels) // unit**2)
        crop = getattr(image_processor, "crop_size", None)
        width, height = int(getattr(crop, "width", None) or 1), int(getattr(crop, "height", None) or 1)
        outputs = image_processor(images=[Image.new("RGB", (width, height))], return_tensors="np")
        return self.processor.replace_image_token(outputs, 0).count(self.image_token)

    def describe_limits(self, max_request_bytes: int, max_model_len: int, core_limit: int | None) -> str:
        """One line for the log: the images one prompt may hold (the smaller of this frontend's and the core's
        ``--limit-mm-per-prompt``) and how many of the largest fit in one request to the core: within its receive
        limit (``max_request_bytes``, which also holds the text) and within the prompt's max_model_len - 1 tokens,
        the smaller count, as the core sizes its receive limit (``core_svc/request_size.py``)."""
        limit = self.image_limit if core_limit is None else min(self.image_limit, core_limit)
        flag = "--limit-mm-per-prompt" if limit == self.image_limit else "the engine core's --limit-mm-per-prompt"
        line = f"images: at most {limit} per prompt ({flag})"
        per_image = self.max_image_bytes
        if per_image is None or not max_request_bytes:
            return line
        tokens = self.max_image_tokens  # LLaVA: one small image processed to count them
        by_bytes, by_tokens = max_request_bytes // per_image, (max_model_len - 1) // tokens
        fit = min(by_bytes, by_tokens, limit)
        why = (
            f"by its bytes {by_bytes}, by the prompt's {max_model_len - 1} tokens "
            f"(max_model_len - 1, {tokens} an image) {by_tokens}"
        )
        return (
            f"{line}; the largest image is {per_image / 2**20:.1f} MiB of pixels, the engine core takes "
            f"{max_request_bytes / 2**20:.1f} MiB per request (its receive limit): {fit} such images fit in one "
            f"request ({why})"
        )

    @property
    def image_limit(self) -> int:
        return self.limits.get(IMAGE, DEFAULT_LIMIT_PER_PROMPT)

    def check_count(self, num_images: int, field: str, core_limit: int | None = None) -> None:
        """Refuse more images than the smaller of this frontend's ``--limit-mm-per-prompt`` and the connected
        core's (``core_limit``, its ``EngineInfo.image_limit_per_prompt``; None: not told): the core would refuse
        them after they were all preprocessed and sent, so the frontend refuses first and names whose flag it is.

        Raises:
            ValidationError: naming ``field`` and the flag.
        """
        if core_limit is not None and core_limit < self.image_limit and num_images > core_limit:
            raise ValidationError(
                field,
                f"has {num_images} images, more than the {core_limit} a prompt may hold on the engine core "
                f"(the core's --limit-mm-per-prompt image={core_limit})",
            )
        if num_images > self.image_limit:
            raise ValidationError(
                field,
                f"has {num_images} images, more than the {self.image_limit} a prompt may hold "
                f"(--limit-mm-per-prompt image={self.image_limit})",
            )

    @staticmethod
    def check_pixels(images: Iterable[Image.Image], field: str) -> None:
        """Raises ValidationError (naming ``field``): the images hold more than ``MAX_REQUEST_PIXELS`` in all."""
        sizes = [image.width * image.height for image in images]
        if sum(sizes) > MAX_REQUEST_PIXELS:
            raise ValidationError(
                field,
                f"{len(sizes)} images of {sum(sizes)} pixels in all, more than the {MAX_REQUEST_PIXELS} one request "
                "may hold; send fewer or smaller images",
            )

    def process(
        self, prompt_token_ids: list[int], images: Sequence[Any], field: str
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Expand each image placeholder of the prompt to its item's tokens, as the model's processor expands
        it in text (``processor.replace_image_token``), and return the items in prompt order.

        Args:
            prompt_token_ids: the tokenized prompt, one ``image_token_id`` per image.
            images: PIL images or ``EncodedImage``, in placeholder order.
            field: where the request held the images ("images", "multi_modal_data.image", "messages").

        Returns:
            The expanded token ids and one ``MultiModalFeature`` per image: ``offset`` / ``length`` its run of
            placeholder tokens in those ids; ``data`` its slice of the image processor's numpy outputs (LLaVA
            "pixel_values" [3, H, W] float32; Qwen2-VL "pixel_values" [grid_t * grid_h * grid_w, C * T * P * P]
            float32 and "image_grid_thw" [3] int64, with grid_t * grid_h * grid_w / merge_size**2 tokens).

        Raises:
            ValidationError: naming ``field``: too many images, a count other than the prompt's placeholders,
                more than ``MAX_REQUEST_PIXELS`` in all (from the headers, before decoding), an image that cannot
                be decoded or that the image processor refuses.
        """
        self.check_count(len(images), field)
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        positions = np.flatnonzero(ids == self.image_token_id)
        if len(positions) != len(images):
            raise ValidationError(
                field,
                f"{len(images)} images for {len(positions)} image placeholders ({self.image_token!r}) in the "
                "prompt; give one image per placeholder, in order",
            )
        if not images:
            return prompt_token_ids, []
        fields = _image_fields(images, field)
        # Every header checked before the first image is decoded: one bad image at the end refuses the request
        # before the others take time and memory.
        pending = deque(image for image, _, _ in self.check_headers(images, field))
        token_ids: list[int] = []
        features: list[MultiModalFeature] = []
        start = 0
        for i, position in enumerate(positions.tolist()):
            # One image at a time, its decoded pixels dropped once processed and hashed: only its arrays are kept.
            image = load_image(pending.popleft(), fields[i])
            try:
                outputs = self.processor.image_processor(images=[image], return_tensors="np")
            except (ValueError, TypeError, OSError) as e:
                raise ValidationError(field, f"the model's image processor refused an image ({e})") from None
            count = self.processor.replace_image_token(outputs, 0).count(self.image_token)
            identifier = image_hash(image, self.settings)
            del image
            token_ids += prompt_token_ids[start:position]
            features.append(MultiModalFeature(IMAGE, identifier, len(token_ids), count, _split_items(outputs, 1)[0]))
            token_ids += [self.image_token_id] * count
            start = position + 1
        token_ids += prompt_token_ids[start:]
        return token_ids, features


def _image_fields(images: Sequence[Any], field: str) -> list[str]:
    """Where the request held each image, for errors: an ``EncodedImage`` knows; otherwise ``field[i]``."""
    return [image.field if isinstance(image, EncodedImage) else f"{field}[{i}]" for i, image in enumerate(images)]


def _split_items(outputs: Mapping[str, Any], num_items: int) -> list[dict[str, np.ndarray]]:
    """Each item's slice of the image processor's batch outputs: with "image_grid_thw" (Qwen2-VL) "pixel_values"
    holds the items' patches one after another ([sum of t * h * w, D]); otherwise every output is [num_items, ...]."""
    grids = outputs.get("image_grid_thw")
    sizes = np.prod(np.asarray(grids), axis=-1) if grids is not None else None
    bounds = np.concatenate([[0], np.cumsum(sizes)]) if sizes is not None else None
    items: list[dict[str, np.ndarray]] = []
    for i in range(num_items):
        item = {}
        for key, value in outputs.items():
            array = np.asarray(value)
            if bounds is not None and key == "pixel_values":
                item[key] = np.ascontiguousarray(array[bounds[i] : bounds[i + 1]])
            else:
                item[key] = np.ascontiguousarray(array[i])
        items.append(item)
    return items


def load_mm_processor(
    model_path: Path, tokenizer: Any, limits: Mapping[str, int] | None = None
) -> MultiModalProcessor | None:
    """The model's processor when config.json's ``model_type`` is one of ``SUPPORTED_MODEL_TYPES``; None for a
    text-only model (its image inputs are refused). The image processor is always the Pil/numpy one
    (``IMAGE_PROCESSOR_BACKEND``, e.g. ``CLIPImageProcessorPil``, ``Qwen2VLImageProcessorPil``).

    LLaVA: ``AutoProcessor`` (LlavaProcessor). Qwen2-VL / Qwen2.5-VL: transformers' processor also loads its video
    processor, which needs torch and torchvision, so its image half is used instead (``QwenVLImageProcessor``).

    Raises:
        ValueError: a supported model whose folder has no usable image processor (preprocessor_config.json or
            processor_config.json) or whose tokenizer lacks the image token.
    """
    config_file = model_path / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        return None
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        if model_type == "llava":
            processor: Any = AutoProcessor.from_pretrained(str(model_path), backend=IMAGE_PROCESSOR_BACKEND)
        else:
            template_file = model_path / "chat_template.jinja"
            template = template_file.read_text() if template_file.is_file() else None
            image_processor = AutoImageProcessor.from_pretrained(str(model_path), backend=IMAGE_PROCESSOR_BACKEND)
            processor = QwenVLImageProcessor(image_processor, tokenizer, template)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"cannot load the {model_type} image processor from {model_path}: {e}") from e
    logger.info("images: %s with %s", type(processor).__name__, type(processor.image_processor).__name__)
    return MultiModalProcessor(processor, model_type, limits)


class QwenVLImageProcessor:
    """The image half of transformers' ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor``
    (``models/qwen2_vl/processing_qwen2_vl.py``), which cannot load without torchvision (its video processor):
    the placeholder ``<|image_pad|>`` and its expansion to grid_t * grid_h * grid_w / merge_size**2 tokens.

    Raises:
        ValueError: from the constructor: the tokenizer does not know the image token.
    """

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None) -> None:
        self.image_processor = image_processor
        # As Qwen2VLProcessor.__init__: the tokenizer's own image token when it names one.
        self.image_token: str = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if image_token_id is None or image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {self.image_token!r} token")
        self.image_token_id: int = image_token_id
        self.chat_template = chat_template

    def replace_image_token(self, image_inputs: Mapping[str, Any], image_idx: int) -> str:
        """The text the processor puts for image ``image_idx`` (as ``Qwen2VLProcessor.replace_image_token``)."""
        merge_length = self.image_processor.merge_size**2
        return self.image_token * int(np.prod(image_inputs["image_grid_thw"][image_idx]) // merge_length)
