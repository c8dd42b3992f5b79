"""Loading the model's tokenizer with transformers (imported here, lazily, never at package import)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from frontend_svc.errors import ValidationError


def load_tokenizer(path: Path | str) -> Any:
    """transformers' ``AutoTokenizer`` for a local checkpoint or tokenizer folder.

    Raises:
        ValidationError: the folder has no usable tokenizer files.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValidationError("tokenizer", f"cannot load a tokenizer from {path}: {e}") from e
