"""Error kinds as gRPC status codes, for both services, without importing grpc.

Each error class of a service says its code in a ``status_code`` class attribute (``frontend_svc/errors.py``,
``core_svc/errors.py``); ``status_code_of`` reads it, and ``splitserve.base.grpc_status`` turns it into a
gRPC status. A refusal of one field carries the field as data: ``FieldError`` (raised) or ``Violation`` (what a
shared rule returns, ``splitserve.base.sampling_rules``, ``splitserve.base.request_rules``); on the wire it is the
``field`` of ``EngineCoreOutput.error`` and, in a gRPC status, a ``google.rpc.BadRequest`` field violation.
"""

from __future__ import annotations

import enum
from typing import ClassVar, NamedTuple, Self


class StatusCode(enum.IntEnum):
    """The gRPC status codes splitserve's errors map to; values are ``grpc.StatusCode``'s numbers, the wire's
    ``RequestError.code`` (gRPC's ``doc/statuscodes.md``)."""

    INVALID_ARGUMENT = 3  # the request as sent is refused (validation)
    NOT_FOUND = 5  # a named resource (a LoRA adapter) does not exist
    ALREADY_EXISTS = 6  # a named resource already exists otherwise (a LoRA name loaded from another folder)
    RESOURCE_EXHAUSTED = 8  # the request can never fit (the KV cache, a message limit)
    FAILED_PRECONDITION = 9  # the call does not fit the server's state (a profile already running)
    UNIMPLEMENTED = 12  # the server does not offer the operation (admin RPCs off)
    INTERNAL = 13  # a fault of the server: never replayed on another core
    UNAVAILABLE = 14  # the server cannot serve now (shutting down, dead): another one may take the request


class Violation(NamedTuple):
    """A value a rule refuses: the field (``top_p``, ``prompt_token_ids[3]``) and what is wrong with it, without
    the field's name (``must be in (0, 1], got 0.0``)."""

    field: str
    description: str


class FieldError(ValueError):
    """A request refused for one field's value (INVALID_ARGUMENT). ``str()`` is ``"<field>: <description>"``,
    the status message clients read; ``field`` and ``description`` are the same as data (a
    ``google.rpc.BadRequest`` field violation). The frontend's ``ValidationError`` and the core's
    ``InvalidRequestError`` are its subclasses."""

    status_code: ClassVar[StatusCode] = StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, description: str) -> None:
        super().__init__(f"{field}: {description}")
        self.field = field
        self.description = description

    @classmethod
    def from_violation(cls, violation: Violation) -> Self:
        return cls(violation.field, violation.description)


def status_code_of(error: BaseException) -> StatusCode:
    """The status an error maps to: its class's ``status_code``; INTERNAL for an exception that has none (a fault
    of torch, a bug), as the server's fault, never the retryable UNAVAILABLE."""
    code = getattr(type(error), "status_code", None)
    return code if isinstance(code, StatusCode) else StatusCode.INTERNAL
