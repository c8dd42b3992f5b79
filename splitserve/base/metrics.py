"""What both services share for Prometheus: the registry, vLLM's histogram buckets, and a gRPC server interceptor
that counts calls by method and status (the ``/metrics`` endpoint: ``splitserve.base.metrics_server``). Imports
prometheus_client and grpc only.

Metric names follow vLLM v1's (``vllm/v1/metrics/loggers.py``) with the ``splitserve:`` prefix and the same
labels (``model_name``, ``engine``); ``docs/observability.md`` lists which service exports which.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

logger = logging.getLogger(__name__)
PREFIX = "splitserve:"

# Bucket bounds, in seconds, as vLLM v1 defines them (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TTFT_BUCKETS += [20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0]
ITL_BUCKETS += [80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
REQUEST_LATENCY_BUCKETS += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's ``build_1_2_5_buckets``, for token counts)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def iteration_tokens_buckets(max_num_batched_tokens: int) -> list[int]:
    """1, 8, 16, 32, ... powers of two up to the step's token budget (vLLM uses its cudagraph sizes)."""
    buckets = [1, 8]
    while buckets[-1] < max_num_batched_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


def make_registry() -> CollectorRegistry:
    """A registry of our own (several engines can live in one test process) with the process, platform and GC
    collectors that prometheus_client's default registry has."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class LabelledMetrics:
    """Makes metrics named ``splitserve:<name>`` in one registry, with vLLM's labels ``model_name`` and
    ``engine`` set to one value each; returns the labelled children, ready to update."""

    def __init__(self, registry: CollectorRegistry, model_name: str, engine_index: int = 0) -> None:
        self.registry = registry
        self.labels = {"model_name": model_name, "engine": str(engine_index)}

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, list(self.labels), registry=self.registry).labels(**self.labels)

    def histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        metric = Histogram(PREFIX + name, doc, list(self.labels), buckets=buckets, registry=self.registry)
        return metric.labels(**self.labels)

    def counters_by(self, name: str, doc: str, label: str, values: Sequence[str]) -> dict[str, Counter]:
        """One counter per value of one more label (``finished_reason``, ``source``), all exported at 0."""
        metric = Counter(PREFIX + name, doc, [*self.labels, label], registry=self.registry)
        return {value: metric.labels(**self.labels, **{label: value}) for value in values}

    def info(self, name: str, doc: str, info: dict[str, str]) -> Gauge:
        """vLLM's ``*_info`` gauges: 1, with ``info`` as labels beside the model's and the engine's."""
        gauge = Gauge(PREFIX + name, doc, [*self.labels, *info], registry=self.registry).labels(**self.labels, **info)
        gauge.set(1)
        return gauge

    def gauges_by(self, name: str, doc: str, label: str, values: Sequence[str]) -> dict[str, Gauge]:
        """One gauge per value of one more label (``sleep_state``), all exported at 0."""
        metric = Gauge(PREFIX + name, doc, [*self.labels, label], registry=self.registry)
        return {value: metric.labels(**self.labels, **{label: value}) for value in values}


FINISHED_REASONS = ("stop", "length", "abort", "error")


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every call as ``splitserve:grpc_server_handled_total{grpc_service, grpc_method, grpc_code}`` (the
    labels of go-grpc-prometheus, the usual gRPC server metric) once it has ended, whatever way it ends (see
    ``_CallRecord``): the code the handler aborted with or set; DEADLINE_EXCEEDED when its deadline passed before
    it answered (see ``_call_code``), CANCELLED when its client went away or the server stopped first; UNKNOWN
    for an uncaught exception; else OK.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter(
            PREFIX + "grpc_server_handled",
            "gRPC calls finished on this server, by method and status code.",
            ["grpc_service", "grpc_method", "grpc_code"],
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        call = _CallRecord(self.handled, service, method)
        # grpc.aio runs each call (finding its handler, the interceptors after this one included, receiving its
        # request, the handler, sending its status) as one task, which ends exactly once, however the call ends. A
        # handler may never run, or be left suspended at a yield when its client goes away: its own code cannot
        # count its call.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(call.count)
        handler = await continuation(handler_call_details)
        if handler is None:  # no such method: grpc answers UNIMPLEMENTED; not counted (any name could be a label)
            call.is_method = False
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _watched(handler.unary_unary, call), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _watched(handler.unary_stream, call), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _watched(handler.stream_unary, call), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _watched(handler.stream_stream, call), handler.request_deserializer, handler.response_serializer
            )
        return handler  # no behavior to watch (grpc sets exactly one)


class _CallRecord:
    """One call, counted when its task ends (``count``), with what its handler did: the handler's context once it
    ran, and whether it returned or raised."""

    def __init__(self, handled: Counter, service: str, method: str) -> None:
        self.handled = handled
        self.service = service
        self.method = method
        self.is_method = True
        self.context: Any = None  # None: the handler never ran
        self.returned = False
        self.error: BaseException | None = None

    def count(self, task: asyncio.Task[Any]) -> None:
        if not self.is_method:
            return
        code = _call_code(self.context, self.error, self.returned, task.cancelling() > 0)
        self.handled.labels(self.service, self.method, code.name).inc()


def _call_code(context: Any, error: BaseException | None, returned: bool, cancelled: bool) -> grpc.StatusCode:
    """A call's status, from how its task ended (``cancelled``: grpc cancelled it) and what its handler did.

    grpc cancels a call's task only when the call ends before the server sent its status: its deadline passed
    (DEADLINE_EXCEEDED, what its client got, known from the handler's context once it ran), the client cancelled
    or went away, or the server stopped (CANCELLED; the client of a stopped server gets UNAVAILABLE, but our
    servers' drains end their calls before), whatever the handler was doing. A client's own deadline timer may
    cancel the call a moment before the server's: that reaches the server as any cancel, CANCELLED (as in
    go-grpc-prometheus, whose handlers see a context cancelled, not past its deadline). A
    handler that never ran otherwise had no request to run on: grpc refused the request before (a message over
    the receive limit: RESOURCE_EXHAUSTED). Then the code the handler aborted with or set; OK if it returned;
    CANCELLED if it was closed (GeneratorExit) or cancelled; else UNKNOWN (an exception it let through, or one
    grpc raised sending its responses)."""
    if cancelled:
        remaining_s = context.time_remaining() if context is not None else None
        return (
            grpc.StatusCode.DEADLINE_EXCEEDED
            if remaining_s is not None and remaining_s <= 0
            else grpc.StatusCode.CANCELLED
        )
    if context is None:
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # grpc.aio reports the code as its integer value after an abort
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if returned:
        return grpc.StatusCode.OK
    if isinstance(error, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def _watched(behavior: Callable[..., Any], call: _CallRecord) -> Any:
    """``behavior`` noting in ``call`` that it ran and how it ended; the same kind of callable (coroutine or async
    generator: grpc and the other interceptors tell them apart)."""
    if inspect.isasyncgenfunction(behavior):

        async def watched_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            call.context = context
            responses = behavior(request, context)
            try:
                async for response in responses:
                    yield response
            except BaseException as e:
                call.error = e
                raise
            finally:
                await responses.aclose()
            call.returned = True

        return watched_stream

    async def watched(request: Any, context: Any) -> Any:
        call.context = context
        try:
            response = await behavior(request, context)
        except BaseException as e:
            call.error = e
            raise
        call.returned = True
        return response

    return watched
