"""The public API's key: a gRPC server interceptor that lets a call through only with ``authorization: Bearer
<key>`` metadata (vLLM's ``--api-key`` over HTTP), health excepted. Imports grpc only."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

HEALTH_SERVICE = "grpc.health.v1.Health"
UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send the metadata 'authorization: Bearer <key>'"


def check_api_key(api_key: str, source: str) -> str:
    """The key clients must send, from ``api_key`` as configured (``source``: the flag or variable it came from,
    for the message): without surrounding whitespace, which a metadata value cannot carry and a key read from a
    file (a Kubernetes Secret made ``--from-file``) often ends with.

    Raises:
        ValueError: the key is empty (a flag or variable set to nothing serves no key silently otherwise), or
            holds a character a gRPC metadata value cannot carry (only printable ASCII): no client could send it.
    """
    key = api_key.strip()
    if not key:
        raise ValueError(f"{source}: the API key must not be empty (leave it unset for no key)")
    if not (key.isascii() and key.isprintable()):
        raise ValueError(f"{source}: the API key must be printable ASCII, what gRPC metadata can carry")
    return key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call that does not carry ``authorization: Bearer <api_key>`` with UNAUTHENTICATED before its
    handler runs (its request is not even parsed), except calls to ``open_services``: health, which container
    and Kubernetes probes call without metadata and which tells nothing but SERVING or not. Reflection is not
    open: it only describes the published ``.proto`` files, but one rule with one exception is easier to check,
    and ``grpcurl -H 'authorization: Bearer ...'`` sends the key.

    The key is compared in constant time: both sides are hashed with SHA-256 first, so neither the time nor the
    length of the comparison depends on how much of the key a caller got right.

    Raises:
        ValueError: from the constructor, for a key no client could send (``check_api_key``).
    """

    def __init__(self, api_key: str, open_services: Sequence[str] = (HEALTH_SERVICE,)) -> None:
        self._digest = hashlib.sha256(check_api_key(api_key, "api_key").encode()).digest()
        self._open_services = frozenset(open_services)

    def is_authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether the call's metadata carries the key (the scheme ``Bearer`` in any case, as RFC 7235)."""
        for key, value in metadata or ():
            if key != "authorization":
                continue
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                hashlib.sha256(token.strip().encode()).digest(), self._digest
            ):
                return True
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        service = handler_call_details.method.lstrip("/").rpartition("/")[0]
        if service in self._open_services or self.is_authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusing(handler) if handler is not None else handler


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED. Its request
    deserializer is None: the unauthenticated request stays bytes, never parsed."""
    serializer = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_refuse, None, serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_refuse, None, serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_refuse, None, serializer)
    return grpc.stream_stream_rpc_method_handler(_refuse, None, serializer)
