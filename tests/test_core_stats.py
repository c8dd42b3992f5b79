"""The core's per-request timing and its Prometheus metrics, worked by hand with made-up step outputs."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from core_svc.metrics import CoreMetrics
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, PrefixCacheStats, SchedulerStats
from core_svc.request import EngineCoreEvent, EngineCoreEventType, FinishReason, Request
from core_svc.sampling_params import SamplingParams
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
    # vLLM's count per step: the prompts that got their first token, whole, and the tokens generated: step 1
    # a's 20 + 1, step 2 a's 1 and b's 5 + 1.
    assert value(registry, "splitserve:iteration_tokens_total_count") == 2
    assert value(registry, "splitserve:iteration_tokens_total_sum") == 21 + 7
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


def test_readmissions_after_preemption_leave_the_hit_rate_and_counters_alone(checkpoint):
    """The case of tests/test_scheduler.py::test_prefix_cache_stats_count_readmissions_after_preemption_apart on
    the real engine: 4 unrelated 40-token prompts, greedy, max_tokens 40, block_size 16, 13 KV blocks. Two
    preemptions (D at its 10th step, C at its 26th); C comes back with 65 tokens and finds its own first two
    blocks (32 tokens), D with 49 and finds nothing. First admissions: 160 tokens looked up, 0 found; the
    re-admissions, 114 and 32, go only to their own counters. Through every consumer: the core's Prometheus
    counters, the wire (core -> frontend converters) and the frontend's stats line (hit rate 0%, not
    32 / 274 = 11.7%)."""
    from core_svc.wire import outputs_to_pb
    from frontend_svc.stat_logger import LoggingStatLogger
    from frontend_svc.stats import IterationStats
    from frontend_svc.wire import outputs_from_pb
    from tests.helpers import make_engine

    engine = make_engine(checkpoint("llama"), num_kv_blocks=13)
    assert engine.get_engine_info().block_size == 16
    registry = CollectorRegistry()
    engine.add_stats_sink(CoreMetrics(registry, "m", max_model_len=engine.max_model_len, max_num_batched_tokens=64))
    for i in range(4):
        prompt = list(range(10 + 40 * i, 50 + 40 * i))
        engine.add_request(Request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    clock = [0.0]
    stat_logger = LoggingStatLogger(interval_s=1.0, clock=lambda: clock[0])
    frontend_totals = [0, 0, 0, 0]  # queries, hits, preempted queries, preempted hits, as the frontend got them
    num_preemptions = 0
    while engine.has_unfinished_requests():
        stats = outputs_from_pb(outputs_to_pb(engine.step())).scheduler_stats
        num_preemptions += stats.num_preemptions
        frontend_totals = [
            frontend_totals[0] + stats.prefix_cache_queries,
            frontend_totals[1] + stats.prefix_cache_hits,
            frontend_totals[2] + stats.prefix_cache_preempted_queries,
            frontend_totals[3] + stats.prefix_cache_preempted_hits,
        ]
        stat_logger.record(stats, IterationStats())
    assert num_preemptions == 2
    assert frontend_totals == [160, 0, 114, 32]
    assert value(registry, "splitserve:num_preemptions_total") == 2
    assert value(registry, "splitserve:prefix_cache_queries_total") == 160
    assert value(registry, "splitserve:prefix_cache_hits_total") == 0
    assert value(registry, "splitserve:prefix_cache_preempted_queries_total") == 114
    assert value(registry, "splitserve:prefix_cache_preempted_hits_total") == 32
    clock[0] += 1.0
    assert stat_logger.maybe_log().endswith("Prefix cache hit rate: 0.0%")


def test_a_step_without_outputs_still_brings_its_stats_to_the_frontend(checkpoint):
    """Through the EngineLoop, as the servers run it. 4 unrelated 40-token prompts, max_num_batched_tokens 32,
    by hand: step 1 admits only "0" and computes its first 32 tokens, so it produces no output; step 2 finishes
    "0"'s prefill (8 tokens, its first output) and admits "1" with 24; and so on. Step 1's stats hold "0"'s
    admission (1 request, 40 tokens looked up, 0 found); the stream used to get them only in steps with an
    output of its own, so the frontend counted 3 requests and 120 tokens instead of 4 and 160."""
    import time

    from core_svc.engine_loop import EngineLoop
    from tests.helpers import make_engine

    engine = make_engine(checkpoint("llama"), num_kv_blocks=33, max_num_batched_tokens=32)
    engine_loop = EngineLoop(engine)
    received: list[EngineCoreOutputs] = []
    client = engine_loop.register_client(received.append)
    requests = [
        Request(str(i), list(range(10 + 40 * i, 50 + 40 * i)), SamplingParams(temperature=0.0, max_tokens=2))
        for i in range(4)
    ]
    engine_loop.start()
    try:
        engine_loop.add_requests(client, requests).result(timeout=10)
        deadline = time.monotonic() + 30
        while engine_loop.num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine_loop.stop()
    first = received[0]
    assert first.outputs == [] and first.scheduler_stats.num_running_reqs == 1
    assert (first.scheduler_stats.prefix_cache_stats.requests, first.scheduler_stats.prefix_cache_stats.queries) == (
        1,
        40,
    )
    totals = [0, 0, 0]
    for outputs in received:
        prefix = outputs.scheduler_stats.prefix_cache_stats
        totals = [totals[0] + prefix.requests, totals[1] + prefix.queries, totals[2] + prefix.hits]
    assert totals == [4, 160, 0]
    assert sorted(o.request_id for m in received for o in m.outputs if o.finish_reason is not None) == list("0123")
