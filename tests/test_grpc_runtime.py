"""What both servers share (``splitserve.grpc_runtime``, the calls counter, tracing's shutdown), on in-process
servers: idle keepalive, cancelled calls counted as CANCELLED, a bounded export at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
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


class _ErrorsServicer:
    """Handlers of grpc.health.v1.HealthCheckRequest messages that fail in the ways a handler can."""

    async def raise_(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> bytes:
        if request.service == "set code":
            context.set_code(grpc.StatusCode.NOT_FOUND)
        raise RuntimeError("a bug") if request.service != "no message" else ValueError()

    async def raise_streaming(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        yield b"first"
        raise RuntimeError("a bug")

    async def count(
        self, requests: AsyncIterator[health_pb2.HealthCheckRequest], context: object
    ) -> AsyncIterator[bytes]:
        yield str(len([r async for r in requests])).encode()

    def handler(self) -> grpc.GenericRpcHandler:
        parse = health_pb2.HealthCheckRequest.FromString
        return grpc.method_handlers_generic_handler(
            "test.Errors",
            {
                "Raise": grpc.unary_unary_rpc_method_handler(self.raise_, parse),
                "RaiseStreaming": grpc.unary_stream_rpc_method_handler(self.raise_streaming, parse),
                "Count": grpc.stream_stream_rpc_method_handler(self.count, parse),
            },
        )


def test_calls_that_fail_outside_the_handlers_error_mapping(caplog):
    """What every server answers, through ``grpc_errors.GrpcErrorsInterceptor`` (``make_server`` adds it): an
    exception a handler let through is UNKNOWN with its message and no Python class name (grpc sent "Unexpected
    <class 'RuntimeError'>: a bug"), or the code the handler set; its traceback is logged. A request stream with a
    message that does not parse is INVALID_ARGUMENT naming it, in every one of 50 calls made by an asyncio client
    that sends three messages at once (``finish_reading``; without it, about 1 in 8 got INTERNAL "Internal error
    from Core")."""
    valid = health_pb2.HealthCheckRequest(service="s").SerializeToString()

    async def scenario() -> list[tuple[grpc.StatusCode, str]]:
        server = grpc_runtime.make_server()
        server.add_generic_rpc_handlers([_ErrorsServicer().handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        answers = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for service in ("", "set code", "no message"):
                call = channel.unary_unary("/test.Errors/Raise")(
                    health_pb2.HealthCheckRequest(service=service).SerializeToString()
                )
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call
                answers.append((await call.code(), await call.details()))
            call = channel.unary_stream("/test.Errors/RaiseStreaming")(valid)
            with contextlib.suppress(grpc.aio.AioRpcError):
                assert await call.read() == b"first"
                await call.read()
            answers.append((await call.code(), await call.details()))
            count = channel.stream_stream("/test.Errors/Count")
            for _ in range(50):
                call = count(iter([b"\xff\xff\xff"] * 3))
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await call.read()
                answers.append((await call.code(), await call.details()))
            answers.append((grpc.StatusCode.OK, (await count(iter([valid, valid])).read()).decode()))
        await server.stop(None)
        return answers

    answers = asyncio.run(scenario())
    bad_stream = (
        grpc.StatusCode.INVALID_ARGUMENT,
        "message 1 of the request stream is not a valid grpc.health.v1.HealthCheckRequest: Wire format was corrupt",
    )
    assert answers == [
        (grpc.StatusCode.UNKNOWN, "unexpected error in the server: a bug"),
        (grpc.StatusCode.NOT_FOUND, "unexpected error in the server: a bug"),
        (grpc.StatusCode.UNKNOWN, "unexpected error in the server"),
        (grpc.StatusCode.UNKNOWN, "unexpected error in the server: a bug"),
        *[bad_stream] * 50,
        (grpc.StatusCode.OK, "2"),
    ]
    logged = [r for r in caplog.records if r.getMessage() == "unexpected error in /test.Errors/Raise"]
    assert len(logged) == 3 and "RuntimeError: a bug" in logged[0].exc_text


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
