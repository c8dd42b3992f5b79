"""A multimodal checkpoint's image processor settings, read as the frontend's transformers processor reads them
(``ImageProcessingMixin.get_image_processor_dict``): processor_config.json's nested "image_processor" (what
transformers 5's ``save_pretrained`` writes) first, else preprocessor_config.json. The core's receive limit
(``request_size``) and its largest image (the models' ``mm_feature_violation``) both take this one reading, so
they bound what the frontend makes of the same folder."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROCESSOR_FILE = "processor_config.json"  # transformers' PROCESSOR_NAME
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"  # transformers' IMAGE_PROCESSOR_NAME
# config.json model_type of the models whose image size bound is the image processor's max_pixels.
QWEN2_VL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


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
