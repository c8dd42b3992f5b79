"""splitserve frontend: tokenization, chat templates, validation, n>1 fan-out, incremental detokenization,
stop strings and logprob text, and the Python API. Imports neither torch nor the core at import time.

    from frontend_svc import LLM, SamplingParams
"""

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import LoRARequest
from frontend_svc.errors import EngineDeadError, InternalError, RequestTooLargeError, ValidationError
from frontend_svc.llm import LLM
from frontend_svc.llm_engine import LLMEngine
from frontend_svc.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from splitserve.base.pooling_params import PoolingParams
from splitserve.base.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineCoreClient",
    "EngineDeadError",
    "InternalError",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "RequestTooLargeError",
    "SamplingParams",
    "StructuredOutputsParams",
    "ValidationError",
]
