"""The frontend's one converter between its dataclasses and the ``splitserve.engine.v1`` protobuf messages."""

from __future__ import annotations

from frontend_svc.engine_types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    PositionLogprobs,
)
from splitserve.engine.v1 import engine_core_pb2 as pb


def request_to_pb(request: EngineCoreRequest) -> pb.EngineCoreRequest:
    params = request.sampling_params
    sampling = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=params.logit_bias or {},
        allowed_token_ids=params.allowed_token_ids or [],
    )
    for name in ("seed", "logprobs", "prompt_logprobs", "eos_token_id"):
        value = getattr(params, name)
        if value is not None:
            setattr(sampling, name, value)
    msg = pb.EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling,
        arrival_time=request.arrival_time,
        priority=request.priority,
        trace_headers=request.trace_headers,
        client_index=request.client_index,
    )
    if request.cache_salt is not None:
        msg.cache_salt = request.cache_salt
    return msg


def outputs_from_pb(msg: pb.EngineCoreOutputs) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        outputs=[_output_from_pb(o) for o in msg.outputs],
        finished_requests=set(msg.finished_requests),
        timestamp=msg.timestamp,
    )


def _output_from_pb(msg: pb.EngineCoreOutput) -> EngineCoreOutput:
    stop_kind = msg.WhichOneof("stop_reason")
    return EngineCoreOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=_logprobs_from_pb(msg.new_logprobs),
        new_prompt_logprobs=_logprobs_from_pb(msg.new_prompt_logprobs) if msg.new_prompt_logprobs else None,
        finish_reason=FinishReason(msg.finish_reason) if msg.finish_reason else None,
        stop_reason=getattr(msg, stop_kind) if stop_kind else None,
        num_cached_tokens=msg.num_cached_tokens,
        error=(msg.error.code, msg.error.message) if msg.HasField("error") else None,
    )


def _logprobs_from_pb(positions: object) -> list[PositionLogprobs]:
    return [PositionLogprobs(list(p.token_ids), list(p.logprobs), p.rank) for p in positions]
