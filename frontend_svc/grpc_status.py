"""The one place where the frontend's errors become gRPC status codes."""

from __future__ import annotations

import grpc

from frontend_svc.errors import (
    EngineDeadError,
    NotFoundError,
    NotSupportedError,
    RequestTooLargeError,
    ValidationError,
)


def status_code(error: BaseException) -> grpc.StatusCode:
    """validation -> INVALID_ARGUMENT, can-never-fit -> RESOURCE_EXHAUSTED, core unreachable -> UNAVAILABLE, an
    operation the core does not offer -> UNIMPLEMENTED, anything else (``InternalError``: the core failed running
    the request) -> INTERNAL."""
    if isinstance(error, ValidationError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, RequestTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, NotSupportedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL
