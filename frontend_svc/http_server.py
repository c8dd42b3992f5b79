"""The frontend's HTTP listener: uvicorn serving the OpenAI-compatible API (``openai_api``) on the frontend's own
event loop, beside the grpc.aio server and over the same ``AsyncLLM``. The frontend's SIGTERM handling stops it
(uvicorn installs no signal handlers of its own here)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Generator
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend_svc.openai_api import make_app
from frontend_svc.openai_responses import error_body
from frontend_svc.service import FrontendServerState
from splitserve.base.api_key import ApiKeyInterceptor
from splitserve.base.tls import ServerTLS

logger = logging.getLogger(__name__)
# How long connections still open when the HTTP server stops (after the frontend's drain) get to finish.
GRACEFUL_SHUTDOWN_S = 2


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """None: the frontend's own SIGTERM / SIGINT handling drains and stops this server with the gRPC one."""
        yield


# Paths any caller may ask without the API key: probes, as gRPC health is open.
OPEN_PATHS = frozenset({"/health", "/version"})


class ApiKeyCheck:
    """ASGI wrapper that answers 401 (an OpenAI error body) to a request without ``Authorization: Bearer
    <api_key>``, before anything reads its body; every path but ``OPEN_PATHS`` needs it. The gRPC API's
    ``ApiKeyInterceptor`` rule, over HTTP."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key_check = ApiKeyInterceptor(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS:
            headers = [(name.decode("latin-1"), value) for name, value in scope.get("headers", [])]
            if not self.key_check.is_authorized(headers):
                message = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"
                body = error_body(message, "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(body, 401)({"type": "http"}, _no_receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI wrapper that refuses a request body larger than ``max_bytes`` with 413 (an OpenAI error body): by its
    Content-Length before it is read, else as it arrives (a chunked body is read here, then handed on whole).
    The gRPC API's receive limit, over HTTP."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its request was whole
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # from now on: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        message = f"the request body is larger than this server takes ({self.max_bytes} bytes)"
        response = JSONResponse(error_body(message, "invalid_request_error", None, "request_too_large"), 413)
        await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class HttpServer:
    """uvicorn on ``host:port`` (0: any free port) serving ``make_app(state)``, behind the API key check
    (``ApiKeyCheck``, with ``api_key``); bodies up to ``max_body_bytes``; HTTPS with ``tls`` (the gRPC server's
    ``--ssl-*`` files: client certificates required when it has a CA)."""

    def __init__(
        self,
        state: FrontendServerState,
        host: str,
        port: int,
        api_key: str | None,
        max_body_bytes: int,
        tls: ServerTLS | None = None,
    ) -> None:
        self.host = host
        self.port = port
        app: ASGIApp = BodyLimit(make_app(state), max_body_bytes)
        if api_key is not None:
            app = ApiKeyCheck(app, api_key)
        config = uvicorn.Config(
            app,
            log_config=None,  # the frontend's logging as it is
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ssl_keyfile=tls.keyfile if tls is not None else None,
            ssl_certfile=tls.certfile if tls is not None else None,
            ssl_ca_certs=tls.ca_certs if tls is not None else None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls is not None and tls.ca_certs else ssl.CERT_NONE,
        )
        if tls is not None:
            config.load()  # the SSL context, from the files (an unreadable one raises here, before anything serves)
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the port bound.

        Raises:
            OSError: the address cannot be bound.
        """
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
        return int(self.port)

    async def stop(self) -> None:
        """Stop listening, let open connections finish for up to ``GRACEFUL_SHUTDOWN_S``, then close them."""
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), GRACEFUL_SHUTDOWN_S + 3)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
        except Exception:
            logger.exception("the HTTP server failed while stopping")


def _bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on ``host:port``, bound here so that a port in use raises OSError (uvicorn exits
    the process instead)."""
    info: list[Any] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = info[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
