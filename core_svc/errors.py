"""Errors the core raises at its boundary. The gRPC service maps each class to one status code."""


class EngineError(Exception):
    """Base class of every error the core raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request the core cannot accept as sent (bad field value). Maps to INVALID_ARGUMENT.

    The message names the offending field, e.g. ``prompt_token_ids[3]: 40001 is outside the vocabulary
    [0, 32000)``.
    """


class LoRANotFoundError(EngineError):
    """A request names a LoRA adapter the core has not loaded. Maps to NOT_FOUND."""


class RequestTooLargeError(EngineError):
    """A request that can never fit in the KV cache, however empty. Maps to RESOURCE_EXHAUSTED."""


class ModelLoadError(EngineError):
    """The checkpoint is missing, corrupt, or uses an architecture or option the core does not support."""


class ProfileStateError(EngineError):
    """``StartProfile`` while a profile runs, or ``StopProfile`` with none running. Maps to FAILED_PRECONDITION."""


class EngineStepError(EngineError):
    """The model runner raised while running a step (forward or sampling). Every request of that step ends with
    it, and the core goes on serving the others. Maps to INTERNAL: a fault of the server, which a router must not
    replay on another core as if the request had never run (it could take that core down too)."""


class EngineUnavailableError(EngineError):
    """The core cannot take or finish requests: it is shutting down, has stopped, or was declared dead after
    ``CoreConfig.max_consecutive_failed_steps`` failed steps in a row. Maps to UNAVAILABLE: a request refused
    or ended with it may go to another core."""


def fault_message(error: BaseException) -> str:
    """What a status says of an exception the core did not raise on purpose (a fault of torch, a bug): its
    message, never its Python class, which the log has, with the traceback."""
    return str(error) or "an error without a message; the core's log has its traceback"
