"""The ``/metrics`` HTTP endpoint: idle connections are closed, responses name no versions, and it binds where
``--metrics-host`` says."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

from splitserve import metrics
from splitserve.cli import build_parser, server_options_from_args
from splitserve.metrics_server import MetricsServer
from tests.metrics_helpers import sample, scrape


@pytest.fixture
def server():
    registry = metrics.make_registry()
    counter = metrics.LabelledMetrics(registry, "m").counter("test_total", "a test counter")
    counter.inc(3)
    server = MetricsServer(registry, 0, "127.0.0.1", idle_timeout_s=0.5)
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
    idle timeout; meanwhile scrapes are answered, and afterwards no thread is left for it."""
    before = threading.active_count()
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    partial = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the headers never end
    try:
        time.sleep(0.1)
        assert threading.active_count() == before + 2  # one thread per open connection
        assert sample(scrape(f"127.0.0.1:{server.port}"), "splitserve:test_total") == 3
        start = time.monotonic()
        assert idle.recv(1) == b""  # the server closed it
        assert partial.recv(1) == b""
        assert time.monotonic() - start < 2.0
    finally:
        idle.close()
        partial.close()
    deadline = time.monotonic() + 2
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() == before


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
