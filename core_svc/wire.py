"""The core's one converter between protobuf wire messages and its own dataclasses.

Inbound: ``request_from_pb`` (EngineCoreRequest -> Request), ``lora_request_from_pb``. Outbound:
``outputs_to_pb`` (EngineCoreOutputs dataclass -> protobuf), ``request_error_to_pb`` (an error -> RequestError),
``lora_request_to_pb``. Nothing else in the core touches protobuf types.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from core_svc.engine_core import EngineInfo, EngineLoad
from core_svc.errors import RequestTooLargeError
from core_svc.lora.adapter import LoRARequest
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, SchedulerStats
from core_svc.request import FinishReason, MultiModalFeature, MultiModalTensor, Request
from core_svc.sampling_params import SamplingParams
from core_svc.sleep_mode import SleepResult
from splitserve.base.pooling_params import POOLING_TYPES, PoolingParams
from splitserve.base.proto_fields import set_optional_fields
from splitserve.base.sampling_rules import MIN_TEMPERATURE
from splitserve.base.status import FieldError, status_code_of
from splitserve.base.structured_outputs import StructuredOutputsParams
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb


def sampling_params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields take vLLM's defaults (the dataclass defaults); a positive temperature below
    ``MIN_TEMPERATURE`` is raised to it, as vLLM's SamplingParams raises it (a frontend has done so already)."""
    optional = set_optional_fields(msg)
    optional.pop("structured_outputs", None)
    if 0 < optional.get("temperature", 1.0) < MIN_TEMPERATURE:
        optional["temperature"] = MIN_TEMPERATURE
    return SamplingParams(
        min_tokens=msg.min_tokens,
        stop_token_ids=list(dict.fromkeys(msg.stop_token_ids)),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=dict(msg.logit_bias) or None,
        allowed_token_ids=list(dict.fromkeys(msg.allowed_token_ids)) or None,  # each step indexes with them
        bad_words_token_ids=[list(words.token_ids) for words in msg.bad_words_token_ids] or None,
        structured_outputs=(
            StructuredOutputsParams.from_message(msg.structured_outputs) if msg.HasField("structured_outputs") else None
        ),
        **optional,
    )


def pooling_params_from_pb(msg: pb.PoolingParams) -> PoolingParams:
    """Unset fields stay None (the core's pooler config fills them); an unknown pooling_type number is kept as
    text, for ``EngineCore`` to refuse naming the field."""
    number = int(msg.pooling_type)
    name = None if number == 0 else dict(enumerate(POOLING_TYPES, 1)).get(number, f"PoolingType({number})")
    return PoolingParams(
        pooling_type=name,  # type: ignore[arg-type]  # an unknown number's text: refused by EngineCore
        normalize=msg.normalize if msg.HasField("normalize") else None,
        dimensions=msg.dimensions if msg.HasField("dimensions") else None,
    )


def request_from_pb(msg: pb.EngineCoreRequest) -> Request:
    """The request as sent; never raises for a field's value (``EngineCore.add_request`` refuses it, naming the
    field, so that one bad request does not end the stream): sampling_params and pooling_params are taken as set,
    and a request with both or neither is refused there."""
    return Request(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=sampling_params_from_pb(msg.sampling_params) if msg.HasField("sampling_params") else None,
        pooling_params=pooling_params_from_pb(msg.pooling_params) if msg.HasField("pooling_params") else None,
        arrival_time=msg.arrival_time,
        priority=msg.priority,
        client_index=msg.client_index,
        lora_name=msg.lora_request.lora_name if msg.HasField("lora_request") else None,
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        mm_features=[_mm_feature_from_pb(f) for f in msg.mm_features],
        trace_headers=dict(msg.trace_headers),
    )


# What a length-delimited field adds to a message beyond its content: its tag (1 byte below field number 16) and
# its length (a varint of at most 5 bytes).
FIELD_OVERHEAD_BYTES = 6


def outputs_to_pb_messages(outputs: EngineCoreOutputs, max_bytes: int) -> tuple[list[pb.EngineCoreOutputs], list[str]]:
    """One step's outputs for one stream, as messages of at most ``max_bytes`` each (0: one message, unbounded).
    A larger message would fail the whole stream, every request on it, so the step is split between its outputs
    (the scheduler stats go with the first message, finished ids after the outputs). An output larger than
    ``max_bytes`` on its own (prompt logprobs of a long prompt) becomes an error that ends its request with
    RESOURCE_EXHAUSTED; the caller must abort those requests in the engine.

    Returns:
        The messages, in order, and the ids of the requests whose output was too large.
    """
    whole = outputs_to_pb(outputs)
    if not max_bytes or whole.ByteSize() <= max_bytes:
        return [whole], []
    first = pb.EngineCoreOutputs(engine_index=whole.engine_index, timestamp=whole.timestamp)
    if whole.HasField("scheduler_stats"):
        first.scheduler_stats.CopyFrom(whole.scheduler_stats)
    messages, sizes = [first], [first.ByteSize()]
    header_bytes = pb.EngineCoreOutputs(engine_index=whole.engine_index, timestamp=whole.timestamp).ByteSize()

    def place(size: int) -> pb.EngineCoreOutputs:
        """The message that takes ``size`` more bytes: the last one, or a new one when it is full."""
        if sizes[-1] + size > max_bytes:
            messages.append(pb.EngineCoreOutputs(engine_index=whole.engine_index, timestamp=whole.timestamp))
            sizes.append(header_bytes)
        sizes[-1] += size
        return messages[-1]

    too_large: list[str] = []
    for output in whole.outputs:
        size = output.ByteSize() + FIELD_OVERHEAD_BYTES
        if header_bytes + size > max_bytes:
            too_large.append(output.request_id)
            error = RequestTooLargeError(
                f"the output of this request in one step is {size} bytes, more than the {max_bytes} bytes the engine "
                "core sends in one message (its --max-send-message-mib); ask for fewer prompt_logprobs or logprobs"
            )
            output = _output_to_pb(
                EngineCoreOutput(output.request_id, [], finish_reason=FinishReason.ERROR, error=error)
            )
            size = output.ByteSize() + FIELD_OVERHEAD_BYTES
        place(size).outputs.append(output)
    for request_id in whole.finished_requests:
        place(len(request_id.encode()) + FIELD_OVERHEAD_BYTES).finished_requests.append(request_id)
    return messages, too_large


def outputs_to_pb(outputs: EngineCoreOutputs) -> pb.EngineCoreOutputs:
    msg = pb.EngineCoreOutputs(
        engine_index=outputs.engine_index,
        outputs=[_output_to_pb(o) for o in outputs.outputs],
        timestamp=outputs.timestamp,
        finished_requests=sorted(outputs.finished_requests),
    )
    if outputs.scheduler_stats is not None:
        msg.scheduler_stats.CopyFrom(_stats_to_pb(outputs.scheduler_stats))
    return msg


def _output_to_pb(output: EngineCoreOutput) -> pb.EngineCoreOutput:
    # protoc's .pyi types an enum field as the enum's class or name, not as the int it is on the wire.
    finish_reason = int(output.finish_reason) if output.finish_reason is not None else 0
    events = [pb.EngineCoreEvent(type=int(e.type), timestamp=e.timestamp) for e in output.events]  # type: ignore[arg-type]  # an int, as above
    msg = pb.EngineCoreOutput(
        request_id=output.request_id,
        new_token_ids=output.new_token_ids,
        new_logprobs=_logprobs_to_pb(output.new_logprobs),
        new_prompt_logprobs=_logprobs_to_pb(output.new_prompt_logprobs),
        finish_reason=finish_reason,  # type: ignore[arg-type]  # an int, as above
        events=events,
        num_cached_tokens=output.num_cached_tokens,
    )
    if output.pooling_output is not None:
        msg.pooling_output = output.pooling_output
    if isinstance(output.stop_reason, int):
        msg.stop_token_id = output.stop_reason
    elif isinstance(output.stop_reason, str):
        msg.stop_str = output.stop_reason
    if output.error is not None:
        msg.error.CopyFrom(request_error_to_pb(output.error))
    return msg


def request_error_to_pb(error: BaseException) -> pb.RequestError:
    """A refusal or failure as the wire carries it: its status code (``splitserve.base.status``), its message,
    and a ``FieldError``'s field as data."""
    return pb.RequestError(
        code=status_code_of(error), message=str(error), field=error.field if isinstance(error, FieldError) else ""
    )


def _logprobs_to_pb(logprobs: LogprobsLists | None) -> list[pb.PositionLogprobs]:
    if logprobs is None:
        return []
    return [
        pb.PositionLogprobs(token_ids=ids, logprobs=values, rank=rank)
        for ids, values, rank in zip(logprobs.logprob_token_ids, logprobs.logprobs, logprobs.ranks, strict=True)
    ]


def _stats_to_pb(stats: SchedulerStats) -> pb.SchedulerStats:
    prefix = stats.prefix_cache_stats
    return pb.SchedulerStats(
        num_running_reqs=stats.num_running_reqs,
        num_waiting_reqs=stats.num_waiting_reqs,
        kv_cache_usage=stats.kv_cache_usage,
        prefix_cache_stats=pb.PrefixCacheStats(
            requests=prefix.requests,
            queries=prefix.queries,
            hits=prefix.hits,
            reset=prefix.reset,
            preempted_requests=prefix.preempted_requests,
            preempted_queries=prefix.preempted_queries,
            preempted_hits=prefix.preempted_hits,
        ),
        num_preemptions=stats.num_preemptions,
    )


def engine_info_to_pb(info: EngineInfo, max_receive_message_bytes: int = 0) -> pb.EngineInfo:
    """``max_receive_message_bytes``: the serving process's gRPC receive limit (0: none told)."""
    return pb.EngineInfo(
        model=info.model,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        kv_cache_tokens=info.kv_cache_tokens,
        dtype=info.dtype,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        max_logprobs=info.max_logprobs,
        supports_lora=info.supports_lora,
        max_receive_message_bytes=max_receive_message_bytes,
        image_limit_per_prompt=info.image_limit_per_prompt,
        max_loras=info.max_loras,
        max_lora_rank=info.max_lora_rank,
    )


def lora_request_from_pb(msg: pb.LoRARequest) -> LoRARequest:
    return LoRARequest(lora_name=msg.lora_name, lora_int_id=msg.lora_int_id, lora_path=msg.lora_path)


def lora_request_to_pb(lora_request: LoRARequest) -> pb.LoRARequest:
    return pb.LoRARequest(
        lora_name=lora_request.lora_name, lora_int_id=lora_request.lora_int_id, lora_path=lora_request.lora_path
    )


def engine_load_to_pb(load: EngineLoad) -> pb.EngineLoad:
    return pb.EngineLoad(
        num_running_reqs=load.num_running_reqs,
        num_waiting_reqs=load.num_waiting_reqs,
        num_free_kv_blocks=load.num_free_kv_blocks,
        num_usable_kv_blocks=load.num_usable_kv_blocks,
        kv_cache_usage=load.kv_cache_usage,
    )


def sleep_result_to_pb(result: SleepResult) -> pb.SleepResponse:
    return pb.SleepResponse(
        num_aborted_requests=result.num_aborted_requests,
        kv_cache_bytes_freed=result.kv_cache_bytes_freed,
        weights_bytes_freed=result.weights_bytes_freed,
    )


def _mm_feature_from_pb(msg: pb.MultiModalFeatureSpec) -> MultiModalFeature:
    """The item with the core's own ``identifier`` (``mm_item_identifier``); the client's is ignored: the encoder
    and prefix caches are keyed by it, so one identifier for different data would mix up items and their KV."""
    data = {name: MultiModalTensor(t.dtype, tuple(t.shape), t.data) for name, t in msg.data.items()}
    return MultiModalFeature(msg.modality, mm_item_identifier(msg.modality, data), msg.offset, msg.length, data)


def mm_item_identifier(modality: str, data: Mapping[str, MultiModalTensor]) -> str:
    """Hex sha256 of an item's content: its modality, then each tensor by name (sorted) with its name, dtype,
    shape and bytes, every field length-prefixed so that no two items share an encoding."""
    hasher = hashlib.sha256()

    def update(field: bytes) -> None:
        hasher.update(len(field).to_bytes(8, "little"))
        hasher.update(field)

    update(modality.encode())
    for name in sorted(data):
        tensor = data[name]
        update(name.encode())
        update(tensor.dtype.encode())
        update(",".join(map(str, tensor.shape)).encode())
        update(tensor.data)
    return hasher.hexdigest()
