"""Errors the frontend raises; the gRPC layer maps each class to one status code."""


class FrontendError(Exception):
    """Base class of every error the frontend raises on purpose. ``request_id`` names the request (the caller's
    id) when the error ended one already queued: the core refused, failed or lost it (``LLMEngine.step``)."""

    request_id: str | None = None


class ValidationError(FrontendError, ValueError):
    """A request or parameter the server refuses as sent. Maps to INVALID_ARGUMENT.

    ``field`` names the offending field (``sampling_params.top_p``, ``prompt``); the message names it too,
    with the allowed range.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestTooLargeError(FrontendError):
    """The request can never fit in the core's KV cache. Maps to RESOURCE_EXHAUSTED."""


class NotFoundError(FrontendError, LookupError):
    """A named resource (a LoRA adapter) does not exist. Maps to NOT_FOUND."""


class EngineDeadError(FrontendError, RuntimeError):
    """The engine core stopped or is unreachable. Maps to UNAVAILABLE."""


class NotSupportedError(FrontendError, NotImplementedError):
    """The engine core does not offer the operation: an admin RPC (``reset_prefix_cache``) of a core started
    without ``--enable-admin-rpcs``. Maps to UNIMPLEMENTED."""


class InternalError(FrontendError):
    """The engine core failed while running the request (a fault of the server, not of the request as sent;
    the core goes on serving others). Maps to INTERNAL, which routers do not replay on another core."""


# gRPC status code values the core puts in EngineCoreOutput.error (grpc.StatusCode, without importing grpc).
_INVALID_ARGUMENT, _NOT_FOUND, _RESOURCE_EXHAUSTED, _UNIMPLEMENTED, _INTERNAL, _UNAVAILABLE = 3, 5, 8, 12, 13, 14


def error_from_core(code: int, message: str) -> FrontendError:
    """The frontend error for a request or call the core refused or lost (``EngineCoreOutput.error``, a unary
    call's status)."""
    if code == _INVALID_ARGUMENT:
        # The core's messages start with the field ("prompt_token_ids[3]: ..."): keep it as the field.
        field, sep, rest = message.partition(": ")
        if sep and field and " " not in field:
            return ValidationError(field, rest)
        return ValidationError("request", message)
    if code == _NOT_FOUND:
        return NotFoundError(message)
    if code == _RESOURCE_EXHAUSTED:
        return RequestTooLargeError(message)
    if code == _UNIMPLEMENTED:
        return NotSupportedError(message)
    if code == _UNAVAILABLE:
        return EngineDeadError(message)
    if code == _INTERNAL:
        return InternalError(message)
    return FrontendError(message)
