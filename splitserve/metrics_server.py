"""The ``/metrics`` HTTP endpoint both services serve: prometheus_client's WSGI app on a threading wsgiref server,
as ``prometheus_client.start_http_server`` runs it, with two changes. A connection that sends nothing (or stops
sending half-way) is closed after ``idle_timeout_s`` instead of holding its thread forever, and responses say
``Server: splitserve`` rather than wsgiref's ``WSGIServer/0.2 CPython/3.x.y``."""

from __future__ import annotations

import logging
import socket
import threading
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

logger = logging.getLogger(__name__)
SERVER_NAME = "splitserve"
# Long enough for any scraper (Prometheus sends its request at once), short enough that idle connections cannot
# pile up threads.
DEFAULT_IDLE_TIMEOUT_S = 10.0


class _ResponseHandler(ServerHandler):
    server_software = SERVER_NAME  # the Server header of every response; wsgiref's names its and Python's version


class _RequestHandler(WSGIRequestHandler):
    """One HTTP request per connection, as wsgiref's handler, with a read timeout (``timeout``, set per server) and
    no request log."""

    server_version = SERVER_NAME

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
            handler = _ResponseHandler(self.rfile, self.wfile, self.get_stderr(), self.get_environ(), multithread=False)
            handler.request_handler = self  # type: ignore[attr-defined]  # wsgiref's back-pointer, for logging
            handler.run(self.server.get_app())  # type: ignore[attr-defined]
        except TimeoutError:  # idle for idle_timeout_s: drop the connection
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


class MetricsServer:
    """``/metrics`` of ``registry`` over HTTP on ``host:port``, served by a daemon thread (one more thread per open
    connection, each closed after ``idle_timeout_s`` without data).

    Raises:
        OSError: from the constructor, when the port cannot be bound.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        port: int,
        host: str = "0.0.0.0",
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
        handler_class = type("_Handler", (_RequestHandler,), {"timeout": idle_timeout_s})
        self._server: WSGIServer = make_server(
            sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=handler_class
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="splitserve-metrics", daemon=True)
        self._thread.start()
        self.port: int = self._server.server_port
        logger.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
