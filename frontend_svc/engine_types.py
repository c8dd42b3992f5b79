"""The frontend's own view of the engine-core contract: plain dataclasses that ``frontend_svc.wire`` converts
to and from the protobuf messages of ``splitserve.engine.v1``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.errors import FrontendError
from frontend_svc.sampling_params import SamplingParams
from splitserve.base.pooling_params import PoolingParams
from splitserve.base.wire_enums import EngineCoreEventType, FinishReason


@dataclass(frozen=True)
class MultiModalFeature:
    """One processed multimodal item of a prompt (vLLM's ``MultiModalFeatureSpec``), as the core's
    ``core_svc.request.MultiModalFeature``; ``frontend_svc.wire`` sends ``data`` as ``TensorData``."""

    modality: str  # "image"
    identifier: str  # the item's content hash (vLLM's mm_hash); the core ignores it and hashes the item itself
    offset: int  # index of the item's first placeholder token in prompt_token_ids (vLLM's PlaceholderRange)
    length: int  # number of placeholder tokens
    # The processor's outputs for this item, numpy arrays: LLaVA "pixel_values" [3, H, W] float32; Qwen2-VL
    # "pixel_values" [num_patches, C * T * P * P] float32 and "image_grid_thw" [3] int64.
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter (vLLM's ``vllm.lora.request.LoRARequest``): its name (what the core knows it by, also a
    prefix-cache key), its int id (0: the core assigns one) and its PEFT folder on the core's file system."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass
class EngineCoreRequest:
    request_id: str  # internal id, unique per core
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None  # n = 1; max_tokens resolved; eos folded in. None: a pooling request
    arrival_time: float = field(default_factory=time.time)  # seconds since the epoch
    priority: int = 0
    cache_salt: str | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)
    client_index: int = 0
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # in prompt order, ranges disjoint
    lora_request: LoRARequest | None = None  # None: the base model
    pooling_params: PoolingParams | None = None  # a pooling request (exactly one of the two params is set)


@dataclass(frozen=True)
class EngineCoreEvent:
    type: EngineCoreEventType
    timestamp: float  # seconds, the core's time.monotonic()


@dataclass
class PositionLogprobs:
    token_ids: list[int]  # [1 + k]: the chosen token, then the top-k
    logprobs: list[float]  # [1 + k]
    rank: int  # 1-based vocabulary rank of token_ids[0]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[PositionLogprobs] | None = None  # set once, when prefill completes
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: FrontendError | None = None  # with finish_reason ERROR: the core's refusal or failure
    events: list[EngineCoreEvent] = field(default_factory=list)  # since the request's previous output
    pooling_output: list[float] | None = None  # a pooling request's vector, in its final output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """The core's state after a step (``EngineCoreOutputs.scheduler_stats``); counts are since the last stats."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks in use
    prefix_cache_queries: int = 0  # tokens looked up by requests admitted for the first time
    prefix_cache_hits: int = 0  # of those, tokens found
    prefix_cache_preempted_queries: int = 0  # tokens looked up by requests admitted again after a preemption
    prefix_cache_preempted_hits: int = 0  # of those, tokens found (not in the hit rate, as vLLM)
    num_preemptions: int = 0
    engine_id: str = ""  # which core sent them: its address (the gRPC client sets it); "" in-process


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_requests: set[str] = field(default_factory=set)
    timestamp: float = 0.0  # core's time.monotonic()
    scheduler_stats: SchedulerStats | None = None


@dataclass(frozen=True)
class EngineInfo:
    """What the frontend needs to know about a core (``GetEngineInfo``)."""

    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    kv_cache_tokens: int  # usable blocks x block_size: no request can hold more
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_logprobs: int
    dtype: str
    max_receive_message_bytes: int = 0  # the core server's largest request message (0: no limit told)
    image_limit_per_prompt: int | None = None  # the core's --limit-mm-per-prompt image=N (None: not told)
    supports_lora: bool = False  # the core takes LoRA adapters (--enable-lora)
    max_loras: int = 0  # LoRA adapters one core step can use (0: LoRA off)
    max_lora_rank: int = 0  # highest adapter rank the core takes (0: LoRA off)


@dataclass(frozen=True)
class ModelConfig:
    """The fields of vLLM's ``ModelConfig`` that scripts read (``llm.llm_engine.model_config.max_model_len``), from
    the core's ``EngineInfo``; vLLM's has many more. ``dtype`` names the compute dtype ("float32", "bfloat16",
    "float16")."""

    model: str
    served_model_name: str
    max_model_len: int
    dtype: str
    max_logprobs: int
    vocab_size: int

    @classmethod
    def from_engine_info(cls, info: EngineInfo) -> ModelConfig:
        return cls(info.model, info.model, info.max_model_len, info.dtype, info.max_logprobs, info.vocab_size)

    def get_vocab_size(self) -> int:
        return self.vocab_size
