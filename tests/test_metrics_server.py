"""The ``/metrics`` HTTP endpoint: slow, idle and surplus connections are closed, responses name no versions, and it
binds where ``--metrics-host`` says."""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time

import pytest

from splitserve.base import metrics
from splitserve.base.metrics_server import MetricsServer
from splitserve.entrypoints.cli import build_parser, server_options_from_args
from tests.metrics_helpers import sample, scrape


@pytest.fixture
def server():
    registry = metrics.make_registry()
    counter = metrics.LabelledMetrics(registry, "m").counter("test_total", "a test counter")
    counter.inc(3)
    server = MetricsServer(registry, 0, "127.0.0.1", timeout_s=0.5)
    yield server
    server.stop()


def response_headers(port: int, path: str = "/metrics") -> tuple[int, dict[str, str]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status, dict(response.getheaders())
    finally:
        connection.close()


def test_metrics_are_served_and_the_server_names_no_versions(server):
    assert sample(scrape(f"127.0.0.1:{server.port}"), "splitserve:test_total") == 3
    status, headers = response_headers(server.port)
    assert status == 200 and headers["Server"] == "splitserve"  # not "WSGIServer/0.2 CPython/3.11.7"
    # An error BaseHTTPRequestHandler answers itself (a malformed request line) says the same.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics extra HTTP/1.0\r\n\r\n")
        reply = sock.recv(65536).decode("latin-1")
    assert reply.startswith("HTTP/1.0 400 "), reply[:40]
    assert "\r\nServer: splitserve\r\n" in reply and "Python" not in reply


def test_an_idle_connection_is_closed_and_holds_no_thread(server):
    """A client that connects and sends nothing (or stops half-way through its request) is disconnected after the
    timeout; meanwhile scrapes are answered, and afterwards no thread is left for it."""
    before = threading.active_count()
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    partial = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    try:
        time.sleep(0.1)
        assert threading.active_count() == before + 2  # one thread per open connection
        assert sample(scrape(f"127.0.0.1:{server.port}"), "splitserve:test_total") == 3
        assert idle.recv(1) == b""  # the server closed it (within the sockets' 5 s timeout)
        assert partial.recv(1) == b""
    finally:
        idle.close()
        partial.close()
    assert wait_for_threads(before) == before


def wait_for_threads(count: int) -> int:
    """The number of threads once it is ``count`` (or after 5 s: a bound, not a measure)."""
    deadline = time.monotonic() + 5
    while threading.active_count() != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


def test_a_client_that_trickles_its_request_is_closed_too(server):
    """Slowloris: a byte of header every 0.1 s restarts any read timeout; the connection's time (0.5 s here) runs
    out all the same. Before, each byte bought the thread another 10 s, for as long as the client liked."""
    before = threading.active_count()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        num_sent, closed = 0, False
        while not closed and num_sent < 100:  # 10 s of trickling: twenty times the connection's time
            try:
                sock.sendall(b"X")
                num_sent += 1
                time.sleep(0.1)
                sock.setblocking(False)
                closed = sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:  # reset: the server closed it with bytes unread
                closed = True
            finally:
                sock.settimeout(5)
        assert closed, f"still open after {num_sent} bytes"
    assert wait_for_threads(before) == before


def test_connections_beyond_the_limit_are_closed_at_once():
    """With ``max_connections`` open (idle, within their time), one more is closed at once instead of getting a
    thread; once one closes, scrapes are answered again."""
    server = MetricsServer(metrics.make_registry(), 0, "127.0.0.1", timeout_s=60, max_connections=2)
    before = threading.active_count()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    try:
        assert wait_for_threads(before + 2) == before + 2  # one thread each, at most 2
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert extra.recv(1) == b""  # closed unanswered, though its held peers have 60 s left
        assert threading.active_count() == before + 2
        held.pop().close()
        assert wait_for_threads(before + 1) == before + 1
        assert "process_cpu_seconds_total" in scrape(f"127.0.0.1:{server.port}")
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_a_client_that_resets_its_connection_leaves_no_traceback(server, capfd):
    """socketserver printed "Exception occurred during processing of request" and a ConnectionResetError
    traceback to stderr for every client that reset its connection mid-request."""
    before = threading.active_count()
    for request in (b"GET /metrics HTTP/1.1\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        sock.sendall(request)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
    assert wait_for_threads(before) == before
    assert sample(scrape(f"127.0.0.1:{server.port}"), "splitserve:test_total") == 3
    assert capfd.readouterr().err == ""


def test_the_metrics_endpoint_binds_to_its_own_host():
    server = MetricsServer(metrics.make_registry(), 0, "127.0.0.2")
    try:
        assert "process_cpu_seconds_total" in scrape(f"127.0.0.2:{server.port}")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    finally:
        server.stop()


def test_metrics_host_defaults_to_host():
    def options(*args: str):
        return server_options_from_args(build_parser().parse_args(["core", *args]))

    assert options("--host", "10.0.0.5").metrics_bind_host == "10.0.0.5"
    assert options("--host", "0.0.0.0", "--metrics-host", "127.0.0.1").metrics_bind_host == "127.0.0.1"
    assert options().metrics_bind_host == "0.0.0.0"
