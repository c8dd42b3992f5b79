from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_KIND_UNSPECIFIED: _ClassVar[OutputKind]
    OUTPUT_KIND_CUMULATIVE: _ClassVar[OutputKind]
    OUTPUT_KIND_DELTA: _ClassVar[OutputKind]
    OUTPUT_KIND_FINAL_ONLY: _ClassVar[OutputKind]

class PoolingType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOLING_TYPE_UNSPECIFIED: _ClassVar[PoolingType]
    POOLING_TYPE_LAST: _ClassVar[PoolingType]
    POOLING_TYPE_MEAN: _ClassVar[PoolingType]
    POOLING_TYPE_CLS: _ClassVar[PoolingType]
OUTPUT_KIND_UNSPECIFIED: OutputKind
OUTPUT_KIND_CUMULATIVE: OutputKind
OUTPUT_KIND_DELTA: OutputKind
OUTPUT_KIND_FINAL_ONLY: OutputKind
POOLING_TYPE_UNSPECIFIED: PoolingType
POOLING_TYPE_LAST: PoolingType
POOLING_TYPE_MEAN: PoolingType
POOLING_TYPE_CLS: PoolingType

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_tokens_unlimited", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens", "spaces_between_special_tokens", "output_kind", "logit_bias", "allowed_token_ids", "detokenize", "structured_outputs", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_UNLIMITED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_KIND_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    max_tokens_unlimited: bool
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    output_kind: OutputKind
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    detokenize: bool
    structured_outputs: StructuredOutputsParams
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_tokens_unlimited: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., output_kind: _Optional[_Union[OutputKind, str]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., detokenize: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputsParams, _Mapping]] = ..., bad_words: _Optional[_Iterable[str]] = ...) -> None: ...

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

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "sampling_params", "priority", "cache_salt", "images", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    url: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., url: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling_params", "add_generation_prompt", "chat_template", "priority", "cache_salt", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling_params: SamplingParams
    add_generation_prompt: bool
    chat_template: str
    priority: int
    cache_salt: str
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ..., chat_template: _Optional[str] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "decoded_token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DECODED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    decoded_token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., decoded_token: _Optional[str] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class CompletionOutput(_message.Message):
    __slots__ = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_token_id", "stop_str")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cumulative_logprob: float
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: str
    stop_token_id: int
    stop_str: str
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cumulative_logprob: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "outputs", "finished", "num_cached_tokens", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    usage: Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., outputs: _Optional[_Iterable[_Union[CompletionOutput, _Mapping]]] = ..., finished: _Optional[bool] = ..., num_cached_tokens: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "eos_token_ids", "bos_token_id", "max_logprobs", "has_chat_template", "kv_cache_tokens", "default_sampling_params", "generation_config")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bos_token_id: int
    max_logprobs: int
    has_chat_template: bool
    kv_cache_tokens: int
    default_sampling_params: SamplingParams
    generation_config: str
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., bos_token_id: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., kv_cache_tokens: _Optional[int] = ..., default_sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., generation_config: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("lora_name", "lora_path", "lora_int_id")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LORA_INT_ID_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    lora_int_id: int
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ..., lora_int_id: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "pooling_type", "normalize", "dimensions", "truncate_prompt_tokens", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_TYPE_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    pooling_type: PoolingType
    normalize: bool
    dimensions: int
    truncate_prompt_tokens: int
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., pooling_type: _Optional[_Union[PoolingType, str]] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("index", "embedding", "prompt_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    embedding: _containers.RepeatedScalarFieldContainer[float]
    prompt_tokens: int
    def __init__(self, index: _Optional[int] = ..., embedding: _Optional[_Iterable[float]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("request_id", "embeddings", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...
