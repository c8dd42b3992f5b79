"""What both services share for Prometheus: the registry, vLLM's histogram buckets, and a gRPC server interceptor
that counts calls by method and status (the ``/metrics`` endpoint: ``splitserve.metrics_server``). Imports
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


FINISHED_REASONS = ("stop", "length", "abort", "error")


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every finished call as ``splitserve:grpc_server_handled_total{grpc_service, grpc_method,
    grpc_code}`` (the labels of go-grpc-prometheus, the usual gRPC server metric). A call's code is what the
    handler aborted with or set, CANCELLED when the client went away, UNKNOWN for an uncaught exception, else OK.
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
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        record = self._recorder(service, method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, record), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, record), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, record), handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, record), handler.request_deserializer, handler.response_serializer
        )

    def _recorder(self, service: str, method: str) -> _Record:
        def record(context: Any, error: BaseException | None) -> None:
            self.handled.labels(service, method, _call_code(context, error).name).inc()

        return record


def _call_code(context: Any, error: BaseException | None) -> grpc.StatusCode:
    """The call's status: what the handler set or aborted with; CANCELLED when the client went away, however the
    handler learnt it (a CancelledError at an await, a GeneratorExit when grpc closes a streaming handler
    between two responses, or nothing at all when it ended right then); else UNKNOWN for an uncaught error."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # grpc.aio reports the code as its integer value after an abort
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if isinstance(error, asyncio.CancelledError | GeneratorExit) or context.cancelled():
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


_Record = Callable[[Any, BaseException | None], None]


def _wrap_unary(behavior: Callable[..., Awaitable[Any]], record: _Record) -> Any:
    async def wrapper(request: Any, context: Any) -> Any:
        try:
            response = await behavior(request, context)
        except BaseException as e:
            record(context, e)
            raise
        record(context, None)
        return response

    return wrapper


def _wrap_stream(behavior: Callable[..., Any], record: _Record) -> Any:
    """A streaming handler is an async generator (yields responses) or a coroutine that writes them with
    ``context.write`` (grpcio-health-checking's ``Watch``); the wrapper keeps its kind."""
    if not inspect.isasyncgenfunction(behavior):
        return _wrap_unary(behavior, record)

    async def wrapper(request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            async for response in behavior(request, context):
                yield response
        except BaseException as e:
            record(context, e)
            raise
        record(context, None)

    return wrapper
