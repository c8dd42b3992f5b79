"""The one place where the core's errors become gRPC status codes."""

from __future__ import annotations

import grpc

from core_svc.errors import (
    EngineUnavailableError,
    InvalidRequestError,
    LoRANotFoundError,
    ModelLoadError,
    ProfileStateError,
    RequestTooLargeError,
)
from splitserve.base.grpc_errors import UndecodableRequestError


def status_code(error: BaseException) -> grpc.StatusCode:
    """validation and a message that does not parse -> INVALID_ARGUMENT, unknown LoRA -> NOT_FOUND,
    can-never-fit -> RESOURCE_EXHAUSTED, profile already running or not running -> FAILED_PRECONDITION, engine
    not serving (``EngineUnavailableError``, ``ModelLoadError``) -> UNAVAILABLE, anything else -> INTERNAL: a
    failed step (``EngineStepError``) and any unexpected exception (torch raises ``RuntimeError``) are faults of
    the server, never answered with the retryable UNAVAILABLE."""
    if isinstance(error, InvalidRequestError | UndecodableRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, LoRANotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, RequestTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ProfileStateError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, EngineUnavailableError | ModelLoadError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def status_code_value(error: BaseException) -> int:
    """The numeric code, as carried in ``EngineCoreOutput.error.code``."""
    return status_code(error).value[0]
