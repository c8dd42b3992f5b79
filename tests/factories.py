"""Factories for scheduler and KV-manager tests: requests, schedulers and fake model output."""

from __future__ import annotations

import itertools

from core_svc.config import SchedulerConfig
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.outputs import ModelRunnerOutput, SchedulerOutput
from core_svc.request import Request
from core_svc.sampling_params import SamplingParams
from core_svc.scheduler import Scheduler

_arrival = itertools.count()
_prompt_base = itertools.count(1)
EOS_TOKEN_ID = 2


def make_request(
    request_id: str,
    num_tokens: int = 10,
    prompt_token_ids: list[int] | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    **params: object,
) -> Request:
    """A request whose prompt shares no block with any other factory-made prompt, unless ``prompt_token_ids``
    is given."""
    if prompt_token_ids is None:
        base = 100_000 * next(_prompt_base)
        prompt_token_ids = [base + i for i in range(num_tokens)]
    sampling = SamplingParams(**{"eos_token_id": EOS_TOKEN_ID, **params})  # type: ignore[arg-type]  # fields as keywords
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling,
        arrival_time=float(next(_arrival)) if arrival_time is None else arrival_time,
        priority=priority,
    )


def make_scheduler(
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    num_blocks: int = 10000,
    block_size: int = 16,
    max_model_len: int = 8192,
    enable_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    enable_chunked_prefill: bool = True,
    max_loras: int = 0,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,  # type: ignore[arg-type]  # a str, as the command line gives it
        max_loras=max_loras,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, max_model_len, enable_caching))


def fake_model_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, tokens: dict[str, int] | None = None
) -> ModelRunnerOutput:
    """What the model runner would return: one token (default 100) for each request whose known tokens are
    all computed after this step, nothing for mid-prefill requests."""
    tokens = tokens or {}
    sampled = {}
    for request_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        done = request.num_computed_tokens >= request.num_tokens
        sampled[request_id] = [tokens.get(request_id, 100)] if done else []
    return ModelRunnerOutput(sampled_token_ids=sampled)


def run_step(scheduler: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, object]:
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, fake_model_output(scheduler, scheduler_output, tokens))
    return scheduler_output, outputs
