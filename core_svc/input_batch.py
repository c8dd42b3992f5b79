"""The model runner's per-request state and the per-step tensors built from it.

``CachedRequestState`` lives from a request's first scheduling to its finish (through preemptions, so a
seeded generator continues where it stopped). ``build_sampling_metadata`` turns the rows that sample this
step into the sampler's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from core_svc.outputs import LogprobsLists
from core_svc.request import MultiModalFeature
from core_svc.sampler import SamplingMetadata
from core_svc.sampling_params import SamplingParams
from splitserve.base.pooling_params import PoolingParams

# What a pooling request's state holds for sampling_params: vLLM's defaults, never read (it never samples).
NO_SAMPLING = SamplingParams()


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
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its multimodal items, by offset
    # M-RoPE models: the prompt's positions [3, num_prompt_tokens] int64, and mrope_position_delta (tokens past
    # the prompt sit at index + delta in all three streams); made once, at the first scheduling.
    mrope_positions: np.ndarray | None = None
    mrope_position_delta: int = 0
    lora_int_id: int = 0  # its LoRA adapter's id; 0: the base model
    # Greedy with nothing else reading or changing its logits (logprobs, logits processors, penalties); min_tokens
    # is checked per step by samples_by_argmax.
    is_plain_greedy: bool = field(init=False)
    # A pooling request (its sampling_params then NO_SAMPLING, never read: it never samples), resolved; what its
    # prompt's earlier chunks left for the pooler (core_svc.pooler): MEAN the float32 sum of their hidden rows
    # [hidden_size], CLS the first row [hidden_size].
    pooling_params: PoolingParams | None = None
    pooling_sum: torch.Tensor | None = None
    pooling_first: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        self.is_plain_greedy = (
            p.is_greedy
            and p.logprobs is None
            and p.allowed_token_ids is None
            and not p.bad_words_token_ids
            and not p.logit_bias
            and not p.has_penalties
        )

    @property
    def samples_by_argmax(self) -> bool:
        """Its next token is the argmax of its logits, as the sampler would find it: plain greedy, and min_tokens
        (which masks stop ids until reached) reached."""
        p = self.sampling_params
        return self.is_plain_greedy and len(self.token_ids) - self.num_prompt_tokens >= p.min_tokens

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
    """Sampler inputs for ``states`` (row i = states[i]); per-row tensors only where some row needs them.

    Everything is built on the host (numpy) and reaches the device in a few non-blocking copies from pinned
    memory on CUDA (vLLM v1's ``InputBatch`` keeps the same per-row arrays on the host); nothing here waits for
    the device.
    """
    params = [s.sampling_params for s in states]
    greedy = [p.is_greedy for p in params]
    to_device = _HostToDevice(device)
    top_k = [p.top_k if p.top_k > 0 and not g else vocab_size for p, g in zip(params, greedy, strict=True)]
    top_p = [p.top_p if not g else 1.0 for p, g in zip(params, greedy, strict=True)]
    min_p = [p.min_p if not g else 0.0 for p, g in zip(params, greedy, strict=True)]
    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    has_penalties = any(p.has_penalties for p in params)
    penalties = (
        [[p.presence_penalty for p in params], [p.frequency_penalty for p in params]]
        + [[p.repetition_penalty for p in params]]
        if has_penalties
        else []
    )
    # The float32 per-row fields in one array, one copy: temperature, top_p, min_p[, presence, frequency,
    # repetition penalties].
    floats = to_device(np.array([temperature, top_p, min_p, *penalties], dtype=np.float32))
    # greedy (0/1) and top_k in one int64 array.
    ints = to_device(np.array([greedy, top_k], dtype=np.int64))
    num_logprobs = [0 if p.logprobs is None else (vocab_size if p.logprobs == -1 else p.logprobs) for p in params]
    wants_logprobs = any(p.logprobs is not None for p in params)
    metadata = SamplingMetadata(
        temperature=floats[0],
        greedy=ints[0].bool(),
        all_greedy=all(greedy),
        top_k=ints[1] if any(k < vocab_size for k in top_k) else None,
        top_p=floats[1] if any(p < 1.0 for p in top_p) else None,
        min_p=floats[2] if any(p > 0.0 for p in min_p) else None,
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        max_num_logprobs=max(num_logprobs) if wants_logprobs else None,
        num_logprobs=num_logprobs,
    )
    if has_penalties:
        metadata.presence_penalty, metadata.frequency_penalty, metadata.repetition_penalty = floats[3:6]
        metadata.output_token_counts, metadata.prompt_token_mask = _penalty_inputs(states, vocab_size, to_device)
    _add_logits_processors(metadata, states, vocab_size, to_device)
    return metadata


class _HostToDevice:
    """numpy array -> tensor on ``device``: as is on CPU (no copy); on CUDA through pinned memory (torch's
    caching host allocator, which keeps the block until the copy has read it) with a non-blocking copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


def _add_logits_processors(
    metadata: SamplingMetadata, states: list[CachedRequestState], vocab_size: int, to_device: _HostToDevice
) -> None:
    params = [s.sampling_params for s in states]
    if any(p.allowed_token_ids is not None for p in params):
        # Only the (row, id) pairs cross to the device, not a dense [rows, vocab] array.
        limited_rows = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        allowed = [(i, token_id) for i in limited_rows for token_id in params[i].allowed_token_ids or ()]
        mask = torch.zeros((len(states), vocab_size), dtype=torch.bool, device=to_device.device)
        mask[to_device(np.array(limited_rows, dtype=np.int64))] = True
        if allowed:
            indices = to_device(np.array(allowed, dtype=np.int64).T.copy())
            mask[indices[0], indices[1]] = False
        metadata.allowed_token_mask = mask
    bias_rows, bias_ids, bias_values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            bias_rows.append(i)
            bias_ids.append(token_id)
            bias_values.append(bias)  # as given (vLLM's LogitBiasLogitsProcessor); NaN and +inf are refused
    if bias_rows:
        indices = to_device(np.array([bias_rows, bias_ids], dtype=np.int64))
        metadata.logit_bias = (indices[0], indices[1], to_device(np.array(bias_values, dtype=np.float32)))
    min_rows, min_ids = [], []  # min_tokens' stop ids and bad words' banned ids: both set to -inf
    for i, (s, p) in enumerate(zip(states, params, strict=True)):
        if p.bad_words_token_ids:  # few requests have them: no call per row otherwise
            for token_id in banned_bad_word_ids(p.bad_words_token_ids, s.output_token_ids):
                min_rows.append(i)
                min_ids.append(token_id)
        if len(s.output_token_ids) < p.min_tokens:
            stop_ids = set(p.stop_token_ids) | set(p.model_eos_token_ids)
            if p.eos_token_id is not None:  # with ignore_eos too: vLLM's all_stop_token_ids always hold EOS
                stop_ids.add(p.eos_token_id)
            for token_id in sorted(stop_ids):
                min_rows.append(i)
                min_ids.append(token_id)
    if min_rows:
        indices = to_device(np.array([min_rows, min_ids], dtype=np.int64))
        metadata.min_tokens_mask = (indices[0], indices[1])


def banned_bad_word_ids(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The ids vLLM's bad words ban at the next position: each sequence's last id where the output so far ends
    with the ids before it (a one-id sequence: always), as vLLM v1's ``apply_bad_words`` over the output ids."""
    banned: list[int] = []
    for sequence in bad_words_token_ids:
        prefix = sequence[:-1]
        if not prefix or (len(output_token_ids) >= len(prefix) and output_token_ids[-len(prefix) :] == prefix):
            banned.append(sequence[-1])
    return banned


def _penalty_inputs(
    states: list[CachedRequestState], vocab_size: int, to_device: _HostToDevice
) -> tuple[torch.Tensor, torch.Tensor]:
    """``output_token_counts`` [num_rows, vocab_size] float32 and ``prompt_token_mask`` [num_rows, vocab_size]
    bool, made on the device from the (row, id) pairs of the requests with penalties (only those cross from the
    host, not dense [rows, vocab] arrays); zero rows for requests without penalties."""
    output_pairs: list[tuple[int, int]] = []
    prompt_pairs: list[tuple[int, int]] = []
    for i, s in enumerate(states):
        if s.sampling_params.has_penalties:
            output_pairs.extend((i, token_id) for token_id in s.output_token_ids)
            prompt_pairs.extend((i, token_id) for token_id in s.prompt_token_ids)
    device = to_device.device
    counts = torch.zeros((len(states), vocab_size), dtype=torch.float32, device=device)
    prompt_mask = torch.zeros((len(states), vocab_size), dtype=torch.bool, device=device)
    if output_pairs:
        rows, ids = to_device(np.array(output_pairs, dtype=np.int64).T.copy())
        counts.index_put_(
            (rows, ids), torch.ones(len(output_pairs), dtype=torch.float32, device=device), accumulate=True
        )
    if prompt_pairs:
        rows, ids = to_device(np.array(prompt_pairs, dtype=np.int64).T.copy())
        prompt_mask[rows, ids] = True
    return counts, prompt_mask
