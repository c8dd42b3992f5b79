"""A request inside the core: its tokens, progress and status (vLLM ``vllm/v1/request.py``)."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from core_svc.sampling_params import SamplingParams
from core_svc.structured_output_request import StructuredOutputRequest
from splitserve.base.pooling_params import PoolingParams
from splitserve.base.wire_enums import EngineCoreEventType, FinishReason


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its structured-output grammar is compiling (vLLM's name)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class EngineCoreEvent:
    type: EngineCoreEventType
    timestamp: float  # time.monotonic() seconds


@dataclass(frozen=True)
class MultiModalTensor:
    """One processor output of a multimodal item (e.g. ``pixel_values`` ``[3, 336, 336]`` float32) as it crosses
    the wire (``TensorData``): row-major, little-endian bytes; the model runner makes the tensor."""

    dtype: str  # "float32", "float16", "bfloat16", "int64" or "int32"
    shape: tuple[int, ...]
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class MultiModalFeature:
    """A multimodal item of the prompt (vLLM ``MultiModalFeatureSpec``): where its placeholder tokens sit, its
    content hash (``identifier``, vLLM's ``mm_hash``: the encoder cache's key and, for the KV cache, the item's
    identity) and its processed inputs for the encoder (``data``, empty where only its identity matters)."""

    modality: str
    identifier: str  # content hash of the item
    offset: int  # index of its first placeholder token in the prompt
    length: int  # number of placeholder tokens
    data: Mapping[str, MultiModalTensor] = field(default_factory=dict, compare=False, hash=False)


@dataclass(eq=False)
class Request:
    """One sequence the core generates for, or pools (vLLM: exactly one of ``sampling_params`` and
    ``pooling_params`` is set). ``num_computed_tokens`` counts tokens whose KV is in the cache (or is being
    computed this step); ``num_tokens`` counts prompt plus output tokens."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    arrival_time: float = field(default_factory=time.time)  # seconds since the epoch
    priority: int = 0  # lower is served first under the priority policy
    client_index: int = 0
    lora_name: str | None = None
    lora_int_id: int = 0  # its adapter's id in the core (set when added); 0: the base model
    lora_hash: str | None = None  # its adapter's content hash (set when added): the prefix cache's key
    cache_salt: str | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    trace_headers: dict[str, str] = field(default_factory=dict)
    pooling_params: PoolingParams | None = None  # a pooling request: prefill only, finished with its vector

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first scheduling; -1 = not yet
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    events: list[EngineCoreEvent] = field(default_factory=list)  # drained into each output
    structured_output: StructuredOutputRequest | None = None  # set by StructuredOutputManager.grammar_init

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.record_event(EngineCoreEventType.QUEUED)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need every prompt position computed (vLLM does the same); so do MEAN and CLS pooling.
        # LAST pooling needs only the last prompt token's hidden state, and a prefix-cache hit never covers the
        # last token (``get_computed_blocks`` caps it one short), so LAST reads the cache. (The engine core has
        # resolved pooling_type by the time the scheduler asks.) A pooling request's blocks are cached either way.
        if self.pooling_params is not None:
            return self.pooling_params.pooling_type != "LAST"
        return self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None

    @property
    def generation_params(self) -> SamplingParams:
        """The sampling parameters of a generation request.

        Raises:
            RuntimeError: on a pooling request (a bug: pooling requests never sample)."""
        if self.sampling_params is None:
            raise RuntimeError(f"request {self.request_id} is a pooling request: it has no sampling parameters")
        return self.sampling_params

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.monotonic()))

    def take_events(self) -> list[EngineCoreEvent]:
        events, self.events = self.events, []
        return events
