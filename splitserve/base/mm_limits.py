"""``--limit-mm-per-prompt`` (vLLM's flag, an engine argument there too): the most items of each modality one
prompt may hold. Both services read it: the frontend refuses a prompt with more images before processing them, the
core refuses a request with more items and sizes its default gRPC receive limit for that many of its model's
largest items (``core_svc/request_size.py``, ``core_svc/server.py``)."""

from __future__ import annotations

import json
from collections.abc import Mapping

IMAGE = "image"
# vLLM v1's default --limit-mm-per-prompt for every modality (``MultiModalConfig.limit_per_prompt``).
DEFAULT_LIMIT_PER_PROMPT = 999


def parse_limit_mm_per_prompt(value: str | Mapping[str, int] | None) -> dict[str, int]:
    """``--limit-mm-per-prompt`` as vLLM takes it: ``image=4`` (``modality=N`` pairs, comma-separated) or JSON
    (``{"image": 4}``), or a dict already; None: {} (999 each, vLLM v1's default).

    Raises:
        ValueError: another form, a modality other than image, a count that is not an integer >= 0.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"limit_mm_per_prompt: {value!r} is not valid JSON ({e})") from None
        else:
            pairs = [pair.partition("=") for pair in text.split(",") if pair.strip()]
            if any(not sep for _, sep, _ in pairs):
                raise ValueError(f"limit_mm_per_prompt: {value!r} is not modality=N[,modality=N] (image=4)")
            try:
                value = {key.strip(): int(count) for key, _, count in pairs}
            except ValueError:
                raise ValueError(f"limit_mm_per_prompt: {value!r}: each count must be an integer") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"limit_mm_per_prompt must map modalities to counts, got {type(value).__name__}")
    limits: dict[str, int] = {}
    for key, count in value.items():
        if key != IMAGE:
            raise ValueError(f"limit_mm_per_prompt: only 'image' is supported, got {key!r}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"limit_mm_per_prompt: {key} must be an integer >= 0, got {count!r}")
        limits[key] = count
    return limits


def image_limit(limits: Mapping[str, int]) -> int:
    """The most images one prompt may hold under ``limits`` (``parse_limit_mm_per_prompt``): 999 when unset."""
    return limits.get(IMAGE, DEFAULT_LIMIT_PER_PROMPT)
