"""The one place where errors become gRPC statuses, for both servers (and the in-process core's refusals, which
carry the same codes): the code an error's class states (``splitserve.base.status``), its message, and for a
refused field a ``google.rpc.BadRequest`` field violation in the status details (gRPC's richer error model,
``grpc-status-details-bin``), which a client in any language reads as data (Python: grpcio-status's
``rpc_status.from_call``)."""

from __future__ import annotations

from typing import NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from splitserve.base.status import FieldError, StatusCode, Violation, status_code_of


def grpc_status_code(error: BaseException) -> grpc.StatusCode:
    """validation -> INVALID_ARGUMENT, can-never-fit -> RESOURCE_EXHAUSTED, unknown name -> NOT_FOUND, engine
    down -> UNAVAILABLE, ...: the ``status_code`` of the error's class; INTERNAL for any other exception."""
    return _GRPC_CODES[status_code_of(error)]


def bad_request_status(error: FieldError) -> grpc.Status:
    """INVALID_ARGUMENT with ``str(error)``, and a ``BadRequest`` with its field violation (field and
    description) in the status details."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.description)
    status = status_pb2.Status(code=int(error.status_code), message=str(error))
    status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    """End the call for ``error``: ``grpc_status_code(error)`` and ``str(error)``, with a ``FieldError``'s
    ``bad_request_status`` details (raises grpc's AbortError)."""
    if isinstance(error, FieldError):
        status = bad_request_status(error)
        await context.abort(status.code, status.details, status.trailing_metadata)
    else:
        await context.abort(grpc_status_code(error), str(error))


def field_violation(call: grpc.Call | grpc.aio.AioRpcError) -> Violation | None:
    """The first ``BadRequest`` field violation in a failed call's status details; None when it has none (or
    details that do not match its status)."""
    try:
        # from_call reads only code(), details() and trailing_metadata(), which an AioRpcError has as a Call does.
        status = rpc_status.from_call(call)  # type: ignore[arg-type]  # its stub names grpc.Call alone
    except ValueError:
        return None
    for detail in status.details if status is not None else ():
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request) and bad_request.field_violations:
            violation = bad_request.field_violations[0]
            return Violation(violation.field, violation.description)
    return None


_GRPC_CODES = {code: grpc.StatusCode[code.name] for code in StatusCode}
