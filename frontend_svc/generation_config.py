"""A model's default sampling parameters, from its generation config (vLLM's ``--generation-config``).

``"auto"`` (the default, as vLLM's): the model folder's ``generation_config.json`` (or, without one, the
generation settings in its ``config.json``), read with transformers' ``GenerationConfig``; ``"vllm"``: none, vLLM's
own defaults; any other value: a folder holding a ``generation_config.json``. The defaults fill the sampling
fields a request leaves unset (``sampling_params.GENERATION_CONFIG_FIELDS``), as vLLM's
``ModelConfig.get_diff_sampling_param``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from frontend_svc.errors import ValidationError
from frontend_svc.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

logger = logging.getLogger(__name__)

AUTO, VLLM = "auto", "vllm"


def load_default_sampling_params(model_path: Path, generation_config: str = AUTO) -> dict[str, Any]:
    """The model's default sampling parameters: {field: value} for the fields of ``GENERATION_CONFIG_FIELDS``
    its generation config sets (``max_new_tokens`` becomes ``max_tokens``); empty for ``"vllm"``. Logged when
    not empty, as vLLM logs them at startup.

    Args:
        model_path: the model's local folder (``"auto"`` reads it).
        generation_config: ``"auto"``, ``"vllm"`` or a folder with a ``generation_config.json``.

    Raises:
        ValidationError: ``generation_config`` names a folder without a readable ``generation_config.json``, or
            the generation config sets a value SamplingParams refuses (field ``generation_config``).
    """
    if generation_config == VLLM:
        return {}
    if generation_config == AUTO:
        config = _model_generation_config(model_path)
        source = f"the model ({model_path})"
    else:
        config = _folder_generation_config(Path(generation_config).expanduser())
        source = generation_config
    if config is None:
        return {}
    values = config.to_diff_dict()  # what the file sets, as vLLM's (transformers' defaults are unset)
    values["max_tokens"] = values.pop("max_new_tokens", None)
    defaults = {name: values[name] for name in GENERATION_CONFIG_FIELDS if values.get(name) is not None}
    try:
        SamplingParams(**{**defaults, "max_tokens": defaults.get("max_tokens", 16)})
    except ValidationError as e:
        raise ValidationError(
            "generation_config",
            f"{source} sets a default that is refused: {e} (--generation-config vllm ignores the model's defaults)",
        ) from e
    if defaults:
        logger.info(
            "Default sampling parameters from %s: %s (unset request fields take them; generation config 'vllm' "
            "ignores them)",
            source,
            defaults,
        )
    return defaults


def _model_generation_config(model_path: Path) -> Any:
    """The model's ``GenerationConfig``, or None: none to read, or unreadable (logged; vLLM's defaults apply)."""
    from transformers import AutoConfig, GenerationConfig

    if not model_path.is_dir():
        logger.warning("no local folder for model %s: its generation config is not read", model_path)
        return None
    try:
        if (model_path / "generation_config.json").is_file():
            return GenerationConfig.from_pretrained(str(model_path))
        if (model_path / "config.json").is_file():  # as vLLM's try_get_generation_config
            return GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(model_path)))
    except (OSError, ValueError) as e:
        logger.warning("ignoring the unreadable generation config of %s: %s", model_path, e)
    return None


def check_generation_config(generation_config: str) -> None:
    """What can be checked of a ``--generation-config`` value without the model (the command line does it before
    loading or waiting for anything).

    Raises:
        ValidationError: neither ``"auto"``, ``"vllm"`` nor a folder holding a ``generation_config.json``.
    """
    if generation_config in (AUTO, VLLM):
        return
    folder = Path(generation_config).expanduser()
    if not (folder / "generation_config.json").is_file():
        raise ValidationError(
            "generation_config",
            f"must be 'auto', 'vllm' or a folder holding a generation_config.json; {folder} holds none",
        )


def _folder_generation_config(folder: Path) -> Any:
    from transformers import GenerationConfig

    check_generation_config(str(folder))
    try:
        return GenerationConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValidationError("generation_config", f"cannot read {folder / 'generation_config.json'}: {e}") from e
