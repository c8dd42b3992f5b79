"""What both servers answer for a call that fails before or outside their own error mapping: a request message
that does not parse, and an exception no handler caught. Imports grpc and ``splitserve.base`` only.

grpc parses a request before the handler runs. A message that does not parse (a corrupt wire format, a string
field that is not UTF-8) used to end the call with UNKNOWN "Unexpected <class
'google.protobuf.message.DecodeError'>: ...", and so did any exception a handler let through.
``GrpcErrorsInterceptor`` (added to every server by ``grpc_runtime.make_server``, innermost) gives each method a
request parser that never raises, and ends such calls itself:

- a request that does not parse: INVALID_ARGUMENT, "the request is not a valid splitserve.frontend.v1.GenerateRequest:
  String field had bad UTF-8" (on a request stream, "message 3 of the request stream is not a valid ...");
- one of our errors that states its status code (a refusal: ``status.status_code_of``) that a handler let through:
  that code, as ``grpc_status.abort`` sends it (with a ``FieldError``'s field violation);
- any other exception a handler let through: UNKNOWN, "unexpected error in the server: <its message>", and the
  traceback in the log. Python class names stay in the log.

A handler of a request stream reads the stream as ``ParsedRequests``: a message that does not parse raises
``UndecodableRequestError`` where the handler reads it. A handler that lets it through gets INVALID_ARGUMENT; one
that catches it (the core's ``Connect``) answers with it itself, after ``finish_reading``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc

from splitserve.base import grpc_status
from splitserve.base.status import StatusCode, status_code_of

logger = logging.getLogger(__name__)

# How long a call ended for a bad message on its request stream still reads (and drops) what the client sends,
# waiting for its half-close; see ``finish_reading``.
FINISH_READING_S = 1.0


class UndecodableRequestError(ValueError):
    """A request message that does not parse as its type: INVALID_ARGUMENT. The message names the type and what
    is wrong."""

    status_code: ClassVar[StatusCode] = StatusCode.INVALID_ARGUMENT


@dataclass(frozen=True)
class _Undecodable:
    """What the tolerant parser returns for a message that does not parse."""

    type_name: str
    detail: str

    def error(self, what: str) -> UndecodableRequestError:
        return UndecodableRequestError(f"{what} is not a valid {self.type_name}: {self.detail}")


class ParsedRequests:
    """A call's request stream (grpc's request iterator, over the tolerant parser): each message parsed, or
    ``UndecodableRequestError`` for one that does not parse. The stream goes on after it, so that
    ``finish_reading`` can read the rest."""

    def __init__(self, messages: AsyncIterator[Any]) -> None:
        self._messages = aiter(messages)
        self._num_read = 0

    def __aiter__(self) -> ParsedRequests:
        return self

    async def __anext__(self) -> Any:
        message = await anext(self._messages)
        self._num_read += 1
        if isinstance(message, _Undecodable):
            raise message.error(f"message {self._num_read} of the request stream")
        return message


async def finish_reading(requests: AsyncIterator[Any], timeout_s: float = FINISH_READING_S) -> None:
    """Read and drop the rest of a request stream until the client half-closes or goes away, for at most
    ``timeout_s``. A call ended for a bad message ends after the client's last message where it can: grpc's
    asyncio client reports INTERNAL "Internal error from Core" instead of the status it was sent when the call
    ends while it is still writing (grpc/grpc#36066; about 1 call in 10 when a client sends three bad messages
    at once)."""

    async def drop_all() -> None:
        while True:
            try:
                await anext(requests)
            except UndecodableRequestError:
                continue
            except (StopAsyncIteration, Exception):  # the client half-closed, or the call ended
                return

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(drop_all(), timeout_s)


class GrpcErrorsInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request does not parse with INVALID_ARGUMENT, and one whose handler raised with UNKNOWN
    and no Python class names (see the module's docstring). Handlers run as before otherwise. Asyncio handlers
    only: a sync handler (none of ours) is left as it is."""

    def __init__(self) -> None:
        self._handlers: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # method -> both

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        known = self._handlers.get(method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = _guarded_handler(handler, method)
        self._handlers[method] = (handler, wrapped)
        return wrapped


def _guarded_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return handler
    parse = handler.request_deserializer and _tolerant_parser(handler.request_deserializer, method)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_guarded(handler.unary_unary, method, False), parse, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_guarded(handler.unary_stream, method, False), parse, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_guarded(handler.stream_unary, method, True), parse, serialize)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(_guarded(handler.stream_stream, method, True), parse, serialize)
    return handler  # no behavior to guard (grpc sets exactly one)


def _tolerant_parser(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    """``parse`` (a message class's ``FromString``), returning ``_Undecodable`` where it raises."""
    descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", None) or f"request of {method}"
    prefix = f"Error parsing message with type '{type_name}': "  # upb's wording; the type is named already

    def tolerant(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # DecodeError, or whatever else a parser raises on bad bytes
            return _Undecodable(type_name, str(e).removeprefix(prefix) or "it does not parse")

    return tolerant


def _guarded(behavior: Callable[..., Any], method: str, request_streaming: bool) -> Any:
    """``behavior`` with its request parsed (see ``_tolerant_parser``) and its uncaught exceptions answered; the
    same kind of callable (coroutine or async generator), as grpc and the other interceptors tell them apart."""

    async def refuse(context: grpc.aio.ServicerContext, requests: Any, error: Exception) -> None:
        """End the call for ``error`` (raises grpc's AbortError)."""
        if isinstance(error, UndecodableRequestError):
            if request_streaming:
                await finish_reading(requests)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if status_code_of(error) is not StatusCode.INTERNAL and not context.done():
            # One of our errors, with its own code (a refusal), that its handler let through: answered as the
            # handlers answer it (``grpc_status.abort``), not as a fault of the server.
            await grpc_status.abort(context, error)
        logger.error("unexpected error in %s", method, exc_info=error)
        if context.done():  # its status went out already
            raise error
        code = context.code()  # a code the handler set before it raised stays, as grpc keeps it
        if not isinstance(code, grpc.StatusCode) or code == grpc.StatusCode.OK:
            code = grpc.StatusCode.UNKNOWN
        details = f"unexpected error in the server: {error}" if str(error) else "unexpected error in the server"
        await context.abort(code, details)

    def arguments(request: Any) -> Any:
        if request_streaming:
            return ParsedRequests(request)
        if isinstance(request, _Undecodable):
            raise request.error("the request")
        return request

    if inspect.isasyncgenfunction(behavior):

        async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            responses = None
            try:
                responses = behavior(arguments(request), context)
                async for response in responses:
                    yield response
            except grpc.aio.BaseError:  # an abort, or grpc's own: grpc handles it
                raise
            except Exception as e:
                await refuse(context, request, e)
            finally:
                if responses is not None:
                    await responses.aclose()  # at once, not when the garbage collector finds it

        return guarded_stream

    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(arguments(request), context)
        except grpc.aio.BaseError:
            raise
        except Exception as e:
            await refuse(context, request, e)

    return guarded
