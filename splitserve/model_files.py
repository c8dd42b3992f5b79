"""Where a model's files are: a local folder as is, or a hub id fetched with huggingface_hub.

Shared by both services (the core reads weights and config, the frontend reads the tokenizer); imports
neither torch nor transformers.
"""

from __future__ import annotations

from pathlib import Path

# What a checkpoint folder needs for serving: config, weights, tokenizer, chat template, generation config.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


class ModelNotFoundError(FileNotFoundError):
    """Neither a local folder nor a hub id that could be fetched."""


def resolve_model_path(model: str) -> Path:
    """A local Hugging Face folder as is; otherwise a hub id, downloaded with huggingface_hub.

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

        return Path(snapshot_download(repo_id=model, allow_patterns=CHECKPOINT_PATTERNS))
    except Exception as e:  # offline, unknown repo, invalid id: all the same to the user
        raise ModelNotFoundError(
            f"model {model!r} is not a local folder and could not be fetched from the Hugging Face hub ({e})"
        ) from e
