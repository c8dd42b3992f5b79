"""The core's trace spans: one per request, a child of the context its ``trace_headers`` carry (the frontend's
``llm_request`` span), made when the request finishes from the timestamps the core kept (as vLLM makes its
request span at the finish).

``core_request`` spans the request's life in the core, queued to finished, with an event for each of queued,
scheduled, preempted, first_token and finished; its children ``core_queue``, ``core_prefill`` and
``core_decode`` cover the three phases.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind, Status, StatusCode

from core_svc.outputs import SchedulerStats
from core_svc.request import FinishReason
from core_svc.stats import CoreRequestStats
from splitserve.base.tracing import SpanAttributes, extract_context, monotonic_to_epoch_ns


class RequestTracer:
    """A ``StatsSink`` that emits each finished request's spans (on the engine thread; the provider's batch
    processor exports them from its own thread)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.tracer = provider.get_tracer("splitserve.core")

    def record_step(
        self,
        num_scheduled_tokens: int,
        scheduler_stats: SchedulerStats | None,
        num_generation_tokens: int,
        prefilled: list[CoreRequestStats],
        finished: list[CoreRequestStats],
    ) -> None:
        for stats in finished:
            self._emit(stats)

    def _emit(self, stats: CoreRequestStats) -> None:
        end = stats.finished_ts if stats.finished_ts is not None else stats.queued_ts
        moments = [stats.queued_ts, stats.scheduled_ts, stats.first_token_ts, stats.last_token_ts, end]
        moments += [timestamp for _, timestamp in stats.events]
        known = [t for t in moments if t is not None]
        epoch_ns = dict(zip(known, monotonic_to_epoch_ns(known), strict=True))
        span = self.tracer.start_span(
            "core_request",
            context=extract_context(stats.trace_headers),
            kind=SpanKind.INTERNAL,
            start_time=epoch_ns[stats.queued_ts],
        )
        if not span.is_recording():  # not sampled
            return
        span.set_attributes(
            {
                SpanAttributes.GEN_AI_REQUEST_ID: stats.request_id,
                SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS: stats.max_tokens,
                SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: stats.num_prompt_tokens,
                SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: stats.num_generation_tokens,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE: stats.queued_time,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: stats.prefill_time,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: stats.decode_time,
                SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: stats.inference_time,
                SpanAttributes.CORE_NUM_CACHED_TOKENS: stats.num_cached_tokens,
                SpanAttributes.CORE_NUM_PREEMPTIONS: stats.num_preemptions,
                SpanAttributes.CORE_FINISH_REASON: str(stats.finish_reason),
            }
        )
        for name, timestamp in stats.events:
            span.add_event(name, timestamp=epoch_ns[timestamp])
        if stats.finish_reason == FinishReason.ERROR:
            span.set_status(Status(StatusCode.ERROR))
        context = trace.set_span_in_context(span)
        phases = [
            ("core_queue", stats.queued_ts, stats.scheduled_ts or end),
            ("core_prefill", stats.scheduled_ts, stats.first_token_ts),
            ("core_decode", stats.first_token_ts, stats.last_token_ts),
        ]
        for name, start, stop in phases:
            if start is not None and stop is not None:
                phase = self.tracer.start_span(name, context=context, start_time=epoch_ns[start])
                phase.end(end_time=epoch_ns[stop])
        span.end(end_time=epoch_ns[end])
