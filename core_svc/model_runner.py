"""Runs the model on one step's flattened batch and samples (vLLM v1 ``GPUModelRunner``, CPU-first).

All scheduled tokens of all requests (prefill chunks and decodes together) go through one forward with
``positions``, ``slot_mapping``, ``block_table``, ``query_start_loc`` and ``seq_lens``; logits are computed
only for rows that sample (and for prompt positions of requests that asked for prompt logprobs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from core_svc.input_batch import CachedRequestState, build_sampling_metadata
from core_svc.model_loader import LoadedModel
from core_svc.outputs import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from core_svc.sampler import Sampler, gather_logprobs
from kernels import AttentionMetadata

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One forward's inputs, and which hidden rows feed the sampler and prompt logprobs."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_states: list[CachedRequestState]  # requests that sample this step, in row order
    sample_rows: torch.Tensor  # [num_sampling_reqs] int64, hidden row of each one's last token
    prompt_logprob_rows: dict[str, tuple[int, int, int]]  # request_id -> (first hidden row, first position, count)


class ModelRunner:
    """Owns the model weights, the paged KV cache tensors and per-request runner state.

    Args:
        loaded: the model from ``model_loader.load_model``.
        num_kv_blocks: KV blocks including the null block 0.
        block_size: tokens per block.
        seed: seeds the generator of unseeded random sampling.
    """

    def __init__(self, loaded: LoadedModel, num_kv_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = loaded.model
        self.arch = loaded.arch
        self.vocab_size = loaded.arch.vocab_size
        self.block_size = block_size
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        shape = (2, num_kv_blocks, block_size, self.arch.num_key_value_heads, self.arch.head_size)
        # Zeroed so the null block, which pads block tables, never holds NaN.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.arch.num_hidden_layers)
        ]
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(seed))
        self.requests: dict[str, CachedRequestState] = {}

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the scheduled tokens, sample for requests whose known tokens are all computed."""
        self._update_states(scheduler_output)
        if not scheduler_output.total_num_scheduled_tokens:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs = self._prepare_inputs(scheduler_output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)
        output = ModelRunnerOutput(sampled_token_ids={rid: [] for rid in scheduler_output.num_scheduled_tokens})
        self._compute_prompt_logprobs(hidden, inputs, output)
        if inputs.sample_states:
            logits = self.model.compute_logits(hidden[inputs.sample_rows])
            metadata = build_sampling_metadata(inputs.sample_states, self.vocab_size, self.device)
            sampler_output = self.sampler(logits, metadata)
            for i, (state, token_id) in enumerate(
                zip(inputs.sample_states, sampler_output.sampled_token_ids.tolist(), strict=True)
            ):
                state.token_ids.append(token_id)
                output.sampled_token_ids[state.request_id] = [token_id]
                if sampler_output.logprobs is not None and state.sampling_params.logprobs is not None:
                    output.logprobs[state.request_id] = sampler_output.logprobs.slice(i, i + 1)
        return output

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Drop the per-request state of ``request_ids``; unknown ids are ignored."""
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.remove_requests(scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            seed = new.sampling_params.seed
            generator = None
            if seed is not None and not new.sampling_params.is_greedy:
                generator = torch.Generator(device=self.device).manual_seed(seed)
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                prompt_token_ids=new.prompt_token_ids,
                sampling_params=new.sampling_params,
                generator=generator,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
                state.prompt_logprobs_parts.clear()
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        block_size = self.block_size
        # Requests with one query token first: attention backends batch them as decodes (vLLM's reorder_batch).
        scheduled = sorted(scheduler_output.num_scheduled_tokens.items(), key=lambda item: item[1] != 1)
        num_decodes = sum(1 for _, num_tokens in scheduled if num_tokens == 1)
        num_reqs = len(scheduled)
        max_blocks = max(len(self.requests[rid].block_ids) for rid, _ in scheduled)
        block_table = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        input_ids: list[int] = []
        positions_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_states: list[CachedRequestState] = []
        sample_rows: list[int] = []
        prompt_logprob_rows: dict[str, tuple[int, int, int]] = {}
        for i, (request_id, num_tokens) in enumerate(scheduled):
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_tokens
            block_ids = np.asarray(state.block_ids, dtype=np.int64)
            block_table[i, : len(block_ids)] = block_ids
            positions = np.arange(start, end, dtype=np.int64)
            positions_parts.append(positions)
            slot_parts.append(block_ids[positions // block_size] * block_size + positions % block_size)
            input_ids.extend(state.token_ids[start:end])
            row = query_start_loc[-1]
            if state.wants_prompt_logprobs and start < state.num_prompt_tokens - 1:
                count = min(end, state.num_prompt_tokens - 1) - start
                prompt_logprob_rows[request_id] = (row, start, count)
            query_start_loc.append(row + num_tokens)
            seq_lens.append(end)
            if end >= len(state.token_ids):
                sample_states.append(state)
                sample_rows.append(row + num_tokens - 1)
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)).to(device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=torch.from_numpy(block_table).to(device),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:], strict=False)),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
        )
        return StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.from_numpy(np.concatenate(positions_parts)).to(device),
            metadata=metadata,
            sample_states=sample_states,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            prompt_logprob_rows=prompt_logprob_rows,
        )

    def _compute_prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs, output: ModelRunnerOutput) -> None:
        """Logprobs of prompt tokens 1..P-1 given their prefixes, accumulated over chunks and emitted in the step
        that completes the prefill."""
        for request_id, (row, first_position, count) in inputs.prompt_logprob_rows.items():
            state = self.requests[request_id]
            logprobs = self.model.compute_logits(hidden[row : row + count]).log_softmax(dim=-1)
            targets = torch.tensor(
                state.prompt_token_ids[first_position + 1 : first_position + 1 + count], device=self.device
            )
            k = state.sampling_params.prompt_logprobs or 0  # set: rows are made for wants_prompt_logprobs only
            k = self.vocab_size if k == -1 else k
            state.prompt_logprobs_parts.append(gather_logprobs(logprobs, targets, k, [k] * count))
        for state in inputs.sample_states:
            if state.wants_prompt_logprobs:
                parts = state.prompt_logprobs_parts
                output.prompt_logprobs[state.request_id] = LogprobsLists(
                    logprob_token_ids=[ids for part in parts for ids in part.logprob_token_ids],
                    logprobs=[values for part in parts for values in part.logprobs],
                    ranks=[rank for part in parts for rank in part.ranks],
                )
                parts.clear()
