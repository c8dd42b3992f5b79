"""Per-request and per-iteration statistics the frontend keeps (vLLM v1's ``vllm/v1/metrics/stats.py``).

Two clocks meet here. ``arrival_time`` and ``IterationStats.iteration_timestamp`` are this process's
``time.time()`` (what the client waits for: TTFT, e2e). The other timestamps are the core's
``time.monotonic()``, from its events and ``EngineCoreOutputs.timestamp``; only differences between two of them
(one request, one core) are used: queue, prefill, decode and inference times, inter-token latency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from frontend_svc.engine_types import EngineCoreEvent, EngineCoreEventType
from splitserve.base.request_phases import RequestPhases


@dataclass
class RequestStateStats(RequestPhases):
    """One core request's timing, updated as its outputs arrive. Seconds; None: not yet."""

    arrival_time: float  # time.time() when the frontend took the request
    num_generation_tokens: int = 0
    queued_ts: float | None = None  # core monotonic: added to the core's waiting queue
    scheduled_ts: float | None = None  # core monotonic: first scheduled (a preemption does not reset it)
    first_token_ts: float | None = None  # core monotonic: the step that produced the first token
    last_token_ts: float | None = None  # core monotonic: the step that produced the latest token
    first_token_latency: float | None = None  # time.time() difference: first token handled - arrival
    num_preemptions: int = 0


@dataclass(frozen=True)
class FinishedRequestStats:
    """A finished request's numbers, as vLLM's: queued = scheduled - queued, prefill = first token -
    scheduled, decode = last token - first token, inference = last token - scheduled, time per output token =
    decode / (generation tokens - 1). Intervals that never began (aborted while queued) are 0."""

    finish_reason: str  # stop, length, abort, error
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    queued_time: float
    prefill_time: float
    inference_time: float
    decode_time: float
    mean_time_per_output_token: float
    first_token_latency: float | None
    num_preemptions: int


@dataclass
class IterationStats:
    """What one batch of core outputs brought (one ``EngineCoreOutputs``, or an abort outside one)."""

    iteration_timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0  # prompts of the requests whose first token came in this batch
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    # Per API request (an n > 1 parent once all its children have finished, as vLLM's
    # ParentRequest.observe_finished_request): its n, and the most tokens any of its completions generated.
    n_params_iter: list[int] = field(default_factory=list)
    max_num_generation_tokens_iter: list[int] = field(default_factory=list)

    def update_from_output(
        self,
        num_new_tokens: int,
        events: list[EngineCoreEvent],
        engine_core_timestamp: float,
        num_prompt_tokens: int,
        req_stats: RequestStateStats,
    ) -> None:
        """One request's output: its events, then its new tokens (the first ones end the prefill)."""
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                req_stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if req_stats.scheduled_ts is None:
                    req_stats.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                self.num_preempted_reqs += 1
                req_stats.num_preemptions += 1
        if num_new_tokens == 0:
            return
        self.num_generation_tokens += num_new_tokens
        if req_stats.first_token_ts is None:
            self.num_prompt_tokens += num_prompt_tokens
            req_stats.first_token_latency = self.iteration_timestamp - req_stats.arrival_time
            self.time_to_first_tokens_iter.append(req_stats.first_token_latency)
            req_stats.first_token_ts = engine_core_timestamp
        elif req_stats.last_token_ts is not None:
            self.inter_token_latencies_iter.append(engine_core_timestamp - req_stats.last_token_ts)
        req_stats.last_token_ts = engine_core_timestamp
        req_stats.num_generation_tokens += num_new_tokens

    def update_from_pooling_output(
        self, engine_core_timestamp: float, num_prompt_tokens: int, req_stats: RequestStateStats
    ) -> None:
        """A pooling request's one output (it samples no token): its prompt counts now and its vector is its
        first "token" for TTFT and the prefill time, as vLLM counts a pooling request's prompt on its output."""
        if req_stats.first_token_ts is not None:
            return
        self.num_prompt_tokens += num_prompt_tokens
        req_stats.first_token_latency = self.iteration_timestamp - req_stats.arrival_time
        self.time_to_first_tokens_iter.append(req_stats.first_token_latency)
        req_stats.first_token_ts = req_stats.last_token_ts = engine_core_timestamp

    def update_from_finished_request(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        max_tokens_param: int | None,
        req_stats: RequestStateStats,
    ) -> FinishedRequestStats:
        finished = FinishedRequestStats(
            finish_reason=finish_reason,
            e2e_latency=self.iteration_timestamp - req_stats.arrival_time,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=req_stats.num_generation_tokens,
            max_tokens_param=max_tokens_param,
            queued_time=req_stats.queued_time,
            prefill_time=req_stats.prefill_time,
            inference_time=req_stats.inference_time,
            decode_time=req_stats.decode_time,
            mean_time_per_output_token=(
                req_stats.decode_time / (req_stats.num_generation_tokens - 1)
                if req_stats.num_generation_tokens > 1
                else 0.0
            ),
            first_token_latency=req_stats.first_token_latency,
            num_preemptions=req_stats.num_preemptions,
        )
        self.finished_requests.append(finished)
        return finished
