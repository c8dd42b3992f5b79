"""Errors the frontend raises; each class says its gRPC status code (``status_code``, read by
``splitserve.base.grpc_status``)."""

from __future__ import annotations

from typing import ClassVar

from splitserve.base.status import FieldError, StatusCode


class FrontendError(Exception):
    """Base class of every error the frontend raises on purpose. ``request_id`` names the request (the caller's
    id) when the error ended one already queued: the core refused, failed or lost it (``LLMEngine.step``)."""

    status_code: ClassVar[StatusCode] = StatusCode.INTERNAL
    request_id: str | None = None


class ValidationError(FrontendError, FieldError):
    """A request or parameter the server refuses as sent: INVALID_ARGUMENT.

    ``field`` names the offending field (``top_p``, ``prompt``, ``stop_token_ids[2]``) and ``description`` what
    is wrong with it; the message is ``"<field>: <description>"``, with the allowed range.
    """

    status_code: ClassVar[StatusCode] = StatusCode.INVALID_ARGUMENT


class RequestTooLargeError(FrontendError):
    """The request can never fit in the core's KV cache: RESOURCE_EXHAUSTED."""

    status_code: ClassVar[StatusCode] = StatusCode.RESOURCE_EXHAUSTED


class NotFoundError(FrontendError, LookupError):
    """A named resource (a LoRA adapter) does not exist: NOT_FOUND."""

    status_code: ClassVar[StatusCode] = StatusCode.NOT_FOUND


class AlreadyExistsError(FrontendError):
    """A named resource already exists otherwise (a LoRA name loaded from another folder): ALREADY_EXISTS."""

    status_code: ClassVar[StatusCode] = StatusCode.ALREADY_EXISTS


class FailedPreconditionError(FrontendError):
    """The call does not fit the core's state or settings (LoRA calls on a core without ``--enable-lora``):
    FAILED_PRECONDITION."""

    status_code: ClassVar[StatusCode] = StatusCode.FAILED_PRECONDITION


class EngineDeadError(FrontendError, RuntimeError):
    """The engine core stopped or is unreachable: UNAVAILABLE."""

    status_code: ClassVar[StatusCode] = StatusCode.UNAVAILABLE


class NotSupportedError(FrontendError, NotImplementedError):
    """The engine core does not offer the operation: an admin RPC (``reset_prefix_cache``) of a core started
    without ``--enable-admin-rpcs``, a LoRA load or unload on a frontend started without
    ``--allow-runtime-lora-updating``: UNIMPLEMENTED."""

    status_code: ClassVar[StatusCode] = StatusCode.UNIMPLEMENTED


class InternalError(FrontendError):
    """The engine core failed while running the request (a fault of the server, not of the request as sent;
    the core goes on serving others): INTERNAL, which routers do not replay on another core."""


class RequestAbortedError(InternalError):
    """A pooling request aborted by another caller (``AsyncLLM.abort``) before its vector was computed: its
    ``encode`` consumer gets this, never an empty vector (INTERNAL, as ``InternalError``)."""


# The frontend's error for each code the core refuses or fails a request with (INVALID_ARGUMENT: ValidationError).
_FROM_CORE: dict[int, type[FrontendError]] = {
    cls.status_code: cls
    for cls in (
        NotFoundError,
        AlreadyExistsError,
        RequestTooLargeError,
        FailedPreconditionError,
        NotSupportedError,
        EngineDeadError,
        InternalError,
    )
}


def error_from_core(code: int, message: str, field: str = "") -> FrontendError:
    """The frontend error for a request or call the core refused or lost: its status ``code`` (a
    ``StatusCode`` value), ``message`` and, for INVALID_ARGUMENT, the offending ``field`` (the wire's
    ``RequestError``, a unary call's status and its ``google.rpc.BadRequest``). A message naming ``field`` starts
    with ``"<field>: "``; a refusal without a field is the whole ``request``'s. A code this frontend does not
    know gives a plain ``FrontendError`` (INTERNAL)."""
    if code == StatusCode.INVALID_ARGUMENT:
        if field:
            return ValidationError(field, message.removeprefix(f"{field}: "))
        return ValidationError("request", message)
    return _FROM_CORE.get(code, FrontendError)(message)
