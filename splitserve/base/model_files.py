"""Where a model's files are: a local folder as is, or a hub id fetched with huggingface_hub.

A name that is meant as a path (``looks_like_path``) and names no folder is an error of its own ("no such
folder: ..."), not a hub id that the hub then refuses. Shared by both services (the core reads weights and
config, the frontend reads the tokenizer); imports neither torch nor transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

# What a checkpoint folder needs for serving: config, weights, tokenizer, chat template, generation config.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
WEIGHT_PATTERNS = ["*.safetensors"]
PATH_PREFIXES = ("/", "./", "../", "~")


class ModelNotFoundError(FileNotFoundError):
    """Neither a local model folder nor a hub id that could be fetched; the message is one line naming the model
    and why."""


def looks_like_path(model: str) -> bool:
    """Whether ``model`` is meant as a local path rather than a hub id: absolute, starting with ``./``, ``../``
    or ``~``, not of the hub's ``name`` / ``org/name`` shape (``a/b/c``, spaces, a trailing separator), or
    with a first part that exists here (``models/llama`` where ``models/`` is a folder)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if model in (".", "..") or model.startswith(PATH_PREFIXES) or os.path.isabs(model):
        return True
    if os.sep != "/" and os.sep in model:  # a hub id's one separator is "/"
        return True
    try:
        validate_repo_id(model)
    except HFValidationError:
        return True
    parent = Path(model).parent
    return parent != Path(".") and parent.exists()


def check_local_model(path: Path, model: str) -> Path:
    """``path`` (``model`` as given, expanded) when it is a model folder.

    Raises:
        ModelNotFoundError: it does not exist ("no such folder: ..."), is a file, or holds no config.json.
    """
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{model} is not a model folder: no config.json")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model} is a file, not a model folder (a Hugging Face checkpoint folder)")
    raise ModelNotFoundError(f"no such folder: {model}")


def resolve_model_path(model: str, weights: bool = True) -> Path:
    """A local Hugging Face folder as is; otherwise a hub id, downloaded with huggingface_hub (without the
    weights when ``weights`` is False: what a frontend needs, config and tokenizer files).

    Raises:
        ModelNotFoundError: a local folder that is missing or holds no config.json, or a hub id that could not
            be fetched; the message is one line naming the model and why.
    """
    path = Path(model).expanduser()
    if path.exists() or looks_like_path(model):
        return check_local_model(path, model)
    patterns = [p for p in CHECKPOINT_PATTERNS if weights or p not in WEIGHT_PATTERNS]
    return download(model, patterns)


def check_model(model: str) -> None:
    """Fail fast on a model no server could load: a local folder as ``resolve_model_path`` checks it; for a hub
    id only its config.json is fetched (cached for the full download later), so a server does not start to
    report an unreachable hub minutes later.

    Raises:
        ModelNotFoundError: as ``resolve_model_path``.
    """
    path = Path(model).expanduser()
    if path.exists() or looks_like_path(model):
        check_local_model(path, model)
    else:
        download(model, ["config.json"])


def download(repo_id: str, patterns: list[str]) -> Path:
    """The files of hub model ``repo_id`` matching ``patterns``, from the local cache or the hub.

    Raises:
        ModelNotFoundError: one line naming ``repo_id``: the hub unreachable (or HF_HUB_OFFLINE) and the files not
            cached, no such repository (or a private or gated one), or any other failure.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as e:
        raise ModelNotFoundError(
            f"could not download {repo_id!r} from the Hugging Face hub: this machine could not reach the hub "
            "(offline, or HF_HUB_OFFLINE is set) and the model is not in its cache; pass a local model folder "
            "instead"
        ) from e
    except GatedRepoError as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is a gated model on the Hugging Face hub: accept its terms there and set HF_TOKEN"
        ) from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(
            f"no such model on the Hugging Face hub: {repo_id!r} (nor a local folder of that name; a private "
            "model needs HF_TOKEN)"
        ) from e
    except Exception as e:  # any other hub or network failure: still one line
        detail = " ".join(str(e).split())
        raise ModelNotFoundError(f"could not download {repo_id!r} from the Hugging Face hub: {detail}") from e
