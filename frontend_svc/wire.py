"""The frontend's one converter module: its dataclasses to and from the core contract
(``splitserve.engine.v1``), and the public API messages (``splitserve.frontend.v1``) to and from prompts,
``SamplingParams`` and ``RequestOutput``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from frontend_svc.engine_types import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    LoRARequest,
    MultiModalFeature,
    PositionLogprobs,
    SchedulerStats,
)
from frontend_svc.errors import FrontendError, InternalError, ValidationError, error_from_core
from frontend_svc.input_processor import ChatMessage, PromptType, TextPrompt, TokensPrompt
from frontend_svc.mm_processor import IMAGE, EncodedImage, image_from_url
from frontend_svc.outputs import CompletionOutput, Logprob, PoolingRequestOutput, RequestOutput
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams, sampling_params_with_defaults
from splitserve.base.pooling_params import POOLING_TYPES, PoolingParams
from splitserve.base.proto_fields import set_optional_fields
from splitserve.base.structured_outputs import StructuredOutputsParams
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb
from splitserve.stubs.frontend.v1 import generation_pb2 as api

# "LAST" -> PoolingType's number on both wires (the engine core's and the public API's enums agree).
POOLING_TYPE_NUMBERS = {name: number for number, name in enumerate(POOLING_TYPES, 1)}


def request_to_pb(request: EngineCoreRequest) -> pb.EngineCoreRequest:
    """The wire message of a core request.

    Raises:
        ValidationError: a value the wire cannot carry ("Value out of range", a wrong type, text that is not
            UTF-8), naming its field. The frontend checks every field before (``SamplingParams``,
            ``check_options``), so this is the last guard: a conversion error must never reach a client as UNKNOWN,
            nor fail one n > 1 child after others were sent.
    """
    try:
        return _request_to_pb(request)
    except (ValueError, TypeError, OverflowError) as e:  # UnicodeEncodeError is a ValueError
        raise ValidationError(_unsendable_field(request), f"cannot be sent to the engine core: {e}") from None


def _request_to_pb(request: EngineCoreRequest) -> pb.EngineCoreRequest:
    msg = pb.EngineCoreRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        arrival_time=request.arrival_time,
        priority=request.priority,
        trace_headers=request.trace_headers,
        client_index=request.client_index,
    )
    if request.sampling_params is not None:
        msg.sampling_params.CopyFrom(sampling_params_to_pb(request.sampling_params))
    if request.pooling_params is not None:
        msg.pooling_params.CopyFrom(pooling_params_to_pb(request.pooling_params))
    if request.cache_salt is not None:
        msg.cache_salt = request.cache_salt
    if request.lora_request is not None:
        msg.lora_request.CopyFrom(lora_request_to_pb(request.lora_request))
    msg.mm_features.extend(mm_feature_to_pb(feature) for feature in request.mm_features)
    return msg


def pooling_params_to_pb(params: PoolingParams) -> pb.PoolingParams:
    """A pooling request's parameters on the core's wire (truncate_prompt_tokens is the frontend's: already
    applied to the prompt)."""
    msg = pb.PoolingParams(pooling_type=POOLING_TYPE_NUMBERS[params.pooling_type] if params.pooling_type else 0)  # type: ignore[arg-type]  # an enum's int
    if params.normalize is not None:
        msg.normalize = params.normalize
    if params.dimensions is not None:
        msg.dimensions = params.dimensions
    return msg


def sampling_params_to_pb(params: SamplingParams) -> pb.SamplingParams:
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
        bad_words_token_ids=[pb.TokenIds(token_ids=ids) for ids in params.bad_words_token_ids or []],
    )
    for name in ("seed", "logprobs", "prompt_logprobs", "eos_token_id"):
        value = getattr(params, name)
        if value is not None:
            setattr(sampling, name, value)
    if params.structured_outputs is not None:
        sampling.structured_outputs.CopyFrom(structured_outputs_to_pb(params.structured_outputs))
    return sampling


def lora_request_to_pb(lora_request: LoRARequest) -> pb.LoRARequest:
    return pb.LoRARequest(
        lora_name=lora_request.lora_name, lora_int_id=lora_request.lora_int_id, lora_path=lora_request.lora_path
    )


def lora_request_from_pb(msg: pb.LoRARequest) -> LoRARequest:
    return LoRARequest(lora_name=msg.lora_name, lora_int_id=msg.lora_int_id, lora_path=msg.lora_path)


def structured_outputs_to_pb(params: StructuredOutputsParams) -> pb.StructuredOutputsParams:
    """The constraint on the core's wire; a JSON schema as its JSON text (``spec``)."""
    msg = pb.StructuredOutputsParams(
        json_object=bool(params.json_object),
        choice=list(params.choice or []),
        disable_any_whitespace=params.disable_any_whitespace,
    )
    if params.json is not None:
        msg.json = params.spec
    if params.regex is not None:
        msg.regex = params.regex
    if params.grammar is not None:
        msg.grammar = params.grammar
    return msg


# numpy's name of each dtype TensorData carries ("bfloat16" has none in numpy: the processors never make it).
_TENSOR_DTYPES = {"float32", "float16", "int64", "int32"}


def mm_feature_to_pb(feature: MultiModalFeature) -> pb.MultiModalFeatureSpec:
    """A multimodal item on the wire: each array of ``feature.data`` as ``TensorData`` (row-major,
    little-endian bytes).

    Raises:
        ValueError: an array of a dtype TensorData does not carry (``request_to_pb`` names the field).
    """
    msg = pb.MultiModalFeatureSpec(
        modality=feature.modality, identifier=feature.identifier, offset=feature.offset, length=feature.length
    )
    for key, array in feature.data.items():
        dtype = np.dtype(array.dtype)
        if dtype.name not in _TENSOR_DTYPES:
            raise ValueError(f"{key} has dtype {dtype.name}, not one of {sorted(_TENSOR_DTYPES)}")
        little = np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))
        msg.data[key].CopyFrom(pb.TensorData(dtype=dtype.name, shape=list(little.shape), data=little.tobytes()))
    return msg


def _unsendable_field(request: EngineCoreRequest) -> str:
    """The first field of ``request`` that a protobuf message refuses (after ``_request_to_pb`` raised)."""
    params = request.sampling_params
    candidates: list[tuple[str, Any, dict[str, Any]]] = [
        (f.name, pb.SamplingParams, {f.name: getattr(params, f.name)})
        for f in pb.SamplingParams.DESCRIPTOR.fields
        if getattr(params, f.name, None) is not None and f.name != "structured_outputs"
    ]
    if request.pooling_params is not None:
        try:
            pooling_params_to_pb(request.pooling_params)
        except (ValueError, TypeError, OverflowError, KeyError):
            return "pooling_params"
    if params is not None and params.structured_outputs is not None:
        try:
            structured_outputs_to_pb(params.structured_outputs)
        except (ValueError, TypeError, OverflowError):
            return "structured_outputs"
    candidates += [
        (name, pb.EngineCoreRequest, {name: getattr(request, name)})
        for name in ("request_id", "prompt_token_ids", "arrival_time", "priority", "trace_headers", "client_index")
    ]
    if request.cache_salt is not None:
        candidates.append(("cache_salt", pb.EngineCoreRequest, {"cache_salt": request.cache_salt}))
    for i, feature in enumerate(request.mm_features):
        try:
            mm_feature_to_pb(feature)
        except (ValueError, TypeError, OverflowError):
            return f"mm_features[{i}]"
    if request.lora_request is not None:
        try:
            lora_request_to_pb(request.lora_request)
        except (ValueError, TypeError, OverflowError):
            return "lora_request"
    for name, message_class, kwargs in candidates:
        try:
            message_class(**kwargs)
        except (ValueError, TypeError, OverflowError):
            return name
    return "request"


# What a length-delimited field adds to a message beyond its content: its tag (1 byte below field number 16) and
# its length (a varint of at most 5 bytes).
FIELD_OVERHEAD_BYTES = 6


def abort_messages(request_ids: list[str], max_bytes: int) -> list[pb.EngineCoreClientMessage]:
    """Abort messages for ``request_ids``, each at most ``max_bytes`` on the wire (0: one message, unbounded): a
    larger one would end the stream to the core, and every request on it (the ids of n children, or of many
    requests a batch of stop strings ended, add up)."""
    batches: list[list[str]] = [[]]
    size = FIELD_OVERHEAD_BYTES  # the abort field of EngineCoreClientMessage
    for request_id in request_ids:
        id_bytes = len(request_id.encode()) + FIELD_OVERHEAD_BYTES
        if max_bytes and batches[-1] and size + id_bytes > max_bytes:
            batches.append([])
            size = FIELD_OVERHEAD_BYTES
        batches[-1].append(request_id)
        size += id_bytes
    return [pb.EngineCoreClientMessage(abort=pb.AbortRequests(request_ids=ids)) for ids in batches]


def outputs_from_pb(msg: pb.EngineCoreOutputs) -> EngineCoreOutputs:
    return EngineCoreOutputs(
        outputs=[_output_from_pb(o) for o in msg.outputs],
        finished_requests=set(msg.finished_requests),
        timestamp=msg.timestamp,
        scheduler_stats=_stats_from_pb(msg.scheduler_stats) if msg.HasField("scheduler_stats") else None,
    )


def _stats_from_pb(msg: pb.SchedulerStats) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=msg.num_running_reqs,
        num_waiting_reqs=msg.num_waiting_reqs,
        kv_cache_usage=msg.kv_cache_usage,
        prefix_cache_queries=msg.prefix_cache_stats.queries,
        prefix_cache_hits=msg.prefix_cache_stats.hits,
        prefix_cache_preempted_queries=msg.prefix_cache_stats.preempted_queries,
        prefix_cache_preempted_hits=msg.prefix_cache_stats.preempted_hits,
        num_preemptions=msg.num_preemptions,
    )


def _output_from_pb(msg: pb.EngineCoreOutput) -> EngineCoreOutput:
    """One request's output; a malformed pooling vector fails that request only (an InternalError naming what was
    wrong), never the stream that carried it."""
    stop_kind = msg.WhichOneof("stop_reason")
    error = error_from_pb(msg.error) if msg.HasField("error") else None
    finish_reason = _finish_reason(msg.finish_reason)
    pooling_output = None
    if msg.pooling_output:
        if len(msg.pooling_output) % 4:
            if error is None:
                error = InternalError(
                    f"the core sent a pooling output of {len(msg.pooling_output)} bytes for request "
                    f"{msg.request_id}, not a whole number of float32 values"
                )
            finish_reason = FinishReason.ERROR
        else:
            pooling_output = np.frombuffer(msg.pooling_output, dtype="<f4").tolist()
    return EngineCoreOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_logprobs=_logprobs_from_pb(msg.new_logprobs),
        new_prompt_logprobs=_logprobs_from_pb(msg.new_prompt_logprobs) if msg.new_prompt_logprobs else None,
        finish_reason=finish_reason,
        stop_reason=getattr(msg, stop_kind) if stop_kind else None,
        num_cached_tokens=msg.num_cached_tokens,
        error=error,
        events=[event for event in map(_event_from_pb, msg.events) if event is not None],
        pooling_output=pooling_output,
    )


def error_from_pb(msg: pb.RequestError) -> FrontendError:
    """The frontend's error for a refusal or failure the core sent (a request's output, an in-process refusal):
    by its code, with the field as data."""
    return error_from_core(msg.code, msg.message, msg.field)


def _event_from_pb(msg: pb.EngineCoreEvent) -> EngineCoreEvent | None:
    """None for an event type this frontend does not know (a newer core): skipped."""
    try:
        return EngineCoreEvent(EngineCoreEventType(msg.type), msg.timestamp)
    except ValueError:
        return None


def _finish_reason(value: int) -> FinishReason | None:
    """0: still running. A value this frontend does not know (a newer core) still ends the request, as ERROR."""
    if not value:
        return None
    try:
        return FinishReason(value)
    except ValueError:
        return FinishReason.ERROR


def _logprobs_from_pb(positions: Iterable[pb.PositionLogprobs]) -> list[PositionLogprobs]:
    return [PositionLogprobs(list(p.token_ids), list(p.logprobs), p.rank) for p in positions]


def engine_info_from_pb(msg: pb.EngineInfo) -> EngineInfo:
    return EngineInfo(
        model=msg.model,
        max_model_len=msg.max_model_len,
        block_size=msg.block_size,
        num_kv_blocks=msg.num_kv_blocks,
        kv_cache_tokens=msg.kv_cache_tokens,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        max_num_seqs=msg.max_num_seqs,
        max_num_batched_tokens=msg.max_num_batched_tokens,
        max_logprobs=msg.max_logprobs,
        dtype=msg.dtype,
        max_receive_message_bytes=msg.max_receive_message_bytes,
        image_limit_per_prompt=msg.image_limit_per_prompt if msg.HasField("image_limit_per_prompt") else None,
        supports_lora=msg.supports_lora,
        max_loras=msg.max_loras,
        max_lora_rank=msg.max_lora_rank,
    )


# --- the public API (splitserve.frontend.v1) ---

_OUTPUT_KINDS = {
    api.OUTPUT_KIND_UNSPECIFIED: RequestOutputKind.DELTA,  # streaming calls default to deltas
    api.OUTPUT_KIND_CUMULATIVE: RequestOutputKind.CUMULATIVE,
    api.OUTPUT_KIND_DELTA: RequestOutputKind.DELTA,
    api.OUTPUT_KIND_FINAL_ONLY: RequestOutputKind.FINAL_ONLY,
}


def decimal_float32(value: float) -> float:
    """The shortest decimal that a float32 field's value is the nearest float32 to: the value the client wrote
    (0.1 for the float32 0.10000000149011612), so checks at a bound (temperature 0.01, top_p 1) and messages see
    it. The float32 on the core's wire is unchanged."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def sampling_params_from_api(msg: api.SamplingParams, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """Unset fields take the model's defaults (``defaults``, from its generation config), then vLLM's; float32
    fields as the decimals the client wrote (``decimal_float32``). Raises ValidationError naming the field for any
    refused value."""
    kwargs = set_optional_fields(msg)
    for field in msg.DESCRIPTOR.fields:
        if field.type == field.TYPE_FLOAT and field.name in kwargs:
            kwargs[field.name] = decimal_float32(kwargs[field.name])
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = StructuredOutputsParams.from_message(msg.structured_outputs)
    if msg.max_tokens_unlimited:
        if msg.HasField("max_tokens"):
            raise ValidationError("max_tokens", "set max_tokens or max_tokens_unlimited, not both")
        kwargs["max_tokens"] = None
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kwargs["logit_bias"] = {token_id: decimal_float32(bias) for token_id, bias in msg.logit_bias.items()}
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.bad_words:
        kwargs["bad_words"] = list(msg.bad_words)
    if msg.output_kind not in _OUTPUT_KINDS:
        raise ValidationError("output_kind", f"unknown value {msg.output_kind}")
    kwargs["output_kind"] = _OUTPUT_KINDS[msg.output_kind]
    return sampling_params_with_defaults(kwargs, defaults or {})


def default_sampling_params_to_api(defaults: Mapping[str, Any]) -> api.SamplingParams:
    """The model's default sampling parameters (``GetModelInfo``): only the fields it sets are set."""
    return api.SamplingParams(**defaults)


def generate_request_from_api(msg: api.GenerateRequest) -> TokensPrompt | TextPrompt | str:
    """The prompt of a Generate call: text or token ids, exactly one of them, with its images (still encoded:
    the InputProcessor decodes them off the event loop) as vLLM's ``multi_modal_data``.

    Raises:
        ValidationError: both or neither of prompt and prompt_token_ids; an image URL that is not a data: URI.
    """
    if msg.prompt and msg.prompt_token_ids:
        raise ValidationError("prompt", "give prompt or prompt_token_ids, not both")
    prompt: TokensPrompt | TextPrompt
    if msg.prompt_token_ids:
        prompt = TokensPrompt(prompt_token_ids=list(msg.prompt_token_ids))
    elif not msg.prompt:
        raise ValidationError("prompt", "cannot be empty (set prompt or prompt_token_ids)")
    elif not msg.images:
        return msg.prompt
    else:
        prompt = TextPrompt(prompt=msg.prompt)
    if msg.images:
        prompt["multi_modal_data"] = {
            IMAGE: [image_from_api(image, f"images[{i}]") for i, image in enumerate(msg.images)]
        }
    return prompt


def lora_request_from_api(lora_name: str) -> LoRARequest | None:
    """A request's adapter (``GenerateRequest.lora_name``, ``ChatRequest.lora_name``): by name only, which every
    core resolves itself (an unknown one: NOT_FOUND from the core); "" is the base model (None)."""
    if not lora_name:
        return None
    return LoRARequest(lora_name=lora_name)


def lora_adapter_to_api(lora: LoRARequest) -> api.LoraAdapter:
    return api.LoraAdapter(lora_name=lora.lora_name, lora_path=lora.lora_path, lora_int_id=lora.lora_int_id)


def image_from_api(msg: api.Image, field: str) -> EncodedImage:
    """An ``Image`` message: its bytes, or its ``url`` (a data: URI, never fetched).

    Raises:
        ValidationError: naming ``field``: both or neither of data and url, a URL that is not a data: URI.
    """
    if msg.data and msg.url:
        raise ValidationError(field, "give data or url, not both")
    if msg.url:
        return image_from_url(msg.url, msg.mime_type, field)
    if not msg.data:
        raise ValidationError(field, "holds no image: set data (with mime_type) or url (a data: URI)")
    return EncodedImage(msg.data, msg.mime_type, field)


def chat_messages_from_api(messages: Any) -> list[ChatMessage]:
    """Chat messages as the InputProcessor takes them: text parts, and image parts as {"type": "image", "image":
    EncodedImage}.

    Raises:
        ValidationError: naming the part: an empty part, an image as ``image_from_api`` refuses it.
    """
    converted: list[ChatMessage] = []
    for i, message in enumerate(messages):
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            field = f"messages[{i}].content[{j}]"
            if kind == "text":
                parts.append({"type": "text", "text": part.text})
            elif kind == "image":
                parts.append({"type": "image", "image": image_from_api(part.image, f"{field}.image")})
            else:
                raise ValidationError(field, "is empty: set text or image")
        converted.append({"role": message.role, "content": parts})
    return converted


def request_output_to_api(output: RequestOutput, first: bool, completion_tokens: int) -> api.GenerateResponse:
    """One streamed message; the prompt's token ids only in the first."""
    msg = api.GenerateResponse(
        request_id=output.request_id,
        prompt_token_ids=output.prompt_token_ids if first else [],
        outputs=[_completion_to_api(c) for c in output.outputs],
        finished=output.finished,
        num_cached_tokens=output.num_cached_tokens,
        usage=api.Usage(prompt_tokens=len(output.prompt_token_ids), completion_tokens=completion_tokens),
    )
    if output.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(_position_to_api(p) for p in output.prompt_logprobs)
    return msg


def _completion_to_api(completion: CompletionOutput) -> api.CompletionOutput:
    msg = api.CompletionOutput(
        index=completion.index,
        text=completion.text,
        token_ids=completion.token_ids,
        logprobs=[_position_to_api(p) for p in completion.logprobs or []],
        finish_reason=completion.finish_reason or "",
    )
    if completion.cumulative_logprob is not None:
        msg.cumulative_logprob = completion.cumulative_logprob
    if isinstance(completion.stop_reason, int):
        msg.stop_token_id = completion.stop_reason
    elif isinstance(completion.stop_reason, str):
        msg.stop_str = completion.stop_reason
    return msg


def _position_to_api(position: dict[int, Logprob] | None) -> api.PositionLogprobs:
    if position is None:
        return api.PositionLogprobs()
    return api.PositionLogprobs(
        entries=[
            api.TokenLogprob(
                token_id=token_id, logprob=lp.logprob, rank=lp.rank or 0, decoded_token=lp.decoded_token or ""
            )
            for token_id, lp in position.items()
        ]
    )


def embed_inputs_from_api(msg: api.EmbedRequest) -> list[PromptType]:
    """The prompts of an Embed call: each input's text, or its token ids.

    Raises:
        ValidationError: an input with neither, naming ``inputs[i]``.
    """
    prompts: list[PromptType] = []
    for i, item in enumerate(msg.inputs):
        kind = item.WhichOneof("input")
        if kind == "text":
            prompts.append(item.text)
        elif kind == "tokens":
            prompts.append(TokensPrompt(prompt_token_ids=list(item.tokens.token_ids)))
        else:
            raise ValidationError(f"inputs[{i}]", "is empty (set text or tokens)")
    return prompts


def embed_pooling_params_from_api(msg: api.EmbedRequest) -> PoolingParams:
    """An Embed call's ``PoolingParams``; unset fields stay None (the core's pooler config fills them).

    Raises:
        ValidationError: an unknown pooling_type number.
    """
    number = int(msg.pooling_type)
    pooling_type = None
    if number:
        if not 1 <= number <= len(POOLING_TYPES):
            raise ValidationError("pooling_type", f"unknown PoolingType {number}")
        pooling_type = POOLING_TYPES[number - 1]
    return PoolingParams(
        pooling_type=pooling_type,
        normalize=msg.normalize if msg.HasField("normalize") else None,
        dimensions=msg.dimensions if msg.HasField("dimensions") else None,
        truncate_prompt_tokens=msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens") else None,
    )


def embed_response_to_api(request_id: str, outputs: list[PoolingRequestOutput]) -> api.EmbedResponse:
    """One embedding per input, in input order, with the prompt tokens counted."""
    embeddings = [
        api.Embedding(index=i, embedding=output.outputs.data, prompt_tokens=len(output.prompt_token_ids))
        for i, output in enumerate(outputs)
    ]
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return api.EmbedResponse(request_id=request_id, embeddings=embeddings, usage=api.Usage(prompt_tokens=prompt_tokens))
