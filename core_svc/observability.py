"""Turns on the core's Prometheus metrics and request spans for an ``EngineCore`` (the core server and the
in-process core alike)."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from core_svc.engine_core import EngineCore
from core_svc.metrics import CoreMetrics
from core_svc.tracing import RequestTracer


def observe_engine_core(
    engine_core: EngineCore,
    model_name: str,
    registry: CollectorRegistry | None,
    tracer_provider: TracerProvider | None,
) -> None:
    """Register ``CoreMetrics`` in ``registry`` and emit request spans from ``tracer_provider``; None leaves
    either off. Call it before the engine core runs or on its thread."""
    if registry is not None:
        engine_core.add_stats_sink(
            CoreMetrics(
                registry,
                model_name,
                engine_core.max_model_len,
                engine_core.config.max_num_batched_tokens,
                sleep_level=lambda: engine_core.sleep_state.level,
            )
        )
    if tracer_provider is not None:
        engine_core.add_stats_sink(RequestTracer(tracer_provider))
