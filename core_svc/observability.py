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
                cache_config=cache_config_labels(engine_core),
            )
        )
    if tracer_provider is not None:
        engine_core.add_stats_sink(RequestTracer(tracer_provider))


def cache_config_labels(engine_core: EngineCore) -> dict[str, str]:
    """The KV cache's settings under vLLM's ``cache_config_info`` label names (``num_gpu_blocks`` counts the
    blocks of the cache, on whatever device it is)."""
    config = engine_core.config
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(engine_core.kv_cache_dtype).removeprefix("torch."),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "num_gpu_blocks": str(engine_core.num_kv_blocks),
        "num_cpu_blocks": "0",
    }
