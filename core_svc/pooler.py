"""Pooling a request's final-layer hidden states into one vector, across prefill chunks (vLLM's ``Pooler`` for
task "embed": ``LastPool`` / ``MeanPool`` / ``CLSPool``, then ``EmbeddingPoolerHead``: Matryoshka truncation to
``dimensions``, then L2 normalization, in float32).

A prompt may be computed in several chunks (chunked prefill), so the model runner calls ``accumulate`` with
each chunk's hidden rows and ``finish`` in the step that computes its last prompt token: MEAN keeps a running
float32 sum, CLS the first row; LAST needs only the last row, which ``finish`` takes.
"""

from __future__ import annotations

import torch

from core_svc.input_batch import CachedRequestState


def accumulate(state: CachedRequestState, hidden: torch.Tensor, start: int) -> None:
    """Fold one chunk's hidden rows ``hidden`` ``[num_tokens, hidden_size]`` (prompt positions ``start``...)
    into ``state``'s pooling accumulators."""
    params = state.pooling_params
    if params is None:
        raise RuntimeError(f"request {state.request_id} is not a pooling request")
    if params.pooling_type == "MEAN":
        chunk_sum = hidden.sum(dim=0, dtype=torch.float32)
        state.pooling_sum = chunk_sum if state.pooling_sum is None else state.pooling_sum + chunk_sum
    elif params.pooling_type == "CLS" and start == 0:
        # A copy, never a view: for a float32 model ``.to`` returns the step output's own row, which would keep
        # the whole step output alive and, under CUDA graph replay, alias the static output buffer.
        state.pooling_first = hidden[0].to(torch.float32, copy=True)


def finish(state: CachedRequestState, last_hidden: torch.Tensor) -> torch.Tensor:
    """The request's vector ``[dimensions or hidden_size]`` float32, once every prompt chunk was accumulated;
    ``last_hidden`` ``[hidden_size]`` is the last prompt token's row. Resets the accumulators."""
    params = state.pooling_params
    if params is None:
        raise RuntimeError(f"request {state.request_id} is not a pooling request")
    if params.pooling_type == "MEAN":
        if state.pooling_sum is None:
            raise RuntimeError(f"request {state.request_id}: MEAN pooling saw no hidden rows")
        pooled = state.pooling_sum / state.num_prompt_tokens
    elif params.pooling_type == "CLS":
        if state.pooling_first is None:
            raise RuntimeError(f"request {state.request_id}: CLS pooling never saw its first token")
        pooled = state.pooling_first
    else:
        pooled = last_hidden.to(torch.float32, copy=True)  # a copy: see ``accumulate``
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    if params.normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)  # vLLM's: x / max(||x||, 1e-12)
    state.pooling_sum = state.pooling_first = None
    return pooled
