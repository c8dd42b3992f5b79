"""The frontend's stat loggers (vLLM v1's ``vllm/v1/metrics/loggers.py``): the periodic log line, and the
Prometheus metrics of the requests this frontend serves. Both are fed by ``AsyncLLM``'s output handler, one
``record`` per batch of core outputs (and per abort).

The core exports what belongs to the engine (running / waiting, KV usage, preemptions, prefix cache, queue /
prefill / decode time, iteration tokens: ``core_svc/metrics.py``); this side exports what the client saw (TTFT,
inter-token latency, e2e latency, tokens and requests by finished reason). Each request passes through one
frontend and each step runs on one core, so summing a metric over the pods of one service counts nothing twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry

from frontend_svc.engine_types import SchedulerStats
from frontend_svc.stats import IterationStats
from splitserve.base import metrics

logger = logging.getLogger(__name__)
# vLLM's buckets of request_params_n.
N_BUCKETS = [1, 2, 5, 10, 20]
STALE_S = 60.0  # a core silent this long (idle, or gone) leaves the log line's sums


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        """One batch of core outputs (``scheduler_stats`` None for an abort outside one)."""

    def log(self) -> None:
        """Called after each ``record``; loggers that report periodically decide here."""


class LoggingStatLogger:
    """Accumulates what each batch of core outputs brought and logs at most one line per interval (at DEBUG
    level when nothing ran since the previous one):

    ``Engine 000: Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 640.1 tokens/s, Running: 32
    reqs, Waiting: 0 reqs, KV cache usage: 4.1%, Prefix cache hit rate: 12.5%``

    Throughputs are over the time since the previous line; the prefix-cache hit rate is over the lookups since
    then (hit tokens / queried tokens) of requests admitted for the first time: as in vLLM, a request admitted
    again after a preemption, which mostly finds its own blocks, is left out; running and waiting are the sums
    of each core's latest, KV usage their mean, over the cores that reported within ``STALE_S`` (the line then
    ends with the number of cores, when there are several).

    Args:
        interval_s: seconds between lines, > 0 (``SPLITSERVE_LOG_STATS_INTERVAL``).
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(self, interval_s: float, engine_index: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.engine_index = engine_index
        self.clock = clock
        self.last_log_time = clock()
        self.latest: dict[str, tuple[SchedulerStats, float]] = {}  # engine_id -> (its latest stats, when)
        self.total_prompt_tokens = 0  # since construction
        self.total_generation_tokens = 0
        self._prompt_tokens = self._generation_tokens = 0  # since the last line
        self._prefix_queries = self._prefix_hits = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        self._prompt_tokens += iteration_stats.num_prompt_tokens
        self._generation_tokens += iteration_stats.num_generation_tokens
        self.total_prompt_tokens += iteration_stats.num_prompt_tokens
        self.total_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            self.latest[scheduler_stats.engine_id] = (scheduler_stats, self.clock())
            self._prefix_queries += scheduler_stats.prefix_cache_queries
            self._prefix_hits += scheduler_stats.prefix_cache_hits

    def log(self) -> None:
        self.maybe_log()

    def maybe_log(self) -> str | None:
        """Log and return the line when the interval has passed, else None."""
        now = self.clock()
        elapsed = now - self.last_log_time
        if elapsed < self.interval_s:
            return None
        self.latest = {k: v for k, v in self.latest.items() if now - v[1] <= max(STALE_S, self.interval_s)}
        cores = [stats for stats, _ in self.latest.values()] or [SchedulerStats()]
        running = sum(c.num_running_reqs for c in cores)
        waiting = sum(c.num_waiting_reqs for c in cores)
        kv_usage = sum(c.kv_cache_usage for c in cores) / len(cores)
        hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
        line = (
            f"Engine {self.engine_index:03d}: Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {running} reqs, Waiting: {waiting} reqs, "
            f"KV cache usage: {100 * kv_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%"
            + (f", {len(cores)} cores" if len(cores) > 1 else "")
        )
        idle = not (self._prompt_tokens or self._generation_tokens or running or waiting)
        (logger.debug if idle else logger.info)("%s", line)  # an idle engine does not fill the log (as vLLM)
        self.last_log_time = now
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix_queries = self._prefix_hits = 0
        return line


class PrometheusStatLogger:
    """The frontend's Prometheus metrics, vLLM's names with the ``splitserve:`` prefix and labels
    ``model_name``, ``engine`` (plus ``finished_reason`` on ``request_success``). Units: seconds, tokens.

    Args:
        registry: where the metrics are registered (one registry per frontend).
        model_name: the served model, as ``GetModelInfo`` names it.
        max_model_len: the upper end of the token-count buckets.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int, engine_index: int = 0) -> None:
        m = metrics.LabelledMetrics(registry, model_name, engine_index)
        token_buckets = metrics.build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens of the requests that got a first token.")
        self.generation_tokens = m.counter("generation_tokens", "Tokens generated.")
        self.request_success = m.counters_by(
            "request_success", "Requests finished, by finished reason.", "finished_reason", metrics.FINISHED_REASONS
        )
        self.time_to_first_token = m.histogram(
            "time_to_first_token_seconds",
            "Time to first token: arrival to the first token's output.",
            metrics.TTFT_BUCKETS,
        )
        self.inter_token_latency = m.histogram(
            "inter_token_latency_seconds",
            "Time between two outputs of a request, by the core's clock.",
            metrics.ITL_BUCKETS,
        )
        self.time_per_output_token = m.histogram(
            "request_time_per_output_token_seconds",
            "Decode time / (generation tokens - 1), per finished request.",
            metrics.ITL_BUCKETS,
        )
        self.e2e_latency = m.histogram(
            "e2e_request_latency_seconds",
            "Arrival to the final output, per finished request.",
            metrics.REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = m.histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets
        )
        self.request_generation_tokens = m.histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets
        )
        self.request_max_tokens = m.histogram(
            "request_params_max_tokens", "max_tokens per finished request.", token_buckets
        )
        self.request_params_n = m.histogram(
            "request_params_n", "n per finished API request (once all its completions have finished).", N_BUCKETS
        )
        self.request_max_num_generation_tokens = m.histogram(
            "request_max_num_generation_tokens",
            "The most tokens one completion of a finished API request generated.",
            token_buckets,
        )

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.request_success[finished.finish_reason].inc()
            self.e2e_latency.observe(finished.e2e_latency)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            self.time_per_output_token.observe(finished.mean_time_per_output_token)  # 0 below two tokens, as vLLM
            if finished.max_tokens_param is not None:
                self.request_max_tokens.observe(finished.max_tokens_param)
        for n in iteration_stats.n_params_iter:
            self.request_params_n.observe(n)
        for max_generated in iteration_stats.max_num_generation_tokens_iter:
            self.request_max_num_generation_tokens.observe(max_generated)

    def log(self) -> None:
        pass  # Prometheus scrapes; nothing to do per batch
