"""The periodic stats line: its numbers by hand with a fake clock, and its token counts after a known workload."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from frontend_svc import AsyncLLM, SamplingParams
from frontend_svc.engine_types import SchedulerStats
from frontend_svc.stat_logger import LoggingStatLogger
from frontend_svc.stats import IterationStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_line_by_hand():
    clock = FakeClock()
    stats_logger = LoggingStatLogger(interval_s=2.0, clock=clock)
    first = SchedulerStats(num_running_reqs=3, prefix_cache_queries=160, prefix_cache_hits=16)
    stats_logger.record(first, IterationStats(num_prompt_tokens=100, num_generation_tokens=10))
    clock.now += 1.0
    assert stats_logger.maybe_log() is None  # the interval has not passed
    latest = SchedulerStats(num_running_reqs=4, num_waiting_reqs=2, kv_cache_usage=0.25, prefix_cache_queries=40)
    stats_logger.record(latest, IterationStats(num_prompt_tokens=0, num_generation_tokens=30))
    clock.now += 1.5
    line = stats_logger.maybe_log()
    # 100 prompt and 40 generated tokens over 2.5 s; 16 of 200 queried prefix tokens hit
    assert line == (
        "Engine 000: Avg prompt throughput: 40.0 tokens/s, Avg generation throughput: 16.0 tokens/s, "
        "Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 8.0%"
    )
    clock.now += 2.0  # nothing since the last line
    assert stats_logger.maybe_log() == (
        "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
        "Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 0.0%"
    )
    assert (stats_logger.total_prompt_tokens, stats_logger.total_generation_tokens) == (100, 40)


def test_hit_rate_leaves_out_readmissions_after_preemption():
    """As vLLM's: a request admitted again after a preemption mostly finds its own blocks; its lookups do not
    count. 16 of 160 first-admission tokens hit: 10.0%, whatever the 114 re-looked-up tokens found."""
    clock = FakeClock()
    stats_logger = LoggingStatLogger(interval_s=1.0, clock=clock)
    stats = SchedulerStats(
        prefix_cache_queries=160,
        prefix_cache_hits=16,
        prefix_cache_preempted_queries=114,
        prefix_cache_preempted_hits=32,
    )
    stats_logger.record(stats, IterationStats(num_generation_tokens=1))
    clock.now += 1.0
    assert stats_logger.maybe_log().endswith("Prefix cache hit rate: 10.0%")


def test_counts_equal_the_workload(checkpoint, monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_LOG_STATS_INTERVAL", "0.000001")
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13] * 20]
    max_tokens = [4, 7, 1]

    async def scenario() -> LoggingStatLogger:
        engine = AsyncLLM(str(checkpoint("llama", "tiny")), num_kv_blocks=64)
        try:

            async def one(i: int) -> None:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True, n=1)
                async for _ in engine.generate({"prompt_token_ids": prompts[i]}, params, f"r{i}"):
                    pass

            await asyncio.gather(*(one(i) for i in range(3)))
            (stat_logger,) = engine._handler_state.stat_loggers
            assert isinstance(stat_logger, LoggingStatLogger)
            return stat_logger
        finally:
            engine.close()

    with caplog.at_level("INFO", logger="frontend_svc.stat_logger"):
        stats_logger = asyncio.run(scenario())
    assert stats_logger.total_prompt_tokens == 3 + 5 + 20
    assert stats_logger.total_generation_tokens == 4 + 7 + 1
    assert "Avg generation throughput" in caplog.text and "Running:" in caplog.text


def test_off_when_the_interval_is_zero(checkpoint, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_LOG_STATS_INTERVAL", "0")
    engine = AsyncLLM(str(checkpoint("llama", "tiny")), num_kv_blocks=64)
    try:
        assert engine._handler_state.stat_loggers == []
    finally:
        engine.close()


def test_request_timing_by_hand():
    """One request's life as the core reports it: queued at 10.0, scheduled at 10.5, preempted at 11.0,
    scheduled again at 11.2 (the first scheduling counts), tokens in outputs stamped 12.0, 12.25 and 13.0."""
    from frontend_svc.engine_types import EngineCoreEvent, EngineCoreEventType
    from frontend_svc.stats import RequestStateStats

    req = RequestStateStats(arrival_time=1000.0)
    first = IterationStats(iteration_timestamp=1000.8)
    events = [
        EngineCoreEvent(EngineCoreEventType.QUEUED, 10.0),
        EngineCoreEvent(EngineCoreEventType.SCHEDULED, 10.5),
        EngineCoreEvent(EngineCoreEventType.PREEMPTED, 11.0),
        EngineCoreEvent(EngineCoreEventType.SCHEDULED, 11.2),
    ]
    first.update_from_output(1, events, 12.0, num_prompt_tokens=7, req_stats=req)
    assert (first.num_prompt_tokens, first.num_generation_tokens, first.num_preempted_reqs) == (7, 1, 1)
    assert first.time_to_first_tokens_iter == [pytest.approx(0.8)] and first.inter_token_latencies_iter == []
    second = IterationStats(iteration_timestamp=1001.0)
    second.update_from_output(2, [], 12.25, num_prompt_tokens=7, req_stats=req)  # two tokens in one output
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (0, 2)
    assert second.inter_token_latencies_iter == [0.25]
    last = IterationStats(iteration_timestamp=1002.0)
    last.update_from_output(1, [], 13.0, num_prompt_tokens=7, req_stats=req)
    finished = last.update_from_finished_request("length", 7, 4, req)
    assert last.finished_requests == [finished]
    assert finished.finish_reason == "length" and finished.num_generation_tokens == 4
    assert finished.e2e_latency == pytest.approx(2.0)
    assert finished.queued_time == 0.5  # 10.5 - 10.0
    assert finished.prefill_time == 1.5  # 12.0 - 10.5
    assert finished.decode_time == 1.0  # 13.0 - 12.0
    assert finished.inference_time == 2.5  # 13.0 - 10.5
    assert finished.mean_time_per_output_token == pytest.approx(1.0 / 3)
    assert finished.num_preemptions == 1 and finished.first_token_latency == pytest.approx(0.8)


def test_request_aborted_while_queued_has_zero_phases():
    from frontend_svc.stats import RequestStateStats

    req = RequestStateStats(arrival_time=50.0)
    stats = IterationStats(iteration_timestamp=53.0)
    finished = stats.update_from_finished_request("abort", 3, None, req)
    assert (finished.e2e_latency, finished.queued_time, finished.prefill_time, finished.decode_time) == (3, 0, 0, 0)
    assert finished.mean_time_per_output_token == 0 and finished.first_token_latency is None


def test_several_cores_add_up():
    clock = FakeClock()
    stats_logger = LoggingStatLogger(interval_s=5.0, clock=clock)
    a = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5, engine_id="10.0.0.1:50061")
    b = SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, engine_id="10.0.0.2:50061")
    stats_logger.record(a, IterationStats())
    stats_logger.record(b, IterationStats())
    stats_logger.record(dataclasses.replace(a, num_running_reqs=4), IterationStats())  # a's latest counts
    clock.now += 5.0
    assert stats_logger.maybe_log().endswith(
        "Running: 6 reqs, Waiting: 1 reqs, KV cache usage: 37.5%, Prefix cache hit rate: 0.0%, 2 cores"
    )
    clock.now += 58.0
    stats_logger.record(dataclasses.replace(b, num_running_reqs=1), IterationStats())  # b reports again
    clock.now += 5.0  # a has been silent for 68 s (more than STALE_S): idle or gone, it leaves the sums
    assert stats_logger.maybe_log().endswith(
        "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 0.0%"
    )


def test_a_failing_stat_logger_is_dropped_and_serving_goes_on(checkpoint, monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_LOG_STATS_INTERVAL", "0")

    class Broken:
        calls = 0

        def record(self, scheduler_stats, iteration_stats):
            Broken.calls += 1
            raise RuntimeError("broken logger")

        def log(self):
            pass

    async def scenario() -> list[int]:
        engine = AsyncLLM(str(checkpoint("llama", "tiny")), num_kv_blocks=64, stat_loggers=[Broken()])
        try:
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            tokens = []
            for i in range(2):
                async for output in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, f"r{i}"):
                    tokens = list(output.outputs[0].token_ids)
            assert engine._handler_state.stat_loggers == []
            return tokens
        finally:
            engine.close()

    with caplog.at_level("ERROR"):
        assert len(asyncio.run(scenario())) == 5
    assert Broken.calls == 1 and "stat logger Broken failed" in caplog.text


def test_lines_come_on_a_timer_and_idle_ones_at_debug(checkpoint, monkeypatch, caplog):
    """The last window of a burst is logged although no output follows it; lines while idle go to DEBUG."""
    monkeypatch.setenv("SPLITSERVE_LOG_STATS_INTERVAL", "0.2")

    async def scenario() -> None:
        engine = AsyncLLM(str(checkpoint("llama", "tiny")), num_kv_blocks=64)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r"):
                pass
            await asyncio.sleep(0.7)  # three intervals and more with nothing running
        finally:
            engine.close()

    with caplog.at_level("DEBUG", logger="frontend_svc.stat_logger"):
        asyncio.run(scenario())
    lines = [r for r in caplog.records if r.name == "frontend_svc.stat_logger"]
    busy = [r for r in lines if r.levelname == "INFO"]
    idle = [r for r in lines if r.levelname == "DEBUG"]
    # The burst shows in an INFO line: the request took less than the interval, so it was the timer that logged
    # its window, after the last output. Then the idle lines.
    generated = [float(r.getMessage().split("generation throughput: ")[1].split(" ")[0]) for r in busy]
    assert busy and sum(generated) > 0
    assert len(idle) >= 2 and all("Avg generation throughput: 0.0 tokens/s" in r.getMessage() for r in idle)
