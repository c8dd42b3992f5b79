"""The one place where the core's errors become gRPC status codes."""

from __future__ import annotations

import grpc

from core_svc.errors import InvalidRequestError, LoRANotFoundError, ModelLoadError, RequestTooLargeError


def status_code(error: BaseException) -> grpc.StatusCode:
    """validation -> INVALID_ARGUMENT, unknown LoRA -> NOT_FOUND, can-never-fit -> RESOURCE_EXHAUSTED, engine
    not serving -> UNAVAILABLE, anything else -> INTERNAL."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, LoRANotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, RequestTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ModelLoadError | RuntimeError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def status_code_value(error: BaseException) -> int:
    """The numeric code, as carried in ``EngineCoreOutput.error.code``."""
    return status_code(error).value[0]
