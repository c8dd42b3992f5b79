"""A multimodal checkpoint's image processor settings, read as the frontend's transformers processor reads them
(``ImageProcessingMixin.get_image_processor_dict``): processor_config.json's nested "image_processor" (what
transformers 5's ``save_pretrained`` writes) first, else preprocessor_config.json. The core's receive limit
(``request_size``) and its largest image (the models' ``mm_feature_violation``) both take this one reading, so
they bound what the frontend makes of the same folder."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROCESSOR_FILE = "processor_config.json"  # transformers' PROCESSOR_NAME
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # transformers' IMAGE_PROCESSOR_NAME
# config.json model_type of the models whose image size bound is the image processor's max_pixels.
QWEN2_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
# transformers' Qwen2-VL smart_resize: the largest aspect ratio it resizes (it refuses larger ones), and its
# default smallest area.
MAX_ASPECT_RATIO = 200
DEFAULT_MIN_PIXELS = 56 * 56


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The image processor's settings and where they were read, for error messages."""

    settings: Mapping[str, Any]  # the image processor's JSON object ({} without one)
    source: str  # "<folder>/processor_config.json [image_processor]" or "<folder>/preprocessor_config.json"

    def size(self) -> Mapping[str, Any]:
        """The "size" setting ({} when absent): a JSON object such as {"shortest_edge": ..., "longest_edge": ...}.

        Raises:
            ValueError: naming the file and key: "size" is not a JSON object (a bare 448, say).
        """
        size = self.settings.get("size")
        if size is None:
            return {}
        if not isinstance(size, Mapping):
            raise ValueError(
                f"{self.source}: 'size' must be a JSON object such as {{\"longest_edge\": ...}}, got {size!r}"
            )
        return size

    def max_pixels(self) -> int | None:
        """The largest image area in pixels: ``max_pixels`` when given, else ``size.longest_edge``; None when
        neither is (transformers' ``Qwen2VLImageProcessor`` lets ``max_pixels`` override ``size`` the same way).

        Raises:
            ValueError: naming the file and key: "size" not a JSON object, a bound that is not a positive integer.
        """
        max_pixels = self.positive_int(self.settings.get("max_pixels"), "max_pixels")
        longest_edge = self.positive_int(self.size().get("longest_edge"), "size.longest_edge")
        return max_pixels or longest_edge

    def min_pixels(self) -> int | None:
        """The smallest image area in pixels: ``min_pixels`` when given, else ``size.shortest_edge``; None when
        neither is.

        Raises:
            ValueError: as ``max_pixels``.
        """
        min_pixels = self.positive_int(self.settings.get("min_pixels"), "min_pixels")
        shortest_edge = self.positive_int(self.size().get("shortest_edge"), "size.shortest_edge")
        return min_pixels or shortest_edge

    def max_image_tokens(self, unit: int, default_max_pixels: int) -> int:
        """The most tokens (``unit`` x ``unit`` pixels each: patch size x merge size) transformers' Qwen2-VL
        ``smart_resize`` makes of any image under these settings. Not only max_pixels // unit**2: an image at
        the aspect-ratio limit (200) keeps a short side of one unit, so its long side, sized for max_pixels, makes
        floor(sqrt(200 * max_pixels) / unit) tokens (56 for max_pixels 12544 and unit 28, against 16), and one
        scaled up to min_pixels ceil(sqrt(200 * min_pixels) / unit). The largest of the three; checked against
        smart_resize over image sizes up to that ratio.

        Raises:
            ValueError: as ``max_pixels``.
        """
        max_pixels = self.max_pixels() or default_max_pixels
        min_pixels = self.min_pixels() or DEFAULT_MIN_PIXELS
        return max(
            1,
            max_pixels // unit**2,
            math.floor(math.sqrt(MAX_ASPECT_RATIO * max_pixels) / unit),
            math.ceil(math.sqrt(MAX_ASPECT_RATIO * min_pixels) / unit),
        )

    def positive_int(self, value: Any, key: str) -> int | None:
        """``value`` (the setting ``key``, or None) as an int, None when unset.

        Raises:
            ValueError: naming the file and key: not a positive integer.
        """
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value <= 0:
            raise ValueError(f"{self.source}: '{key}' must be a positive integer, got {value!r}")
        return int(value)


def read_image_processor_config(path: Path) -> ImageProcessorConfig:
    """The image processor settings of the checkpoint folder ``path``, as transformers'
    ``ImageProcessingMixin.get_image_processor_dict`` resolves them (local files only); empty settings when the
    folder has neither file.

    Raises:
        ValueError: naming the file: unreadable, not JSON, or not a JSON object.
    """
    from transformers.image_processing_base import ImageProcessingMixin

    nested = json_object(path / PROCESSOR_FILE).get("image_processor")
    if nested is None and not (path / IMAGE_PROCESSOR_FILE).is_file():
        return ImageProcessorConfig({}, f"{path / IMAGE_PROCESSOR_FILE}")
    source = f"{path / PROCESSOR_FILE} [image_processor]" if nested is not None else str(path / IMAGE_PROCESSOR_FILE)
    try:
        settings, _ = ImageProcessingMixin.get_image_processor_dict(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{source} is unreadable: {e}") from e
    if not isinstance(settings, dict):
        raise ValueError(f"{source} is not a JSON object")
    return ImageProcessorConfig(settings, source)


def json_object(file: Path) -> dict[str, Any]:
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
