"""Hand-off structures inside the core: scheduler -> model runner -> scheduler -> engine core -> wire.

Plain dataclasses; ``core_svc.wire`` converts the last ones to protobuf. Field names equal the proto's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core_svc.request import EngineCoreEvent, FinishReason, MultiModalFeature
from core_svc.sampling_params import SamplingParams
from splitserve.base.pooling_params import PoolingParams


@dataclass
class NewRequestData:
    """A request the model runner has not seen before."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # None: a pooling request
    block_ids: list[int]  # its whole block table so far
    num_computed_tokens: int  # tokens already in the KV cache (prefix-cache hits)
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its multimodal items, by offset
    lora_int_id: int = 0  # its LoRA adapter's id; 0: the base model
    pooling_params: PoolingParams | None = None  # a pooling request's, resolved (pooling_type, normalize set)


@dataclass
class CachedRequestData:
    """A request the model runner already holds."""

    request_id: str
    new_block_ids: list[int]  # blocks to append; the whole table when resumed_from_preemption
    num_computed_tokens: int  # tokens in the KV cache before this step
    resumed_from_preemption: bool


@dataclass
class SchedulerOutput:
    """One step's work for the model runner."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens to compute this step
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens
    finished_req_ids: set[str]  # requests finished since the last step: the runner drops their state
    preempted_req_ids: set[str]  # requests preempted this step (the runner keeps their state; on resume they
    # come back in scheduled_cached_reqs with resumed_from_preemption and a whole new block table)
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # request_id -> indices into
    # its mm_features whose encoder outputs the runner computes (and caches by identifier) this step
    scheduled_encoder_mm_hashes: list[str] = field(default_factory=list)  # identifiers of those items, in order:
    # what a failed step evicts, even for a request aborted since
    free_encoder_mm_hashes: list[str] = field(default_factory=list)  # identifiers whose cached encoder outputs
    # the runner drops before this step (evicted by the EncoderCacheManager)


@dataclass
class LogprobsLists:
    """Logprobs of consecutive positions; row i: the chosen token first, then the top-k."""

    logprob_token_ids: list[list[int]]  # [num_positions][1 + num_logprobs]
    logprobs: list[list[float]]  # [num_positions][1 + num_logprobs], natural log of raw model probabilities
    ranks: list[int]  # [num_positions], 1-based rank of the chosen token in the vocabulary

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.logprob_token_ids[start:end], self.logprobs[start:end], self.ranks[start:end])


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced."""

    sampled_token_ids: dict[str, list[int]]  # request_id -> tokens sampled this step ([] mid-prefill)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # request_id -> one row per sampled token
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # request_id -> rows for prompt
    # tokens 1..num_prompt_tokens-1, given once, in the step that completes the prefill
    failed_requests: dict[str, Exception] = field(default_factory=dict)  # request_id -> why the runner could not
    # compute it this step (its sampled tokens, if any, are void); the other requests of the step are unaffected
    pooler_output: dict[str, bytes] = field(default_factory=dict)  # request_id -> its pooled vector, float32
    # little-endian [dimensions], for each pooling request whose prompt this step completed


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # stop token id (or stop string, set by the frontend)
    events: list[EngineCoreEvent] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: Exception | None = None  # with finish_reason ERROR: why; the wire carries its status code, message and
    # field (core_svc.wire.request_error_to_pb)
    pooling_output: bytes | None = None  # a pooling request's vector (float32 little-endian), in its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the stats were last taken, one per admission (vLLM's ``PrefixCacheStats``).

    A request admitted again after a preemption is counted apart, in ``preempted_*``: what it finds is mostly
    its own blocks, left from before it was preempted, so counting it with first admissions would make the hit
    rate (hits / queries) and the ``prefix_cache_queries`` / ``prefix_cache_hits`` counters report its recompute
    as sharing. Units: requests, and tokens for queries and hits.
    """

    requests: int = 0  # requests admitted for the first time
    queries: int = 0  # their tokens looked up
    hits: int = 0  # of those, tokens found in the cache
    reset: bool = False  # the cache was reset
    preempted_requests: int = 0  # requests admitted again after a preemption
    preempted_queries: int = 0  # their tokens looked up (prompt and outputs so far)
    preempted_hits: int = 0  # of those, tokens found in the cache

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """One admission's lookup: ``num_tokens`` looked up, ``num_hits`` found; ``preempted``: the request
        was preempted before (as vLLM's ``PrefixCacheStats.record``)."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable blocks in use
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions: int = 0  # since the last stats


@dataclass
class EngineCoreOutputs:
    """Everything one step produced."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    finished_requests: set[str] = field(default_factory=set)  # ids finished since the last outputs
    engine_index: int = 0
    timestamp: float = field(default_factory=time.monotonic)
