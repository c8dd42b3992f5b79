"""The model runner's per-request state and the per-step tensors built from it.

``CachedRequestState`` lives from a request's first scheduling to its finish (through preemptions, so a
seeded generator continues where it stopped). ``build_sampling_metadata`` turns the rows that sample this
step into the sampler's tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core_svc.outputs import LogprobsLists
from core_svc.sampler import SamplingMetadata
from core_svc.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None  # seeded requests only
    block_ids: list[int]
    num_computed_tokens: int  # tokens in the KV cache before the current step
    token_ids: list[int] = field(init=False)  # prompt + sampled tokens
    prompt_logprobs_parts: list[LogprobsLists] = field(default_factory=list)  # accumulated over prefill chunks

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def wants_prompt_logprobs(self) -> bool:
        # Prompt logprobs go out once, with the prefill; a request resumed after it has outputs already.
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids


def build_sampling_metadata(
    states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> SamplingMetadata:
    """Sampler inputs for ``states`` (row i = states[i]); per-row tensors only where some row needs them."""
    params = [s.sampling_params for s in states]
    greedy = [p.is_greedy for p in params]

    def per_row(values: Sequence[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    top_k = [p.top_k if p.top_k > 0 and not g else vocab_size for p, g in zip(params, greedy, strict=True)]
    top_p = [p.top_p if not g else 1.0 for p, g in zip(params, greedy, strict=True)]
    min_p = [p.min_p if not g else 0.0 for p, g in zip(params, greedy, strict=True)]
    num_logprobs = [0 if p.logprobs is None else (vocab_size if p.logprobs == -1 else p.logprobs) for p in params]
    wants_logprobs = any(p.logprobs is not None for p in params)
    metadata = SamplingMetadata(
        temperature=per_row([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]),
        greedy=per_row(greedy, torch.bool),
        all_greedy=all(greedy),
        top_k=per_row(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
        top_p=per_row(top_p) if any(p < 1.0 for p in top_p) else None,
        min_p=per_row(min_p) if any(p > 0.0 for p in min_p) else None,
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        max_num_logprobs=max(num_logprobs) if wants_logprobs else None,
        num_logprobs=num_logprobs,
    )
    _add_logits_processors(metadata, states, vocab_size, device)
    return metadata


def _add_logits_processors(
    metadata: SamplingMetadata, states: list[CachedRequestState], vocab_size: int, device: torch.device
) -> None:
    params = [s.sampling_params for s in states]
    num_rows = len(states)
    if any(p.allowed_token_ids is not None for p in params):
        mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        for i, p in enumerate(params):
            if p.allowed_token_ids is not None:
                mask[i] = True
                mask[i, p.allowed_token_ids] = False
        metadata.allowed_token_mask = mask
    bias_rows, bias_ids, bias_values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            bias_rows.append(i)
            bias_ids.append(token_id)
            bias_values.append(max(-100.0, min(100.0, bias)))
    if bias_rows:
        metadata.logit_bias = (
            torch.tensor(bias_rows, device=device),
            torch.tensor(bias_ids, device=device),
            torch.tensor(bias_values, dtype=torch.float32, device=device),
        )
    min_rows, min_ids = [], []
    for i, (s, p) in enumerate(zip(states, params, strict=True)):
        if len(s.output_token_ids) < p.min_tokens:
            stop_ids = set(p.stop_token_ids)
            if p.eos_token_id is not None and not p.ignore_eos:
                stop_ids.add(p.eos_token_id)
            for token_id in sorted(stop_ids):
                min_rows.append(i)
                min_ids.append(token_id)
    if min_rows:
        metadata.min_tokens_mask = (torch.tensor(min_rows, device=device), torch.tensor(min_ids, device=device))
    if any(p.has_penalties for p in params):
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        for i, s in enumerate(states):
            if s.sampling_params.has_penalties:
                output_ids = s.output_token_ids
                if output_ids:
                    counts[i].index_add_(
                        0, torch.tensor(output_ids, device=device), torch.ones(len(output_ids), device=device)
                    )
                prompt_mask[i, s.prompt_token_ids] = True
        metadata.output_token_counts = counts
        metadata.prompt_token_mask = prompt_mask
        metadata.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
        metadata.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
        metadata.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
