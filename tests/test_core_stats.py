"""The core's per-request timing and its Prometheus metrics, worked by hand with made-up step outputs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from core_svc.metrics import CoreMetrics
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, PrefixCacheStats, SchedulerStats
from core_svc.request import EngineCoreEvent, EngineCoreEventType, FinishReason
from core_svc.stats import RequestStatsTracker
from tests.factories import make_request


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    result = registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    assert result is not None, name
    return result


def test_tracker_and_metrics_by_hand():
    registry = CollectorRegistry()
    tracker = RequestStatsTracker()
    tracker.sinks.append(CoreMetrics(registry, "m", max_model_len=256, max_num_batched_tokens=64))
    a = make_request("a", num_tokens=20, max_tokens=3)
    b = make_request("b", num_tokens=5, max_tokens=8)
    tracker.on_add(a)
    tracker.on_add(b)
    queued = EngineCoreEvent(EngineCoreEventType.QUEUED, 1.0)
    scheduled = EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.5)
    stats = SchedulerStats(
        num_running_reqs=2, kv_cache_usage=0.25, prefix_cache_stats=PrefixCacheStats(1, 20, 16), num_preemptions=0
    )
    # Step 1 at t=2.0: a's first token (16 of its 20 prompt tokens cached, 4 computed); b is mid-prefill.
    tracker.on_step(
        4 + 3,
        EngineCoreOutputs(
            [EngineCoreOutput("a", [7], events=[queued, scheduled], num_cached_tokens=16)], stats, timestamp=2.0
        ),
    )
    # Step 2 at t=2.5: a's second and last token (length); b's first token, scheduled at 1.75.
    b_events = [EngineCoreEvent(EngineCoreEventType.QUEUED, 1.25), EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1.75)]
    done = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.125)
    tracker.on_step(
        1 + 2,
        EngineCoreOutputs(
            [
                EngineCoreOutput("a", [8], finish_reason=FinishReason.LENGTH),
                EngineCoreOutput("b", [9], events=b_events),
            ],
            done,
            timestamp=2.5,
        ),
    )
    assert set(tracker.requests) == {"b"}
    assert value(registry, "splitserve:num_requests_running") == 1
    assert value(registry, "splitserve:kv_cache_usage_perc") == 0.125
    # The client went away: b is aborted between steps, and the gauges follow at once. (Its events went out
    # with its output, as the scheduler takes them.)
    b.take_events()
    tracker.on_abort([b, make_request("unknown")], SchedulerStats())
    assert tracker.requests == {}
    assert value(registry, "splitserve:num_requests_running") == 0
    assert value(registry, "splitserve:kv_cache_usage_perc") == 0
    assert value(registry, "splitserve:prefix_cache_queries_total") == 20
    assert value(registry, "splitserve:prefix_cache_hits_total") == 16
    assert value(registry, "splitserve:prompt_tokens_by_source_total", source="local_compute") == 4 + 5
    assert value(registry, "splitserve:prompt_tokens_by_source_total", source="local_cache_hit") == 16
    assert value(registry, "splitserve:core_generation_tokens_total") == 3
    assert value(registry, "splitserve:core_request_finished_total", finished_reason="length") == 1
    assert value(registry, "splitserve:core_request_finished_total", finished_reason="abort") == 1
    assert value(registry, "splitserve:iteration_tokens_total_count") == 2
    assert value(registry, "splitserve:iteration_tokens_total_sum") == 10
    # a: queued 1.0 -> scheduled 1.5 -> first token 2.0 -> last token 2.5; b: 1.25 -> 1.75 -> 2.5, aborted.
    assert value(registry, "splitserve:request_queue_time_seconds_sum") == 0.5 + 0.5
    assert value(registry, "splitserve:request_prefill_time_seconds_sum") == 0.5 + 0.75
    assert value(registry, "splitserve:request_decode_time_seconds_sum") == 0.5 + 0.0
    assert value(registry, "splitserve:request_inference_time_seconds_sum") == 1.0 + 0.75
    assert value(registry, "splitserve:request_queue_time_seconds_count") == 2


def test_a_request_aborted_while_queued_is_timed_from_its_own_events():
    """Aborted before it produced anything: its events never rode on an output; the abort reads them."""
    registry = CollectorRegistry()
    tracker = RequestStatsTracker()
    tracker.sinks.append(CoreMetrics(registry, "m", max_model_len=256, max_num_batched_tokens=64))
    request = make_request("q", num_tokens=40)
    tracker.on_add(request)
    request.events = [
        EngineCoreEvent(EngineCoreEventType.QUEUED, 5.0),
        EngineCoreEvent(EngineCoreEventType.SCHEDULED, 5.25),  # scheduled, then aborted mid-prefill
    ]
    tracker.on_abort([request], SchedulerStats(num_waiting_reqs=3))
    assert value(registry, "splitserve:request_queue_time_seconds_sum") == 0.25
    assert value(registry, "splitserve:num_requests_waiting") == 3
    assert value(registry, "splitserve:core_request_finished_total", finished_reason="abort") == 1
