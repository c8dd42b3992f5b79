"""Per-request timing in the core, for its metrics and its trace spans. Off (no sink), the engine never calls
in here.

``RequestStatsTracker`` follows each request from ``EngineCore.add_request`` to its finish (an output with a
finish reason, or an abort) and hands every step's news to its sinks (``CoreMetrics``, ``RequestTracer``).
Timestamps are this process's ``time.monotonic()`` seconds, the clock of the requests' events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from core_svc.outputs import EngineCoreOutputs, SchedulerStats
from core_svc.request import EngineCoreEvent, EngineCoreEventType, FinishReason, Request
from splitserve.base.request_phases import RequestPhases, interval


@dataclass
class CoreRequestStats(RequestPhases):
    """One request's life in the core. Seconds (monotonic); None: not yet."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    trace_headers: dict[str, str]
    queued_ts: float
    scheduled_ts: float | None = None  # first scheduled
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    finished_ts: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    events: list[tuple[str, float]] = field(default_factory=list)  # (name, timestamp): queued, scheduled, ...

    @property
    def queued_time(self) -> float:
        """Queued to first scheduled (to the finish when never scheduled: it waited all its life)."""
        return interval(self.queued_ts, self.scheduled_ts or self.finished_ts)


class StatsSink(Protocol):
    def record_step(
        self,
        num_scheduled_tokens: int,
        scheduler_stats: SchedulerStats | None,
        num_generation_tokens: int,
        prefilled: list[CoreRequestStats],
        finished: list[CoreRequestStats],
    ) -> None:
        """One step (or an abort between steps: no scheduler stats, nothing scheduled). ``prefilled``: requests
        whose first token this step produced; ``finished``: requests that ended."""


class RequestStatsTracker:
    """Called by ``EngineCore`` on add, step and abort (on the engine's thread)."""

    def __init__(self) -> None:
        self.sinks: list[StatsSink] = []
        self.requests: dict[str, CoreRequestStats] = {}

    def on_add(self, request: Request) -> None:
        now = time.monotonic()
        self.requests[request.request_id] = CoreRequestStats(
            request.request_id,
            request.num_prompt_tokens,
            request.sampling_params.max_tokens if request.sampling_params is not None else 0,
            request.trace_headers,
            queued_ts=now,
            events=[("queued", now)],
        )

    def on_step(self, num_scheduled_tokens: int, outputs: EngineCoreOutputs) -> None:
        prefilled: list[CoreRequestStats] = []
        finished: list[CoreRequestStats] = []
        num_generation_tokens = 0
        for output in outputs.outputs:
            stats = self.requests.get(output.request_id)
            if stats is None:
                continue
            _apply_events(stats, output.events)
            if output.new_token_ids:
                if stats.first_token_ts is None:
                    stats.first_token_ts = outputs.timestamp
                    stats.num_cached_tokens = output.num_cached_tokens
                    stats.events.append(("first_token", outputs.timestamp))
                    prefilled.append(stats)
                stats.last_token_ts = outputs.timestamp
                stats.num_generation_tokens += len(output.new_token_ids)
                num_generation_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                finished.append(self._finish(stats, output.finish_reason, outputs.timestamp))
        for sink in self.sinks:
            sink.record_step(num_scheduled_tokens, outputs.scheduler_stats, num_generation_tokens, prefilled, finished)

    def on_abort(self, requests: list[Request], scheduler_stats: SchedulerStats) -> None:
        """``requests`` were aborted between steps (their events not yet reported are read here);
        ``scheduler_stats``: the load after it, with no prefix-cache or preemption counts."""
        now = time.monotonic()
        finished = []
        for request in requests:
            stats = self.requests.get(request.request_id)
            if stats is not None:
                _apply_events(stats, request.take_events())
                finished.append(self._finish(stats, FinishReason.ABORT, now))
        for sink in self.sinks:
            sink.record_step(0, scheduler_stats, 0, [], finished)

    def _finish(self, stats: CoreRequestStats, reason: FinishReason, timestamp: float) -> CoreRequestStats:
        del self.requests[stats.request_id]
        stats.finish_reason = reason
        stats.finished_ts = timestamp
        stats.events.append(("finished", timestamp))
        return stats


def _apply_events(stats: CoreRequestStats, events: list[EngineCoreEvent]) -> None:
    for event in events:
        if event.type == EngineCoreEventType.QUEUED:
            stats.queued_ts = event.timestamp
            stats.events[0] = ("queued", event.timestamp)
            continue
        if event.type == EngineCoreEventType.SCHEDULED:
            stats.scheduled_ts = stats.scheduled_ts or event.timestamp
        else:
            stats.num_preemptions += 1
        stats.events.append((event.type.name.lower(), event.timestamp))
