from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
    POOLING_TYPE_CLS: _ClassVar[PoolingType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class EngineCoreEventType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_CORE_EVENT_TYPE_UNSPECIFIED: _ClassVar[EngineCoreEventType]
    ENGINE_CORE_EVENT_TYPE_QUEUED: _ClassVar[EngineCoreEventType]
    ENGINE_CORE_EVENT_TYPE_SCHEDULED: _ClassVar[EngineCoreEventType]
    ENGINE_CORE_EVENT_TYPE_PREEMPTED: _ClassVar[EngineCoreEventType]
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType
POOLING_TYPE_CLS: PoolingType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
ENGINE_CORE_EVENT_TYPE_UNSPECIFIED: EngineCoreEventType
ENGINE_CORE_EVENT_TYPE_QUEUED: EngineCoreEventType
ENGINE_CORE_EVENT_TYPE_SCHEDULED: EngineCoreEventType
ENGINE_CORE_EVENT_TYPE_PREEMPTED: EngineCoreEventType

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "block_size", "num_kv_blocks", "kv_cache_tokens", "dtype", "vocab_size", "eos_token_ids", "max_num_seqs", "max_num_batched_tokens", "max_logprobs", "supports_lora", "max_receive_message_bytes", "image_limit_per_prompt", "max_loras", "max_lora_rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LORA_FIELD_NUMBER: _ClassVar[int]
    MAX_RECEIVE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_LIMIT_PER_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_cache_tokens: int
    dtype: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int
    supports_lora: bool
    max_receive_message_bytes: int
    image_limit_per_prompt: int
    max_loras: int
    max_lora_rank: int
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_cache_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., supports_lora: _Optional[bool] = ..., max_receive_message_bytes: _Optional[int] = ..., image_limit_per_prompt: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "num_free_kv_blocks", "num_usable_kv_blocks", "kv_cache_usage")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USABLE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    num_free_kv_blocks: int
    num_usable_kv_blocks: int
    kv_cache_usage: float
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., num_usable_kv_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("success",)
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    success: bool
    def __init__(self, success: _Optional[bool] = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("output_dir",)
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    output_dir: str
    def __init__(self, output_dir: _Optional[str] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("trace_path",)
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    trace_path: str
    def __init__(self, trace_path: _Optional[str] = ...) -> None: ...

class AddLoraRequest(_message.Message):
    __slots__ = ("lora_request",)
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    lora_request: LoRARequest
    def __init__(self, lora_request: _Optional[_Union[LoRARequest, _Mapping]] = ...) -> None: ...

class AddLoraResponse(_message.Message):
    __slots__ = ("lora_request",)
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    lora_request: LoRARequest
    def __init__(self, lora_request: _Optional[_Union[LoRARequest, _Mapping]] = ...) -> None: ...

class RemoveLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class RemoveLoraResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLorasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLorasResponse(_message.Message):
    __slots__ = ("lora_requests",)
    LORA_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    lora_requests: _containers.RepeatedCompositeFieldContainer[LoRARequest]
    def __init__(self, lora_requests: _Optional[_Iterable[_Union[LoRARequest, _Mapping]]] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "drain")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    level: int
    drain: bool
    def __init__(self, level: _Optional[int] = ..., drain: _Optional[bool] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("num_aborted_requests", "kv_cache_bytes_freed", "weights_bytes_freed")
    NUM_ABORTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    num_aborted_requests: int
    kv_cache_bytes_freed: int
    weights_bytes_freed: int
    def __init__(self, num_aborted_requests: _Optional[int] = ..., kv_cache_bytes_freed: _Optional[int] = ..., weights_bytes_freed: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("is_sleeping",)
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    def __init__(self, is_sleeping: _Optional[bool] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "eos_token_id", "structured_outputs", "bad_words_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    eos_token_id: int
    structured_outputs: StructuredOutputsParams
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., eos_token_id: _Optional[int] = ..., structured_outputs: _Optional[_Union[StructuredOutputsParams, _Mapping]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutputsParams(_message.Message):
    __slots__ = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")
    JSON_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    json: str
    json_object: bool
    regex: str
    choice: _containers.RepeatedScalarFieldContainer[str]
    grammar: str
    disable_any_whitespace: bool
    def __init__(self, json: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Iterable[str]] = ..., grammar: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class MultiModalFeatureSpec(_message.Message):
    __slots__ = ("modality", "identifier", "offset", "length", "data")
    class DataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TensorData
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    IDENTIFIER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    modality: str
    identifier: str
    offset: int
    length: int
    data: _containers.MessageMap[str, TensorData]
    def __init__(self, modality: _Optional[str] = ..., identifier: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., data: _Optional[_Mapping[str, TensorData]] = ...) -> None: ...

class LoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_int_id", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_INT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_int_id: int
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_int_id: _Optional[int] = ..., lora_path: _Optional[str] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("pooling_type", "normalize", "dimensions")
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    pooling_type: PoolingType
    normalize: bool
    dimensions: int
    def __init__(self, pooling_type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ...) -> None: ...

class EngineCoreRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "mm_features", "sampling_params", "arrival_time", "lora_request", "cache_salt", "priority", "trace_headers", "client_index", "pooling_params")
    class TraceHeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_INDEX_FIELD_NUMBER: _ClassVar[int]
    POOLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mm_features: _containers.RepeatedCompositeFieldContainer[MultiModalFeatureSpec]
    sampling_params: SamplingParams
    arrival_time: float
    lora_request: LoRARequest
    cache_salt: str
    priority: int
    trace_headers: _containers.ScalarMap[str, str]
    client_index: int
    pooling_params: PoolingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mm_features: _Optional[_Iterable[_Union[MultiModalFeatureSpec, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., arrival_time: _Optional[float] = ..., lora_request: _Optional[_Union[LoRARequest, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., trace_headers: _Optional[_Mapping[str, str]] = ..., client_index: _Optional[int] = ..., pooling_params: _Optional[_Union[PoolingParams, _Mapping]] = ...) -> None: ...

class AbortRequests(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineCoreClientMessage(_message.Message):
    __slots__ = ("add", "abort")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    add: EngineCoreRequest
    abort: AbortRequests
    def __init__(self, add: _Optional[_Union[EngineCoreRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequests, _Mapping]] = ...) -> None: ...

class EngineCoreEvent(_message.Message):
    __slots__ = ("type", "timestamp")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    type: EngineCoreEventType
    timestamp: float
    def __init__(self, type: _Optional[_Union[EngineCoreEventType, str]] = ..., timestamp: _Optional[float] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message", "field")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    field: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class EngineCoreOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs", "finish_reason", "stop_token_id", "stop_str", "events", "num_cached_tokens", "error", "pooling_output")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POOLING_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    new_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: FinishReason
    stop_token_id: int
    stop_str: str
    events: _containers.RepeatedCompositeFieldContainer[EngineCoreEvent]
    num_cached_tokens: int
    error: RequestError
    pooling_output: bytes
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., new_prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ..., events: _Optional[_Iterable[_Union[EngineCoreEvent, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., pooling_output: _Optional[bytes] = ...) -> None: ...

class PrefixCacheStats(_message.Message):
    __slots__ = ("requests", "queries", "hits", "reset", "preempted_requests", "preempted_queries", "preempted_hits")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_HITS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    queries: int
    hits: int
    reset: bool
    preempted_requests: int
    preempted_queries: int
    preempted_hits: int
    def __init__(self, requests: _Optional[int] = ..., queries: _Optional[int] = ..., hits: _Optional[int] = ..., reset: _Optional[bool] = ..., preempted_requests: _Optional[int] = ..., preempted_queries: _Optional[int] = ..., preempted_hits: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "prefix_cache_stats", "num_preemptions")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_stats: PrefixCacheStats
    num_preemptions: int
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prefix_cache_stats: _Optional[_Union[PrefixCacheStats, _Mapping]] = ..., num_preemptions: _Optional[int] = ...) -> None: ...

class EngineCoreOutputs(_message.Message):
    __slots__ = ("engine_index", "outputs", "scheduler_stats", "timestamp", "finished_requests")
    ENGINE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_STATS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    engine_index: int
    outputs: _containers.RepeatedCompositeFieldContainer[EngineCoreOutput]
    scheduler_stats: SchedulerStats
    timestamp: float
    finished_requests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_index: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[EngineCoreOutput, _Mapping]]] = ..., scheduler_stats: _Optional[_Union[SchedulerStats, _Mapping]] = ..., timestamp: _Optional[float] = ..., finished_requests: _Optional[_Iterable[str]] = ...) -> None: ...
