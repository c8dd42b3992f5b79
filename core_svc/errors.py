"""Errors the core raises at its boundary; each class says its gRPC status code (``status_code``, read by
``splitserve.base.grpc_status``)."""

from __future__ import annotations

from typing import ClassVar

from splitserve.base.status import FieldError, StatusCode


class EngineError(Exception):
    """Base class of every error the core raises on purpose."""

    status_code: ClassVar[StatusCode] = StatusCode.INTERNAL


class InvalidRequestError(EngineError, FieldError):
    """A request the core cannot accept as sent (bad field value): INVALID_ARGUMENT.

    ``field`` names the offending field and ``description`` what is wrong; the message is
    ``"<field>: <description>"``, e.g. ``prompt_token_ids[3]: token id 40001 is out of vocabulary
    [0, 32000)``.
    """

    status_code: ClassVar[StatusCode] = StatusCode.INVALID_ARGUMENT


class LoRANotFoundError(EngineError):
    """A request names a LoRA adapter the core has not loaded: NOT_FOUND."""

    status_code: ClassVar[StatusCode] = StatusCode.NOT_FOUND


class LoRAExistsError(EngineError):
    """``AddLora`` of a name already loaded from another folder (remove it first to load other weights under
    it): ALREADY_EXISTS. The same name and folder again is no error: the adapter as loaded comes back."""

    status_code: ClassVar[StatusCode] = StatusCode.ALREADY_EXISTS


class LoRADisabledError(EngineError):
    """A LoRA call (``AddLora``, ``RemoveLora``, ``ListLoras``) on a core started without ``--enable-lora``:
    FAILED_PRECONDITION (this core's settings, not the call, would have to change)."""

    status_code: ClassVar[StatusCode] = StatusCode.FAILED_PRECONDITION


class RequestTooLargeError(EngineError):
    """A request that can never fit in the KV cache, however empty: RESOURCE_EXHAUSTED."""

    status_code: ClassVar[StatusCode] = StatusCode.RESOURCE_EXHAUSTED


class ModelLoadError(EngineError):
    """The checkpoint is missing, corrupt, or uses an architecture or option the core does not support:
    UNAVAILABLE (the core cannot serve)."""

    status_code: ClassVar[StatusCode] = StatusCode.UNAVAILABLE


class ProfileStateError(EngineError):
    """``StartProfile`` while a profile runs, or ``StopProfile`` with none running: FAILED_PRECONDITION."""

    status_code: ClassVar[StatusCode] = StatusCode.FAILED_PRECONDITION


class SleepCancelledError(EngineError):
    """A ``sleep(drain=True)`` still waiting for the core's requests when a ``wake_up`` came: the core stays awake.
    FAILED_PRECONDITION."""

    status_code: ClassVar[StatusCode] = StatusCode.FAILED_PRECONDITION


class EngineStepError(EngineError):
    """The model runner raised while running a step (forward or sampling). Every request of that step ends with
    it, and the core goes on serving the others. INTERNAL: a fault of the server, which a router must not replay
    on another core as if the request had never run (it could take that core down too)."""


class EngineUnavailableError(EngineError):
    """The core cannot take or finish requests: it is shutting down, has stopped, or was declared dead after
    ``CoreConfig.max_consecutive_failed_steps`` failed steps in a row. UNAVAILABLE: a request refused or ended
    with it may go to another core."""

    status_code: ClassVar[StatusCode] = StatusCode.UNAVAILABLE


def fault_message(error: BaseException) -> str:
    """What a status says of an exception the core did not raise on purpose (a fault of torch, a bug): its
    message, never its Python class, which the log has, with the traceback."""
    return str(error) or "an error without a message; the core's log has its traceback"


class DeviceUnavailableError(EngineError):
    """``--device cuda`` where torch cannot use a GPU: a CPU build of torch, or no GPU visible to the process.
    Raised at startup, before the model is read; UNAVAILABLE (this core cannot serve)."""

    status_code: ClassVar[StatusCode] = StatusCode.UNAVAILABLE


class StepOutOfMemoryError(EngineError):
    """The device ran out of memory running a step (``torch.OutOfMemoryError``). Every request of that step ends
    with it and the core goes on with the others: RESOURCE_EXHAUSTED, a limit of this core's settings, which the
    message names (fewer tokens or sequences per step, or a smaller memory share)."""

    status_code: ClassVar[StatusCode] = StatusCode.RESOURCE_EXHAUSTED
