"""What both servers share (``splitserve.grpc_runtime``, the calls counter, tracing's shutdown), on in-process
servers: idle keepalive, cancelled calls counted as CANCELLED, a bounded export at shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve import grpc_runtime, metrics

STREAM_METHOD = "/test.Stream/Count"


def test_an_idle_client_with_the_advertised_keepalive_is_not_sent_away():
    """A client pinging every 2 s with no call open (our own KEEPALIVE_OPTIONS) keeps its connection: before, the
    server counted those pings as abuse and sent GOAWAY "too_many_pings" after about 6 s, and the channel fell
    back to IDLE. The channel must stay READY through 8 idle seconds (four pings)."""
    ready = threading.Event()
    port_box: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        async def main() -> None:
            server = grpc_runtime.make_server()
            await grpc_runtime.add_health_and_reflection(server, [])
            port_box.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await server.stop(None)

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    states: list[grpc.ChannelConnectivity] = []
    channel = grpc.insecure_channel(f"127.0.0.1:{port_box[0]}", options=grpc_runtime.KEEPALIVE_OPTIONS)
    try:
        channel.subscribe(states.append, try_to_connect=True)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == 1
        time.sleep(8)
        assert states[-1] == grpc.ChannelConnectivity.READY, states
        assert grpc.ChannelConnectivity.IDLE not in states[states.index(grpc.ChannelConnectivity.READY) :], states
    finally:
        channel.close()
        stop.set()
        thread.join(10)


def _counting_stream_handler() -> grpc.GenericRpcHandler:
    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        i = 0
        while True:
            yield i.to_bytes(4, "big")
            i += 1
            await asyncio.sleep(0)

    handler = grpc.unary_stream_rpc_method_handler(count)
    return grpc.method_handlers_generic_handler("test.Stream", {"Count": handler})


def test_calls_cancelled_by_their_clients_are_counted_cancelled():
    """200 concurrent streams, each cancelled by its client after 3 responses, are 200 CANCELLED calls. A stream
    closed by grpc between two responses ends its handler with GeneratorExit, which was counted UNKNOWN."""

    async def scenario() -> dict[str, float]:
        registry = metrics.make_registry()
        server = grpc_runtime.make_server(interceptors=[metrics.GrpcMetricsInterceptor(registry)])
        server.add_generic_rpc_handlers([_counting_stream_handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()

        async def one(channel: grpc.aio.Channel) -> None:
            call = channel.unary_stream(STREAM_METHOD)(b"")
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    call.cancel()
                    break

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.gather(*(one(channel) for _ in range(200)))
        await asyncio.sleep(0.5)  # the handlers see the cancellations
        await server.stop(None)
        return {
            code: registry.get_sample_value(
                "splitserve:grpc_server_handled_total",
                {"grpc_service": "test.Stream", "grpc_method": "Count", "grpc_code": code},
            )
            or 0.0
            for code in ("CANCELLED", "UNKNOWN", "OK")
        }

    assert asyncio.run(scenario()) == {"CANCELLED": 200.0, "UNKNOWN": 0.0, "OK": 0.0}


@pytest.mark.parametrize(
    ("code", "cancelled", "error", "expected"),
    [
        (None, False, None, "OK"),
        (None, False, GeneratorExit(), "CANCELLED"),  # grpc closed the streaming handler between responses
        (None, False, asyncio.CancelledError(), "CANCELLED"),
        (None, True, None, "CANCELLED"),  # the client left right after the last response
        (None, False, ValueError("bug"), "UNKNOWN"),
        (grpc.StatusCode.INVALID_ARGUMENT, False, None, "INVALID_ARGUMENT"),
        (3, True, None, "INVALID_ARGUMENT"),  # grpc.aio gives the integer value after an abort
    ],
)
def test_call_code(code, cancelled, error, expected):
    context = SimpleNamespace(code=lambda: code, cancelled=lambda: cancelled)
    assert metrics._call_code(context, error).name == expected


def test_span_export_at_shutdown_is_bounded():
    """A collector that never answers holds the exit for at most the bound: the processor then shuts the
    exporter down, which ends its retries (before, the SDK waited them out, about 10 s after "stopped")."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    from splitserve.tracing import BoundedBatchSpanProcessor

    class UnreachableCollector(SpanExporter):
        def __init__(self) -> None:
            self.stopped = threading.Event()
            self.exported = 0

        def export(self, spans: object) -> SpanExportResult:
            self.stopped.wait(30)  # retrying until shut down
            return SpanExportResult.FAILURE

        def shutdown(self) -> None:
            self.stopped.set()

    exporter = UnreachableCollector()
    provider = TracerProvider()
    provider.add_span_processor(BoundedBatchSpanProcessor(exporter, shutdown_timeout_s=0.5))
    provider.get_tracer("test").start_span("pending").end()
    start = time.monotonic()
    provider.shutdown()
    assert time.monotonic() - start < 5
    assert exporter.stopped.is_set()


def test_stop_server_ends_health_watches_with_ok_instead_of_cancelling_them():
    """A Watch never ends by itself. grpc's servicer left it open until server.stop cancelled it at the end of
    the grace period (the client got UNAVAILABLE "Cancelling all calls", and grpc could log a CancelledError
    traceback for it); ``stop_server`` ends it with OK first, so the stop does not wait out a 5 s grace."""

    async def scenario() -> tuple[list[int], grpc.StatusCode, float]:
        server = grpc_runtime.make_server()
        health = await grpc_runtime.add_health_and_reflection(server, ["svc"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        statuses: list[int] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="svc"))
            statuses.append((await watch.read()).status)
            await grpc_runtime.set_serving(health, ["svc"], True)
            statuses.append((await watch.read()).status)
            began = time.monotonic()
            await grpc_runtime.stop_server(server, health, grace_s=5.0)
            seconds = time.monotonic() - began
            assert await watch.read() is grpc.aio.EOF
            return statuses, await watch.code(), seconds

    statuses, code, seconds = asyncio.run(scenario())
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses == [not_serving, serving] and code == grpc.StatusCode.OK and seconds < 2
