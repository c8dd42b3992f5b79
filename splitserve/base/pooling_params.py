"""``PoolingParams`` (vLLM ``vllm/pooling_params.py``): a pooling (embedding) request's parameters, shared by both
services, and the pooler settings a model serves with (vLLM's ``PoolerConfig``).

A pooling request computes its prompt once (prefill only, chunks included), samples nothing, and returns one
vector pooled from the final-layer hidden states (after the final norm, transformers' ``last_hidden_state``):
``LAST`` (the last prompt token), ``MEAN`` (all prompt tokens), ``CLS`` (the first). ``dimensions`` keeps the
first d values (Matryoshka), then ``normalize`` divides by the L2 norm, both as vLLM's ``EmbeddingPoolerHead``.

vLLM fixes the pooling type per model (``--pooler-config``); here a request may also name one
(``pooling_type``), and unset fields take the serving core's ``PoolerConfig``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from splitserve.base.status import Violation

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[PoolingType, ...] = ("LAST", "MEAN", "CLS")


@dataclass
class PoolingParams:
    """vLLM's ``PoolingParams`` (task "embed"): None fields take the model's pooler config.

    Attributes:
        pooling_type: "LAST", "MEAN" or "CLS" (an extension: vLLM sets it per model only).
        normalize: L2-normalize the vector; None: the model's default (whether its modules.json has a Normalize
            module; True without modules.json, vLLM's default for embed).
        dimensions: Matryoshka truncation to the first ``dimensions`` values, before normalizing; models whose
            config declares ``is_matryoshka`` or ``matryoshka_dimensions`` only (vLLM's rule).
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: as many as the model takes, max_model_len
            - 1), applied by the frontend when it tokenizes.
    """

    pooling_type: PoolingType | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def clone(self) -> PoolingParams:
        return PoolingParams(self.pooling_type, self.normalize, self.dimensions, self.truncate_prompt_tokens)


def pooling_params_violation(params: PoolingParams) -> Violation | None:
    """The rules that need no model: a known pooling type, a type-correct ``normalize``, ``dimensions`` >= 1,
    ``truncate_prompt_tokens`` -1 or >= 1 (vLLM's ``PoolingParams`` and ``_validate_truncation_size``)."""
    if params.pooling_type is not None and params.pooling_type not in POOLING_TYPES:
        return Violation("pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got {params.pooling_type!r}")
    normalize: object = params.normalize  # a Python caller may pass anything
    if normalize is not None and not isinstance(normalize, bool):
        return Violation("normalize", f"must be a bool, got {type(normalize).__name__}")
    for name in ("dimensions", "truncate_prompt_tokens"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return Violation(name, f"must be an integer, got {type(value).__name__}")
    if params.dimensions is not None and params.dimensions < 1:
        return Violation("dimensions", f"must be at least 1, got {params.dimensions}")
    if params.truncate_prompt_tokens is not None and (
        params.truncate_prompt_tokens < -1 or params.truncate_prompt_tokens == 0
    ):
        return Violation("truncate_prompt_tokens", f"must be -1 or at least 1, got {params.truncate_prompt_tokens}")
    return None


@dataclass(frozen=True)
class PoolerConfig:
    """How a core pools when a request leaves a field unset (vLLM's ``PoolerConfig``)."""

    pooling_type: PoolingType = "LAST"  # vLLM's default for decoder models converted to embedding models
    normalize: bool = True  # vLLM's default for task "embed"
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: ``dimensions`` refused; (): any up to hidden_size

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """``params`` with unset pooling_type and normalize taken from this config (a copy)."""
        resolved = params.clone()
        resolved.pooling_type = params.pooling_type or self.pooling_type
        resolved.normalize = self.normalize if params.normalize is None else params.normalize
        return resolved

    def dimensions_violation(self, dimensions: int | None, hidden_size: int) -> Violation | None:
        """vLLM's ``PoolingParams._verify_valid_dimensions``: only Matryoshka models truncate, to a listed size
        when the model lists them, never past the hidden size."""
        if dimensions is None:
            return None
        if self.matryoshka_dimensions is None:
            return Violation(
                "dimensions",
                "this model does not support Matryoshka representation; changing output dimensions "
                "would give poor results",
            )
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return Violation(
                "dimensions",
                f"{dimensions} is not one of the model's matryoshka_dimensions {list(self.matryoshka_dimensions)}",
            )
        if dimensions > hidden_size:
            return Violation("dimensions", f"{dimensions} is more than the model's hidden size {hidden_size}")
        return None


# sentence-transformers' Pooling module settings -> vLLM's pooling type (vLLM ``get_pooling_config``).
_SENTENCE_TRANSFORMERS_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


# The sentence-transformers modules the core runs: the model itself, its pooling and the L2 normalization.
_RUN_MODULES = (".Transformer", ".Pooling", ".Normalize")


def load_pooler_config(model_path: Path) -> PoolerConfig:
    """A model folder's pooler config, as vLLM reads it: sentence-transformers' ``modules.json`` names a
    ``Pooling`` module (its ``config.json``: ``pooling_mode_lasttoken`` / ``_mean_tokens`` / ``_cls_token``) and
    whether a ``Normalize`` module follows; without ``modules.json``, vLLM's defaults for a decoder embedding
    model (LAST, normalize). ``config.json``'s ``is_matryoshka`` / ``matryoshka_dimensions`` say whether the model
    takes ``dimensions``.

    Raises:
        ValueError: a ``modules.json`` or pooling config that does not parse, a pooling mode we do not run, a
            module other than Transformer, Pooling and Normalize (a ``Dense`` projection: the vectors would be the
            pooled hidden states without it), or ``sentence_bert_config.json``'s ``do_lower_case`` (the text would
            be tokenized as sent, not lowercased).
    """
    config_file = model_path / "config.json"
    hf_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    matryoshka = hf_config.get("matryoshka_dimensions")
    dims: tuple[int, ...] | None = None
    if isinstance(matryoshka, list):
        dims = tuple(int(d) for d in matryoshka)
    elif hf_config.get("is_matryoshka"):
        dims = ()
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig(matryoshka_dimensions=dims)
    modules = json.loads(modules_file.read_text())
    unrun = [str(m.get("type", "")) for m in modules if not str(m.get("type", "")).endswith(_RUN_MODULES)]
    if unrun:
        raise ValueError(
            f"{modules_file}: modules {unrun} are not run by the engine core (only Transformer, Pooling, "
            "Normalize): its vectors would be the pooled hidden states without them"
        )
    sentence_bert = model_path / "sentence_bert_config.json"
    if sentence_bert.is_file() and json.loads(sentence_bert.read_text()).get("do_lower_case"):
        raise ValueError(f"{sentence_bert}: do_lower_case is not implemented (texts would not be lowercased)")
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return PoolerConfig(normalize=normalize, matryoshka_dimensions=dims)
    settings = json.loads((model_path / str(pooling.get("path", "")) / "config.json").read_text())
    modes = [mode for key, mode in _SENTENCE_TRANSFORMERS_MODES.items() if settings.get(key)]
    others = [
        k for k, v in settings.items() if k.startswith("pooling_mode_") and v and k not in _SENTENCE_TRANSFORMERS_MODES
    ]
    if others or len(modes) != 1:
        raise ValueError(
            f"{modules_file.parent / str(pooling.get('path', ''))}/config.json: pooling modes {others or modes} are "
            f"not one of {', '.join(_SENTENCE_TRANSFORMERS_MODES)}"
        )
    return PoolerConfig(pooling_type=modes[0], normalize=normalize, matryoshka_dimensions=dims)
