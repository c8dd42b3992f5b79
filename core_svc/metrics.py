"""The core's Prometheus metrics: the engine's state and each request's time in it (vLLM v1's names from
``vllm/v1/metrics/loggers.py``, prefixed ``splitserve:``, labels ``model_name`` and ``engine``).

The frontend exports what the client saw (``frontend_svc/stat_logger.py``); ``docs/observability.md`` has
both lists. Two counters have no vLLM name, because the frontend holds vLLM's ``generation_tokens`` and
``request_success``: ``core_generation_tokens`` and ``core_request_finished`` count the same things as the core
sees them (a request a stop string ended is an abort here). Two more export what vLLM keeps in its
``PrefixCacheStats`` without exporting: ``prefix_cache_preempted_queries`` / ``_hits``, the lookups of requests
admitted again after a preemption, which ``prefix_cache_queries`` / ``_hits`` leave out as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from core_svc.outputs import SchedulerStats
from core_svc.stats import CoreRequestStats
from splitserve.base import metrics

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's sleep_state label values, by sleep level


class CoreMetrics:
    """A ``StatsSink`` that updates Prometheus metrics. Units: seconds, tokens; KV usage as a fraction in [0, 1]
    (vLLM's ``kv_cache_usage_perc`` is a fraction too, despite its name).

    Args:
        registry: where the metrics are registered (one per core).
        model_name: the model the core serves: ``--served-model-name``, else ``--model`` as given.
        max_model_len, max_num_batched_tokens: upper ends of the token-count buckets.
        sleep_level: the core's sleep level now (0 awake, 1, 2), read at each scrape for vLLM's
            ``engine_sleep_state`` gauge (None: the gauge is not exported).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        max_model_len: int,
        max_num_batched_tokens: int,
        engine_index: int = 0,
        sleep_level: Callable[[], int] | None = None,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        m = metrics.LabelledMetrics(registry, model_name, engine_index)
        if cache_config is not None:
            # vLLM's cache_config_info: the KV cache's settings as labels of a gauge of 1
            m.info("cache_config_info", "The KV cache's settings (labels; the value is 1).", cache_config)
        if sleep_level is not None:
            # vLLM's engine_sleep_state: 1 on the label of the state the core is in, 0 on the others.
            sleep_states = m.gauges_by(
                "engine_sleep_state",
                "Sleep mode: 1 for the state the engine core is in (awake; weights_offloaded: level 1; discard_all: "
                "level 2), 0 for the others.",
                "sleep_state",
                SLEEP_STATES,
            )
            for level, state in enumerate(SLEEP_STATES):
                sleep_states[state].set_function(_is_level(sleep_level, level))
        self.num_requests_running = m.gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = m.gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = m.gauge("kv_cache_usage_perc", "Fraction of usable KV-cache blocks in use, [0, 1].")
        self.num_preemptions = m.counter("num_preemptions", "Preemptions (recompute).")
        self.prefix_cache_queries = m.counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache by requests admitted for the first time."
        )
        self.prefix_cache_hits = m.counter(
            "prefix_cache_hits", "Tokens found in the prefix cache by requests admitted for the first time."
        )
        self.prefix_cache_preempted_queries = m.counter(
            "prefix_cache_preempted_queries",
            "Tokens looked up in the prefix cache by requests admitted again after a preemption.",
        )
        self.prefix_cache_preempted_hits = m.counter(
            "prefix_cache_preempted_hits",
            "Tokens found in the prefix cache by requests admitted again after a preemption.",
        )
        by_source = m.counters_by(
            "prompt_tokens_by_source",
            "Prompt tokens of requests that got a first token: computed, or served from the prefix cache.",
            "source",
            ["local_compute", "local_cache_hit"],
        )
        self.prompt_tokens_computed = by_source["local_compute"]
        self.prompt_tokens_cached = by_source["local_cache_hit"]
        self.generation_tokens = m.counter("core_generation_tokens", "Tokens the core generated.")
        self.request_finished = m.counters_by(
            "core_request_finished",
            "Requests that left the core, by the core's finish reason.",
            "finished_reason",
            metrics.FINISHED_REASONS,
        )
        self.iteration_tokens = m.histogram(
            "iteration_tokens_total",
            "Tokens per engine step: the prompts that got their first token, and the tokens generated (vLLM's).",
            metrics.iteration_tokens_buckets(max_num_batched_tokens),
        )
        latency = metrics.REQUEST_LATENCY_BUCKETS
        self.queue_time = m.histogram("request_queue_time_seconds", "Queued to first scheduled.", latency)
        self.prefill_time = m.histogram("request_prefill_time_seconds", "First scheduled to first token.", latency)
        self.decode_time = m.histogram("request_decode_time_seconds", "First token to last token.", latency)
        self.inference_time = m.histogram("request_inference_time_seconds", "First scheduled to last token.", latency)
        self.prefill_kv_computed = m.histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens computed (not served from the prefix cache), per request that got a first token.",
            metrics.build_1_2_5_buckets(max_model_len),
        )

    def record_step(
        self,
        num_scheduled_tokens: int,
        scheduler_stats: SchedulerStats | None,
        num_generation_tokens: int,
        prefilled: list[CoreRequestStats],
        finished: list[CoreRequestStats],
    ) -> None:
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running_reqs)
            self.num_requests_waiting.set(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.num_preemptions.inc(scheduler_stats.num_preemptions)
            prefix = scheduler_stats.prefix_cache_stats
            self.prefix_cache_queries.inc(prefix.queries)
            self.prefix_cache_hits.inc(prefix.hits)
            self.prefix_cache_preempted_queries.inc(prefix.preempted_queries)
            self.prefix_cache_preempted_hits.inc(prefix.preempted_hits)
        # vLLM's count: the prompts that got their first token this step, whole, and the tokens generated
        iteration_tokens = num_generation_tokens + sum(stats.num_prompt_tokens for stats in prefilled)
        if num_scheduled_tokens or iteration_tokens:
            self.iteration_tokens.observe(iteration_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        for stats in prefilled:
            computed = stats.num_prompt_tokens - stats.num_cached_tokens
            self.prompt_tokens_computed.inc(computed)
            self.prompt_tokens_cached.inc(stats.num_cached_tokens)
            self.prefill_kv_computed.observe(computed)
        for stats in finished:
            self.request_finished[str(stats.finish_reason)].inc()
            self.queue_time.observe(stats.queued_time)
            self.prefill_time.observe(stats.prefill_time)
            self.decode_time.observe(stats.decode_time)
            self.inference_time.observe(stats.inference_time)


def _is_level(sleep_level: Callable[[], int], level: int) -> Callable[[], float]:
    """1.0 while ``sleep_level()`` is ``level``, else 0.0 (read at each scrape)."""
    return lambda: float(sleep_level() == level)
