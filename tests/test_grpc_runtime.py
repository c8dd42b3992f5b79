"""What both servers share (``splitserve.base.grpc_runtime``, the calls counter, tracing's shutdown), on in-process
servers: idle keepalive, cancelled calls counted as CANCELLED, a bounded export at shutdown."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.base import grpc_runtime, metrics
from splitserve.base.status import FieldError


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


CALLS_SERVICE = "test.Calls"
CALLS_RECEIVE_LIMIT = 2**20


class _CallsServicer:
    """Handlers that do what their request says, b"<call id> <mode> <k> <padding>"; ``started[call id]`` is set
    as the call reaches its handler (or ``_HoldingInterceptor``), so that a client ends only a call the server has
    taken."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Event] = {}

    def _start(self, request: bytes) -> tuple[str, int]:
        call_id, mode, k = request.decode().split()[:3]
        self.started.setdefault(call_id, asyncio.Event()).set()
        return mode, int(k)

    async def stream(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        mode, k = self._start(request)
        if mode == "wait":
            await asyncio.Event().wait()
        if mode == "abort_now":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        for _ in range(k if mode in ("abort", "finish", "raise") else 2**31):
            # 64 KiB each: a "flow" stream fills the connection's window, so that its handler mostly waits at a yield
            # for grpc to send, rather than anywhere inside itself, when its client cancels.
            yield bytes(2**16)
            await asyncio.sleep(0)
        if mode == "abort":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        if mode == "raise":
            raise RuntimeError("a bug")

    async def unary(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        mode, _ = self._start(request)
        if mode == "wait":
            await asyncio.Event().wait()
        return b"done"

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            CALLS_SERVICE,
            {
                "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
                "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            },
        )


class _HoldingInterceptor(grpc.aio.ServerInterceptor):
    """Holds a call that has ("hold", call id) in its metadata before its handler runs, until it is cancelled: as
    grpc holds a call whose request is still on its way, or an interceptor that checks something first."""

    def __init__(self, servicer: _CallsServicer) -> None:
        self.servicer = servicer

    async def intercept_service(self, continuation: Any, handler_call_details: grpc.HandlerCallDetails) -> Any:
        held = dict(handler_call_details.invocation_metadata or ()).get("hold")
        if held is not None:
            self.servicer.started.setdefault(held, asyncio.Event()).set()
            await asyncio.Event().wait()
        return await continuation(handler_call_details)


# Each way a call ends: (method, the handler's mode, how the client ends it, the code the server counts; None:
# CANCELLED or INVALID_ARGUMENT, as the race between the client's cancel and the handler's abort goes).
CALL_KINDS = {
    "stream cancelled before its first response": ("Stream", "wait", "cancel", "CANCELLED"),
    "stream cancelled between two responses": ("Stream", "flow", "cancel after k", "CANCELLED"),
    "stream cancelled as its handler aborts": ("Stream", "abort_now", "cancel", None),
    "stream aborted after k responses": ("Stream", "abort", "read", "INVALID_ARGUMENT"),
    "stream whose handler raises after k responses": ("Stream", "raise", "read", "UNKNOWN"),
    "stream finished": ("Stream", "finish", "read", "OK"),
    "stream open when the server stops": ("Stream", "wait", "server stop", "CANCELLED"),
    "unary cancelled while it runs": ("Unary", "wait", "cancel", "CANCELLED"),
    "unary cancelled before its handler runs": ("Unary", "ok", "cancel held", "CANCELLED"),
    "unary past its deadline": ("Unary", "wait", "deadline", "DEADLINE_EXCEEDED"),  # or CANCELLED: see below
    "unary over the receive limit": ("Unary", "ok", "too large", "RESOURCE_EXHAUSTED"),
    "unary finished": ("Unary", "ok", "read", "OK"),
}


def test_every_call_is_counted_once_with_its_code():
    """1,500 concurrent calls, each ended in one of the ways a call ends, at a random point: the handled counter
    sums to the number of calls, and each way has its code. The counter was kept by the handler's wrapper, so a
    call whose handler never ran (cancelled while grpc or an interceptor held it, or refused over the receive
    limit) was never counted, and a stream left suspended at a yield was counted only when the garbage collector
    closed its generator."""
    rng = random.Random(0)
    kinds = [rng.choice(list(CALL_KINDS)) for _ in range(1500)]

    async def scenario() -> tuple[dict[str, float], set[str]]:
        registry = metrics.make_registry()
        servicer = _CallsServicer()
        server = grpc_runtime.make_server(
            grpc_runtime.MessageLimits(receive_bytes=CALLS_RECEIVE_LIMIT),
            [metrics.GrpcMetricsInterceptor(registry), _HoldingInterceptor(servicer)],
        )
        server.add_generic_rpc_handlers([servicer.handler()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        open_at_stop: list[grpc.aio.Call] = []
        # grpc queues at most 1000 calls its server has not taken yet, and cancels the others: calls start 100 at
        # a time, each once the one before its turn has reached the server; all stay open together.
        starting = asyncio.Semaphore(100)

        async def one(channel: grpc.aio.Channel, call_id: int, kind: str) -> None:
            method, mode, end, _ = CALL_KINDS[kind]
            k = rng.randint(1, 5)
            started = servicer.started.setdefault(str(call_id), asyncio.Event())
            request = f"{call_id} {mode} {k} ".encode()
            if end == "too large":
                request += bytes(CALLS_RECEIVE_LIMIT)
            metadata = (("hold", str(call_id)),) if end == "cancel held" else None
            timeout = 3.0 if end == "deadline" else None
            path = f"/{CALLS_SERVICE}/{method}"
            async with starting:
                call = (channel.unary_stream if method == "Stream" else channel.unary_unary)(path)(
                    request, timeout=timeout, metadata=metadata
                )
                await asyncio.wait(
                    {asyncio.ensure_future(started.wait()), asyncio.ensure_future(call.code())},
                    return_when=asyncio.FIRST_COMPLETED,
                )
            if end in ("cancel", "cancel held"):
                call.cancel()
            elif end == "cancel after k":
                for _ in range(k):
                    await call.read()
                call.cancel()
            elif end == "server stop":
                open_at_stop.append(call)
                return
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                while method == "Stream" and await call.read() is not grpc.aio.EOF:
                    pass
                await call.code()

        options = [("grpc.max_send_message_length", 2 * CALLS_RECEIVE_LIMIT)]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(4)]
        await asyncio.gather(*(one(channels[i % 4], i, kind) for i, kind in enumerate(kinds)))
        await server.stop(None)  # the streams still open are cancelled
        for channel in channels:
            await channel.close()

        def handled() -> dict[str, float]:
            return {
                code.name: sum(
                    registry.get_sample_value(
                        "splitserve:grpc_server_handled_total",
                        {"grpc_service": CALLS_SERVICE, "grpc_method": method, "grpc_code": code.name},
                    )
                    or 0.0
                    for method in ("Stream", "Unary")
                )
                for code in grpc.StatusCode
            }

        for _ in range(200):  # the last calls' tasks end after their clients saw them end (a bound, not a measure)
            if sum(handled().values()) >= len(kinds):
                break
            await asyncio.sleep(0.05)
        too_large = {str(i) for i, kind in enumerate(kinds) if CALL_KINDS[kind][2] == "too large"}
        return handled(), {i for i, event in servicer.started.items() if not event.is_set()} - too_large

    handled, never_started = asyncio.run(scenario())
    assert not never_started  # every call reached the server, so it had all 1,500 to count
    expected = collections.Counter(CALL_KINDS[kind][3] for kind in kinds)
    assert sum(handled.values()) == len(kinds)
    for code in ("OK", "UNKNOWN", "RESOURCE_EXHAUSTED"):
        assert handled[code] == expected[code], code
    assert handled["CANCELLED"] >= expected["CANCELLED"]
    assert handled["INVALID_ARGUMENT"] >= expected["INVALID_ARGUMENT"]
    # A call past its deadline is DEADLINE_EXCEEDED when the server's deadline ends it, CANCELLED when the client's
    # cancel (its own deadline, a moment earlier) arrives first: the server cannot tell that from any other cancel.
    assert handled["DEADLINE_EXCEEDED"] <= expected["DEADLINE_EXCEEDED"]
    assert handled["CANCELLED"] + handled["INVALID_ARGUMENT"] + handled["DEADLINE_EXCEEDED"] == (
        expected["CANCELLED"] + expected["INVALID_ARGUMENT"] + expected["DEADLINE_EXCEEDED"] + expected[None]
    )


@pytest.mark.parametrize(
    ("code", "error", "returned", "cancelled", "expected"),
    [
        (None, None, True, False, "OK"),
        (None, GeneratorExit(), False, False, "CANCELLED"),  # closed between two responses
        (None, asyncio.CancelledError(), False, False, "CANCELLED"),
        (None, None, True, True, "CANCELLED"),  # returned, and grpc cancelled the call before its status went out
        (grpc.StatusCode.NOT_FOUND, None, False, True, "CANCELLED"),  # set a code, then the client left
        (None, ValueError("bug"), False, False, "UNKNOWN"),
        (None, None, False, False, "UNKNOWN"),  # grpc raised sending a response (the handler saw nothing)
        (grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.AbortError(), False, False, "INVALID_ARGUMENT"),
        (3, grpc.aio.AbortError(), False, False, "INVALID_ARGUMENT"),  # grpc.aio gives the integer after an abort
    ],
)
def test_call_code(code, error, returned, cancelled, expected):
    context = SimpleNamespace(code=lambda: code, time_remaining=lambda: None)  # no deadline
    assert metrics._call_code(context, error, returned, cancelled).name == expected


@pytest.mark.parametrize(("time_remaining", "expected"), [(0.0, "DEADLINE_EXCEEDED"), (2.5, "CANCELLED")])
def test_call_code_of_a_call_cancelled_with_a_deadline(time_remaining, expected):
    """A deadline passed (grpc's context says 0 s remain): its client got DEADLINE_EXCEEDED, not CANCELLED."""
    context = SimpleNamespace(code=lambda: None, time_remaining=lambda: time_remaining)
    assert metrics._call_code(context, None, False, True).name == expected


@pytest.mark.parametrize(("cancelled", "expected"), [(True, "CANCELLED"), (False, "RESOURCE_EXHAUSTED")])
def test_call_code_of_a_call_whose_handler_never_ran(cancelled, expected):
    """grpc ends such a call before its request reached the handler: the client left (cancelled) while sending it,
    or it was over the receive limit."""
    assert metrics._call_code(None, None, False, cancelled).name == expected


class _ErrorsServicer:
    """Handlers of grpc.health.v1.HealthCheckRequest messages that fail in the ways a handler can."""

    async def raise_(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> bytes:
        if request.service == "set code":
            context.set_code(grpc.StatusCode.NOT_FOUND)
        if request.service == "refusal":
            raise FieldError("top_p", "must be in (0, 1], got 1.5")
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
            for service in ("", "set code", "no message", "refusal"):
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
        (grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 1.5"),  # a refusal keeps its code
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

    from splitserve.base.tracing import BoundedBatchSpanProcessor

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
