"""What the loader and the model runner require of a model class (vLLM ``model_executor/models/interfaces.py``).

``ServedModel`` is the base of every model we serve; ``SupportsMultiModal`` adds the encoder side of models that
take images (LLaVA here, Qwen2-VL next): the runner calls ``embed_multimodal`` for the items the scheduler says,
caches the results by item identifier, and merges their rows into ``embed_input_ids``' output at the items'
placeholder positions before ``forward``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from core_svc.request import MultiModalFeature


class ServedModel(nn.Module):
    """A causal LM over a flattened batch. ``forward(input_ids, positions, kv_caches, metadata,
    inputs_embeds=None) -> hidden [num_tokens, hidden_size]``; subclasses implement every method below
    (``get_mrope_input_positions``: M-RoPE models only)."""

    # True: ``forward`` takes M-RoPE positions [3, num_tokens] and the model has ``get_mrope_input_positions``
    # (Qwen2-VL); the runner then keeps each request's prompt positions and delta.
    uses_mrope: bool = False

    def get_mrope_input_positions(
        self, prompt_len: int, mm_features: Sequence[MultiModalFeature]
    ) -> tuple[torch.Tensor, int]:
        """M-RoPE models: a prompt's positions [3, prompt_len] int64 and its ``mrope_position_delta`` (positions
        past the prompt are ``index + delta``), from its items' placement and data (vLLM's
        ``SupportsMRoPE.get_mrope_input_positions``)."""
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: [num_tokens] int64 -> [num_tokens, hidden_size] (vLLM's ``embed_input_ids``)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden_size] -> float32 logits [num_rows, vocab_size]."""
        raise NotImplementedError

    def checkpoint_param_name(self, name: str) -> tuple[str, int | None] | None:
        """Map a checkpoint tensor name to (our parameter name, shard index or None); None for names to skip."""
        raise NotImplementedError

    def shard_sizes(self, fused_name: str) -> list[int]:
        """Output rows of each shard of a fused parameter, in shard order."""
        raise NotImplementedError


class SupportsMultiModal(ServedModel):
    """A model whose prompts hold multimodal items (vLLM's ``SupportsMultiModal``)."""

    def embed_multimodal(self, feature: MultiModalFeature) -> torch.Tensor:
        """The item's embeddings, one row per placeholder token: [feature.length, hidden_size] in the model's
        dtype, on its device (vLLM's ``embed_multimodal``). The feature passed ``mm_feature_violation``."""
        raise NotImplementedError

    def embed_multimodal_batch(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """``embed_multimodal`` of each feature, in order; a model overrides it to batch items of one shape
        through its encoder in one call (vLLM batches a step's items by modality)."""
        return [self.embed_multimodal(feature) for feature in features]

    @property
    def max_tokens_per_mm_item(self) -> int:
        """Most placeholder tokens (embedding rows) one item can have: the encoder budget and cache are at least
        this (vLLM's ``get_max_tokens_per_item``)."""
        raise NotImplementedError

    def dummy_mm_feature(self) -> MultiModalFeature:
        """An item of ``max_tokens_per_mm_item`` rows with zero data, for the profile run (vLLM's dummy inputs
        of ``MultiModalProfiler``); its offset is 0."""
        raise NotImplementedError

    def mm_feature_violation(self, feature: MultiModalFeature) -> str | None:
        """Why this model cannot take ``feature`` (modality, data keys, shapes, dtypes, placeholder count), as a
        message naming the field; None when it can. Placement in the prompt is checked by the engine core."""
        raise NotImplementedError
