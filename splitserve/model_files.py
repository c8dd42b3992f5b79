"""Where a model's files are: a local folder as is, or a hub id fetched with huggingface_hub.

Shared by both services (the core reads weights and config, the frontend reads the tokenizer); imports
neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

# What a checkpoint folder needs for serving: config, weights, tokenizer, chat template, generation config.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
WEIGHT_PATTERNS = ["*.safetensors"]


class ModelNotFoundError(FileNotFoundError):
    """Neither a local folder nor a hub id that could be fetched."""


def resolve_model_path(model: str, weights: bool = True) -> Path:
    """A local Hugging Face folder as is; otherwise a hub id, downloaded with huggingface_hub (without the
    weights when ``weights`` is False: what a frontend needs, config and tokenizer files).

    Raises:
        ModelNotFoundError: the message names the model and why it could not be found.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"model {model!r} is a file; expected a Hugging Face checkpoint folder")
    try:
        from huggingface_hub import snapshot_download

        patterns = [p for p in CHECKPOINT_PATTERNS if weights or p not in WEIGHT_PATTERNS]
        return Path(snapshot_download(repo_id=model, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, invalid id: all the same to the user
        raise ModelNotFoundError(
            f"model {model!r} is not a local folder and could not be fetched from the Hugging Face hub ({e})"
        ) from e
