"""The ``/metrics`` HTTP endpoint both services serve: prometheus_client's WSGI app on a threading wsgiref server,
as ``prometheus_client.start_http_server`` runs it, with three changes. Each connection has ``timeout_s`` in all
for its request and its response, however slowly it sends (a client that trickles a byte at a time, slowloris,
is closed then too, not only one that sends nothing), and at most ``max_connections`` are open at once (one more
is closed at once), so no client can pile up threads; a client that resets its connection is dropped without a
traceback; and responses say ``Server: splitserve`` rather than wsgiref's ``WSGIServer/0.2 CPython/3.x.y``."""

from __future__ import annotations

import io
import logging
import socket
import threading
import time
from typing import Any, ClassVar
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

logger = logging.getLogger(__name__)
SERVER_NAME = "splitserve"
# Long enough for any scraper (Prometheus sends its request at once and reads a response of kilobytes), short
# enough that slow or idle connections cannot hold threads for long.
DEFAULT_TIMEOUT_S = 10.0
# Prometheus needs one connection per scrape; the rest is room for people and other scrapers.
DEFAULT_MAX_CONNECTIONS = 32


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes until ``deadline`` (``time.monotonic()``): each read waits at most until then, so a read
    timeout that each byte would restart cannot be stretched. Raises TimeoutError past it."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(remaining_s(self._deadline))
        return self._sock.recv_into(buffer)


def remaining_s(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.monotonic()``).

    Raises:
        TimeoutError: none are.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the connection's time is up")
    return remaining


class _ResponseHandler(ServerHandler):
    server_software = SERVER_NAME  # the Server header of every response; wsgiref's names its and Python's version
    request_handler: WSGIRequestHandler  # wsgiref's back-pointer, for logging (set by its own handle as here)


class _RequestHandler(WSGIRequestHandler):
    """One HTTP request per connection, as wsgiref's handler, within ``timeout`` seconds (set per server) from
    the connection's start to the end of its response, and no request log."""

    server_version = SERVER_NAME
    timeout: ClassVar[float] = DEFAULT_TIMEOUT_S  # set per server

    def setup(self) -> None:
        super().setup()
        self.deadline = time.monotonic() + self.timeout
        self.rfile = io.BufferedReader(_DeadlineReader(self.connection, self.deadline))

    def version_string(self) -> str:  # the Server header of the errors BaseHTTPRequestHandler sends itself
        return SERVER_NAME

    def handle(self) -> None:
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                self.requestline = self.request_version = self.command = ""
                self.send_error(414)
                return
            if not self.parse_request():  # it has sent the error
                return
            self.connection.settimeout(remaining_s(self.deadline))  # what is left bounds each write of the response
            handler = _ResponseHandler(
                self.rfile,
                self.wfile,  # type: ignore[arg-type]  # typeshed's BufferedIOBase; wsgiref's own handle passes it too
                self.get_stderr(),
                self.get_environ(),
                multithread=False,
            )
            handler.request_handler = self
            handler.run(self.server.get_app())  # type: ignore[attr-defined]  # a _Server's (typeshed: any BaseServer)
        except OSError:  # its time is up (TimeoutError), or the client reset the connection: drop it
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


class _Server(ThreadingWSGIServer):
    """wsgiref's threading server, with a thread per connection for at most ``max_connections`` at once."""

    max_connections = DEFAULT_MAX_CONNECTIONS  # set per server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: close it now rather than start one more thread
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """``/metrics`` of ``registry`` over HTTP on ``host:port``, served by a daemon thread (one more thread per open
    connection, at most ``max_connections``, each closed ``timeout_s`` after it opened).

    Raises:
        OSError: from the constructor, when the port cannot be bound.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "0.0.0.0",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("_Server", (_Server,), {"address_family": family, "max_connections": max_connections})
        handler_class = type("_Handler", (_RequestHandler,), {"timeout": timeout_s})
        self._server = server_class((sockaddr[0], port), handler_class)
        self._server.set_app(make_wsgi_app(registry))
        self._thread = threading.Thread(target=self._server.serve_forever, name="splitserve-metrics", daemon=True)
        self._thread.start()
        self.port: int = self._server.server_port
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
