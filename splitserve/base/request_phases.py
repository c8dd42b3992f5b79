"""vLLM's request phases from four timestamps of one clock (``vllm/v1/metrics/stats.py``): queued = first
scheduled - queued, prefill = first token - first scheduled, decode = last token - first token, inference =
last token - first scheduled. Shared by the frontend's and the core's per-request stats."""

from __future__ import annotations


class RequestPhases:
    """Mixed into a dataclass that has these four fields (seconds; None: not yet). A phase that never began (a
    request aborted while queued) lasts 0."""

    queued_ts: float | None
    scheduled_ts: float | None  # the first scheduling (a preemption does not reset it)
    first_token_ts: float | None
    last_token_ts: float | None

    @property
    def queued_time(self) -> float:
        return interval(self.queued_ts, self.scheduled_ts)

    @property
    def prefill_time(self) -> float:
        return interval(self.scheduled_ts, self.first_token_ts)

    @property
    def decode_time(self) -> float:
        return interval(self.first_token_ts, self.last_token_ts)

    @property
    def inference_time(self) -> float:
        return interval(self.scheduled_ts, self.last_token_ts)


def interval(start: float | None, end: float | None) -> float:
    """``end - start`` in seconds, 0 when either is unknown."""
    return end - start if start is not None and end is not None else 0.0
