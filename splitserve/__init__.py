"""splitserve's packages besides the two services, in floors: ``splitserve.stubs`` (generated from ``protos/``)
and ``splitserve.base`` (what both services import) below ``frontend_svc`` and ``core_svc``, and
``splitserve.entrypoints`` (the command line, the stack, the demo, test checkpoints) above them.

The Python API is here too, as in vLLM (``from splitserve import LLM, SamplingParams``), but lazily: these names
are ``frontend_svc``'s, imported on first use, because both services import this package and importing it
must import neither ``frontend_svc`` nor torch. ``__version__`` is the installed package's version.
"""

from __future__ import annotations

import importlib
from typing import Any

# The names ``from splitserve import ...`` takes from ``frontend_svc`` (vLLM's top-level API names).
_API_NAMES = (
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
)

__all__ = ["__version__", *_API_NAMES]


def __getattr__(name: str) -> Any:
    """``frontend_svc``'s API names and ``__version__``, looked up on first use (PEP 562).

    Raises:
        AttributeError: any other name.
    """
    if name in _API_NAMES:
        value = getattr(importlib.import_module("frontend_svc"), name)
    elif name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("splitserve")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            value = "unknown"
    else:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API_NAMES, "__version__"])
