"""OpenTelemetry tracing for both services, configured by the standard ``OTEL_*`` environment variables.

Tracing is on when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``) or ``OTEL_TRACES_EXPORTER=console``, and ``OTEL_SDK_DISABLED`` is not true.
Off, nothing here builds a provider, an exporter or a thread, and the services skip every tracing call.
Sampling follows ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (the SDK reads them; default
parentbased_always_on), the exporter protocol ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` /
``OTEL_EXPORTER_OTLP_PROTOCOL`` (grpc, the default, or http/protobuf), the service name ``OTEL_SERVICE_NAME``.
Context travels as W3C ``traceparent`` / ``tracestate`` through the globally configured propagator
(``OTEL_PROPAGATORS``, default tracecontext and baggage).

Attribute names are vLLM's (``vllm/tracing``), which follow the OpenTelemetry GenAI conventions.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping

import grpc
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

logger = logging.getLogger(__name__)

FRONTEND_TRACING_SERVICE_NAME = "splitserve-frontend"
CORE_TRACING_SERVICE_NAME = "splitserve-core"
# At shutdown, how long the last spans may take to leave. An unreachable collector would otherwise hold the exit
# for the OTLP exporter's retries (about 10 s, OTEL_EXPORTER_OTLP_TIMEOUT) after the server has stopped.
SHUTDOWN_EXPORT_TIMEOUT_S = 2.0


class SpanAttributes:
    """Span attribute names (vLLM's ``SpanAttributes``)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    # Ours, on the core's spans.
    CORE_NUM_CACHED_TOKENS = "splitserve.core.num_cached_tokens"
    CORE_NUM_PREEMPTIONS = "splitserve.core.num_preemptions"
    CORE_FINISH_REASON = "splitserve.core.finish_reason"


def tracing_configured() -> bool:
    """Whether the environment asks for traces (see the module docstring)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    if exporter == "console":
        return True
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def init_tracer_provider(default_service_name: str, exporter: SpanExporter | None = None) -> TracerProvider | None:
    """A tracer provider for one service (not installed globally: the in-process ``serve`` has two), or None
    when tracing is off and no ``exporter`` is given. Spans leave through a ``BatchSpanProcessor`` (its own
    ``OTEL_BSP_*`` settings apply).

    Args:
        default_service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` is set.
        exporter: an exporter to use instead of the environment's (tests pass an in-memory one).

    Raises:
        ValueError: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names a protocol we do not export.
    """
    if exporter is None:
        if not tracing_configured():
            return None
        exporter = _exporter_from_env()
    service_name = os.environ.get("OTEL_SERVICE_NAME") or default_service_name
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BoundedBatchSpanProcessor(exporter))
    logger.info("OpenTelemetry tracing on: service %s, exporter %s", service_name, type(exporter).__name__)
    return provider


class BoundedBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` whose shutdown waits at most ``shutdown_timeout_s`` for the last export, then
    shuts the exporter down, which ends its retries (the SDK's own shutdown waits out every retry)."""

    def __init__(self, exporter: SpanExporter, shutdown_timeout_s: float = SHUTDOWN_EXPORT_TIMEOUT_S) -> None:
        super().__init__(exporter)
        self.exporter = exporter
        self.shutdown_timeout_s = shutdown_timeout_s

    def shutdown(self) -> None:
        flush = threading.Thread(target=super().shutdown, name="splitserve-span-flush", daemon=True)
        flush.start()
        flush.join(self.shutdown_timeout_s)
        if flush.is_alive():
            logger.warning(
                "the last spans could not be exported within %.0f s (is the collector reachable?); dropped",
                self.shutdown_timeout_s,
            )
            self.exporter.shutdown()
            flush.join(self.shutdown_timeout_s)


def _exporter_from_env() -> SpanExporter:
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return ConsoleSpanExporter()
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        except ImportError as e:
            raise ValueError(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf needs opentelemetry-exporter-otlp-proto-http"
            ) from e
        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: only grpc and http/protobuf are supported")


def extract_context(headers: Mapping[str, str]) -> Context:
    """The context W3C headers (``traceparent``, ``tracestate``; keys lower-case) carry."""
    return propagate.extract(headers)


def inject_headers(context: Context | None = None) -> dict[str, str]:
    """W3C headers for ``context`` (default: the current one); empty when no span is recording there."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


def grpc_server_interceptors(provider: TracerProvider | None) -> list[grpc.aio.ServerInterceptor]:
    """The OpenTelemetry gRPC server interceptor (a SERVER span per call but health checks and reflection,
    continuing the caller's context from its metadata), or nothing when tracing is off."""
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=provider, filter_=_traced_call())]


def grpc_client_interceptors(provider: TracerProvider | None) -> list[grpc.aio.ClientInterceptor]:
    """The OpenTelemetry gRPC client interceptors (a CLIENT span per call, its context in the call's
    metadata), or nothing when tracing is off."""
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=provider, filter_=_traced_call()))


def _traced_call() -> object:
    """Every call but health checks and reflection (probes poll them: noise in every trace store)."""
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection")))


def monotonic_to_epoch_ns(timestamps: list[float]) -> list[int]:
    """``time.monotonic()`` seconds of this process as the Unix-epoch nanoseconds spans take. One offset, taken
    now, for all of them: intervals between them stay exact, and the wall clock's later steps (NTP) apply."""
    offset_s = time.time() - time.monotonic()
    return [int((t + offset_s) * 1e9) for t in timestamps]
