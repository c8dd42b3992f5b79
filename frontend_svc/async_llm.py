"""``AsyncLLM``: the asyncio engine API (vLLM ``vllm/v1/engine/async_llm.py``). ``generate`` is an async
iterator of ``RequestOutput``; cancelling it aborts the request (all n children) in the core."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreRequest, LoRARequest, SchedulerStats
from frontend_svc.errors import EngineDeadError, NotFoundError, ValidationError
from frontend_svc.generation_config import AUTO
from frontend_svc.input_processor import PromptType, RequestOptions, TokensPrompt
from frontend_svc.llm_engine import LLMEngineBase, resolved_sampling_params
from frontend_svc.output_processor import OutputProcessor, PoolingOutputCollector, RequestOutputCollector
from frontend_svc.outputs import PoolingRequestOutput, RequestOutput
from frontend_svc.parallel_sampling import ParentRequest
from frontend_svc.sampling_params import SamplingParams
from frontend_svc.stat_logger import LoggingStatLogger, StatLogger
from frontend_svc.stats import IterationStats
from splitserve.base import envs
from splitserve.base.pooling_params import PoolingParams

logger = logging.getLogger(__name__)
# Outputs processed between yields to the event loop (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE); also the n > 1
# children registered, and aborted with their outputs built, between yields.
OUTPUT_CHUNK_SIZE = 128


@dataclass
class _HandlerState:
    """Shared by AsyncLLM and its output-handler task; the task holds no reference to the AsyncLLM, so an
    unclosed AsyncLLM can still be garbage-collected (and its core freed)."""

    dead_error: BaseException | None = None
    stat_loggers: list[StatLogger] = field(default_factory=list)
    log_interval_s: float = 0.0  # > 0: also call every logger's log() this often, traffic or not

    def record(self, iteration_stats: IterationStats, scheduler_stats: SchedulerStats | None = None) -> None:
        """Feed every stat logger. A logger that fails is logged and dropped: statistics never stop serving."""
        for stat_logger in list(self.stat_loggers):
            try:
                stat_logger.record(scheduler_stats, iteration_stats)
                stat_logger.log()
            except Exception:
                self._drop(stat_logger)

    def log(self) -> None:
        for stat_logger in list(self.stat_loggers):
            try:
                stat_logger.log()
            except Exception:
                self._drop(stat_logger)

    def _drop(self, stat_logger: StatLogger) -> None:
        logger.exception("stat logger %s failed; it is turned off", type(stat_logger).__name__)
        self.stat_loggers.remove(stat_logger)


class AsyncLLM(LLMEngineBase):
    """Asyncio engine: a background task turns core outputs into per-request outputs.

    Args: as ``LLMEngine`` (``generation_config`` too), and
        stat_loggers: fed after every batch of core outputs (the server passes its ``PrometheusStatLogger``),
            beside the periodic log line (every ``SPLITSERVE_LOG_STATS_INTERVAL`` seconds; <= 0 turns it off).
    """

    def __init__(
        self,
        model: str,
        core_address: str | None = None,
        tokenizer: Any = None,
        stat_loggers: list[StatLogger] | None = None,
        generation_config: str = AUTO,
        **core_config: Any,
    ) -> None:
        super().__init__(model, core_address, tokenizer, True, core_config, generation_config)
        self._output_handler: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # aborts of cancelled streams, running in chunks
        interval = envs.log_stats_interval()
        loggers: list[StatLogger] = [LoggingStatLogger(interval)] if interval > 0 else []
        self._handler_state = _HandlerState(stat_loggers=loggers + list(stat_loggers or []), log_interval_s=interval)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        trace_headers: dict[str, str] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Queue a request; its outputs arrive on the returned collector (``collector.request_id`` is the
        internal id). Arguments after ``arrival_time`` are keywords, as in vLLM's ``add_request``.
        ``lora_request``: the LoRA adapter to generate with; one not loaded yet is loaded from its ``lora_path``
        first (vLLM loads adapters on demand).

        Raises:
            ValidationError, RequestTooLargeError, NotFoundError: the request is refused (nothing stays queued).
            EngineDeadError: the core has failed or was shut down.
        """
        given: object = params  # what the caller passed: before anything is queued (PoolingParams has no output_kind)
        if not isinstance(given, SamplingParams):
            hint = " (use encode)" if isinstance(given, PoolingParams) else ""
            raise ValidationError("sampling_params", f"must be SamplingParams, got {type(given).__name__}{hint}")
        arrival_time = time.time() if arrival_time is None else arrival_time  # before tokenizing: TTFT counts it
        dead = self._handler_state.dead_error
        if dead is not None:
            raise EngineDeadError(f"the engine core has failed: {dead}")
        self._ensure_output_handler()
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            # Images decode and resize on a worker thread, with the prompt's tokenizing.
            prompt = await self.input_processor.process_multimodal_async(prompt)
        elif not isinstance(prompt, list | tuple) and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            # Tokenizing a long text takes CPU time (not on the event loop) and memory (within the tokenize budget).
            text, token_ids = await self.input_processor.tokenize_async(prompt)
            prompt = (
                TokensPrompt(prompt_token_ids=token_ids)
                if text is None
                else TokensPrompt(prompt=text, prompt_token_ids=token_ids)
            )
        queue = RequestOutputCollector(params.output_kind)
        options = RequestOptions(arrival_time, priority, cache_salt, trace_headers, lora_request)
        internal_id, request, prompt_text = self.process_request(request_id, prompt, params, options)
        if lora_request is not None and lora_request.lora_path:
            await self.engine_core.add_lora_async(lora_request)  # the adapter as loaded: a no-op
        queue.request_id = internal_id
        requests: list[EngineCoreRequest] = []  # every one registered (abortable) before any is sent
        try:
            if params.n == 1:
                requests.append(self.register_request(request, request_id, prompt_text, queue))
            else:
                parent = ParentRequest(internal_id, request_id, resolved_sampling_params(request))
                for index in range(params.n):
                    if index and index % OUTPUT_CHUNK_SIZE == 0:
                        await asyncio.sleep(0)  # 16384 children: the event loop runs between chunks
                    requests.append(self.add_child(parent, request, prompt_text, index, queue))
            await self.engine_core.add_requests_async(requests)
        except BaseException:
            # Refused, or cancelled while the core may be adding them: take back whatever got in (the abort
            # reaches the core after the add), and forget them all here.
            queue.close()
            self.engine_core.abort_requests_nowait([r.request_id for r in requests])
            self.release_failed(requests)
            raise
        return queue

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        trace_headers: dict[str, str] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as they come (per ``sampling_params.output_kind``); the last has finished=True.
        Arguments after ``request_id`` are keywords, as in vLLM's ``AsyncLLM.generate``.

        Cancelling the consumer (or closing the generator early) aborts this request, and only this one, in the
        core. ``trace_headers`` (W3C ``traceparent`` / ``tracestate``) go to the core with the request, which
        traces it as their child.
        """
        queue: RequestOutputCollector | None = None
        finished = False
        try:
            queue = await self.add_request(
                request_id,
                prompt,
                sampling_params,
                trace_headers=trace_headers,
                priority=priority,
                cache_salt=cache_salt,
                lora_request=lora_request,
            )
            while not finished:
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if queue is not None and not finished:
                queue.close()  # nobody reads it now: no abort outputs are built for it
                self._abort_nowait([queue.request_id])
            raise

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        trace_headers: dict[str, str] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (vLLM's ``AsyncLLM.encode``): yields its one ``PoolingRequestOutput`` when it
        finishes (``outputs.data``: the pooled vector). Cancelling the consumer aborts it in the core.
        ``lora_request``: the LoRA adapter to pool with (loaded first when it has a ``lora_path``, as ``generate``).

        Raises:
            ValidationError, RequestTooLargeError: the request is refused, naming the field.
            EngineDeadError: the core has failed or was shut down.
        """
        arrival_time = time.time()
        dead = self._handler_state.dead_error
        if dead is not None:
            raise EngineDeadError(f"the engine core has failed: {dead}")
        self._ensure_output_handler()
        if not isinstance(prompt, list | tuple) and not (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            text, token_ids = await self.input_processor.tokenize_async(prompt)
            prompt = (
                TokensPrompt(prompt_token_ids=token_ids)
                if text is None
                else TokensPrompt(prompt=text, prompt_token_ids=token_ids)
            )
        queue = PoolingOutputCollector()
        options = RequestOptions(arrival_time, priority, None, trace_headers, lora_request)
        internal_id, request = self.prepare_pooling_request(request_id, prompt, pooling_params, options, queue)
        queue.request_id = internal_id
        finished = False
        try:
            if lora_request is not None and lora_request.lora_path:
                await self.engine_core.add_lora_async(lora_request)  # the adapter as loaded: a no-op
            await self.engine_core.add_requests_async([request])
            output = await queue.get()
            finished = True
            yield output
        except BaseException:
            if not finished:
                queue.close()
                self._abort_nowait([internal_id])
            raise

    async def abort(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Abort by the caller's ids (all n children) or by internal ids (a parent's covers its children);
        unknown ids are ignored. Returns once the core has aborted them. The core hears of it first; the
        streams' abort outputs are built meanwhile (``_finish_aborted``)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        internal_ids = self.output_processor.internal_ids(ids, internal)
        core_abort = None
        if internal_ids and self._handler_state.dead_error is None:
            core_abort = asyncio.ensure_future(self.engine_core.abort_requests_async(internal_ids))
        await self._finish_aborted(internal_ids)
        if core_abort is not None:
            await core_abort

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    async def start_profile(self, output_dir: str | None = None) -> None:
        """vLLM's ``AsyncLLM.start_profile``: torch.profiler records the core's steps until ``stop_profile``."""
        await self.engine_core.start_profile_async(output_dir)

    async def stop_profile(self) -> list[str]:
        """Stop the profile: the Chrome traces written, one per core."""
        return await self.engine_core.stop_profile_async()

    async def sleep(self, level: int = 1, drain: bool = False) -> None:
        """Put the engine core(s) to sleep, as ``LLMEngine.sleep``: the streams of requests in flight end with
        ``EngineDeadError`` (UNAVAILABLE), or, with ``drain``, finish first; returns once the cores sleep. A
        caller that gives up (its task cancelled, ``asyncio.wait_for``) calls nothing off: the cores the call
        reached drain and sleep. Several cores: as ``LLMEngine.sleep`` (not atomic; cores not connected at the
        call are skipped).

        Raises:
            ValidationError, NotSupportedError, EngineDeadError: as ``LLMEngine.sleep``.
        """
        await self.engine_core.sleep_async(level, drain)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """As ``LLMEngine.wake_up``."""
        await self.engine_core.wake_up_async(tags)

    async def is_sleeping(self) -> bool:
        """As ``LLMEngine.is_sleeping``."""
        return await self.engine_core.is_sleeping_async()

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter on the core (vLLM's ``AsyncLLM.add_lora``); its files are read off the core's
        engine thread. True once loaded (also when it already was). Raises as ``LLMEngine.add_lora``."""
        await self.engine_core.add_lora_async(lora_request)
        return True

    async def remove_lora(self, lora_id: int | str) -> bool:
        """Unload an adapter by name or int id; False when no such adapter is loaded."""
        name = lora_id if isinstance(lora_id, str) else None
        if name is None:
            loras = await self.engine_core.list_loras_async()
            name = next((lora.lora_name for lora in loras if lora.lora_int_id == lora_id), None)
            if name is None:
                return False
        try:
            await self.engine_core.remove_lora_async(name)
        except NotFoundError:
            return False
        return True

    async def list_loras(self) -> set[int]:
        """The int ids of the loaded adapters (vLLM's ``list_loras``)."""
        return {lora.lora_int_id for lora in await self.engine_core.list_loras_async()}

    async def get_loras(self) -> list[LoRARequest]:
        """The loaded adapters, whole (name, int id, folder; over several cores each name once); none when the core
        runs without ``--enable-lora``. Raises EngineDeadError when no core is reachable."""
        if not self.engine_info.supports_lora:
            return []
        return await self.engine_core.list_loras_async()

    # vLLM's AsyncLLM state queries.
    @property
    def dead_error(self) -> BaseException | None:
        """The error that ended the engine (its core failed or is gone, or it was closed); None while it runs."""
        return self._handler_state.dead_error

    @property
    def errored(self) -> bool:
        return self._handler_state.dead_error is not None

    @property
    def is_running(self) -> bool:
        return self._handler_state.dead_error is None

    @property
    def is_stopped(self) -> bool:
        return self.errored

    async def check_health(self) -> None:
        """vLLM's: raises the engine's ``dead_error`` (EngineDeadError) once it has failed or been closed."""
        if self._handler_state.dead_error is not None:
            raise self._handler_state.dead_error

    def get_num_unfinished_requests(self) -> int:
        """Requests in flight (each of an n > 1 request's completions counts)."""
        return len(self.output_processor.request_states)

    def shutdown(self) -> None:
        """vLLM's name of ``close``."""
        self.close()

    def close(self) -> None:
        """Shut the core down; every stream still waiting ends with EngineDeadError."""
        error = EngineDeadError("the engine was closed")
        self._handler_state.dead_error = self._handler_state.dead_error or error
        _fail_streams(self.output_processor, error)
        if self._output_handler is not None:
            self._output_handler.cancel()
        super().close()

    def _abort_nowait(self, internal_ids: list[str]) -> None:
        """Abort from a synchronous context (a cancelled ``generate``, whose stream is closed: no outputs are
        built). The core hears of it now; on a running event loop the frontend's bookkeeping (a quarter of a
        second for 16384 children) runs as a task, in chunks; without one (the loop is closing), here."""
        ids = self.output_processor.internal_ids(internal_ids, internal=True)
        if ids and self._handler_state.dead_error is None:
            self.engine_core.abort_requests_nowait(ids)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None and not loop.is_closed():
            task = loop.create_task(self._finish_aborted(ids))
            self._background.add(task)  # keep a reference until it is done
            task.add_done_callback(self._background.discard)
            return
        iteration_stats = IterationStats()
        self.output_processor.finish_aborted(ids, iteration_stats)
        self._handler_state.record(iteration_stats)

    async def _finish_aborted(self, internal_ids: list[str]) -> None:
        """End aborted requests in the output processor (their abort outputs, their stats), ``OUTPUT_CHUNK_SIZE``
        at a time, the event loop running between chunks."""
        iteration_stats = IterationStats()
        for start in range(0, len(internal_ids), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            self.output_processor.finish_aborted(internal_ids[start : start + OUTPUT_CHUNK_SIZE], iteration_stats)
        self._handler_state.record(iteration_stats)

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        handler = self._output_handler
        if handler is None or handler.done() or handler.get_loop() is not loop:
            self._output_handler = loop.create_task(
                _run_output_handler(self.engine_core, self.output_processor, self._handler_state)
            )


async def _run_output_handler(
    engine_core: EngineCoreClient, output_processor: OutputProcessor, state: _HandlerState
) -> None:
    """Pull core outputs, turn them into request outputs (in chunks, yielding between), abort what stop strings
    ended. If the core fails, every waiting stream gets the error. Beside it, a timer lets the stat loggers log
    while no outputs come (the last window of a burst, idle lines), as vLLM's periodic log task does."""
    timer = asyncio.get_running_loop().create_task(_log_periodically(state)) if state.log_interval_s > 0 else None
    try:
        while True:
            core_outputs = await engine_core.get_output_async()
            outputs = core_outputs.outputs
            iteration_stats = IterationStats()  # always: RequestOutput.metrics and the request's span use it
            for start in range(0, len(outputs), OUTPUT_CHUNK_SIZE):
                processed = output_processor.process_outputs(
                    outputs[start : start + OUTPUT_CHUNK_SIZE], core_outputs.timestamp, iteration_stats
                )
                if processed.reqs_to_abort:
                    engine_core.abort_requests_nowait(processed.reqs_to_abort)
                await asyncio.sleep(0)
            state.record(iteration_stats, core_outputs.scheduler_stats)
    except Exception as e:
        if not isinstance(e, EngineDeadError):
            logger.exception("output handler failed")
        # Callers get the fault's message, never its Python class (the log above has both, and the traceback).
        error = (
            e
            if isinstance(e, EngineDeadError)
            else EngineDeadError(f"the engine failed: {e}" if str(e) else "the engine failed")
        )
        state.dead_error = error
        _fail_streams(output_processor, error)
    finally:
        if timer is not None:
            timer.cancel()


async def _log_periodically(state: _HandlerState) -> None:
    while True:
        await asyncio.sleep(state.log_interval_s)
        state.log()


def _fail_streams(output_processor: OutputProcessor, error: Exception) -> None:
    for request_state in list(output_processor.request_states.values()):
        if request_state.queue is not None:
            request_state.queue.put(error)
    output_processor.request_states.clear()
    output_processor.external_req_ids.clear()
    output_processor.parent_requests.clear()
