"""The periodic stats log line (vLLM v1's ``LoggingStatLogger``): throughput since the last line and the core's
state, at most once per ``SPLITSERVE_LOG_STATS_INTERVAL`` seconds."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from frontend_svc.engine_types import SchedulerStats

logger = logging.getLogger(__name__)


class LoggingStatLogger:
    """Accumulates what each batch of core outputs brought and logs one line per interval:

    ``Engine 000: Avg prompt throughput: 812.3 tokens/s, Avg generation throughput: 640.1 tokens/s, Running: 32
    reqs, Waiting: 0 reqs, KV cache usage: 4.1%, Prefix cache hit rate: 12.5%``

    Throughputs are over the time since the previous line; the prefix-cache hit rate is over the lookups since
    then (hit tokens / queried tokens); running, waiting and KV usage are the core's latest.

    Args:
        interval_s: seconds between lines, > 0.
        clock: seconds, monotonic (a parameter for tests).
    """

    def __init__(self, interval_s: float, engine_index: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.engine_index = engine_index
        self.clock = clock
        self.last_log_time = clock()
        self.latest: SchedulerStats | None = None
        self.total_prompt_tokens = 0  # since construction
        self.total_generation_tokens = 0
        self._prompt_tokens = self._generation_tokens = 0  # since the last line
        self._prefix_queries = self._prefix_hits = 0

    def record(self, stats: SchedulerStats | None, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """One batch of core outputs: the scheduler stats it carried, prompt tokens of requests whose first token
        it brought, and the tokens it generated."""
        self._prompt_tokens += num_prompt_tokens
        self._generation_tokens += num_generation_tokens
        self.total_prompt_tokens += num_prompt_tokens
        self.total_generation_tokens += num_generation_tokens
        if stats is not None:
            self.latest = stats
            self._prefix_queries += stats.prefix_cache_queries
            self._prefix_hits += stats.prefix_cache_hits

    def maybe_log(self) -> str | None:
        """Log and return the line when the interval has passed, else None."""
        now = self.clock()
        elapsed = now - self.last_log_time
        if elapsed < self.interval_s:
            return None
        latest = self.latest or SchedulerStats()
        hit_rate = self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0
        line = (
            f"Engine {self.engine_index:03d}: Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {latest.num_running_reqs} reqs, Waiting: {latest.num_waiting_reqs} reqs, "
            f"KV cache usage: {100 * latest.kv_cache_usage:.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%"
        )
        logger.info("%s", line)
        self.last_log_time = now
        self._prompt_tokens = self._generation_tokens = 0
        self._prefix_queries = self._prefix_hits = 0
        return line
