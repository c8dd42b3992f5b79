"""``AsyncLLM``: the asyncio engine API (vLLM ``vllm/v1/engine/async_llm.py``). ``generate`` is an async
iterator of ``RequestOutput``; cancelling it aborts the request (all n children) in the core."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from frontend_svc.errors import EngineDeadError
from frontend_svc.input_processor import PromptType
from frontend_svc.llm_engine import EngineFrontend
from frontend_svc.output_processor import RequestOutputCollector
from frontend_svc.outputs import RequestOutput
from frontend_svc.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# Outputs processed between yields to the event loop (vLLM's VLLM_V1_OUTPUT_PROC_CHUNK_SIZE).
OUTPUT_CHUNK_SIZE = 128


class AsyncLLM(EngineFrontend):
    """Asyncio engine: a background task turns core outputs into per-request outputs.

    Args: as ``LLMEngine``.
    """

    def __init__(
        self, model: str, core_address: str | None = None, tokenizer: str | None = None, **core_config: Any
    ) -> None:
        super().__init__(model, core_address, tokenizer, asyncio_mode=True, core_config=core_config)
        self._output_handler: asyncio.Task[None] | None = None
        self._dead_error: BaseException | None = None

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> RequestOutputCollector:
        """Queue a request; its outputs arrive on the returned collector.

        Raises:
            ValidationError, RequestTooLargeError: the request is refused (nothing stays queued).
            EngineDeadError: the core has failed.
        """
        if self._dead_error is not None:
            raise EngineDeadError(f"the engine core has failed: {self._dead_error}")
        self._ensure_output_handler()
        queue = RequestOutputCollector(params.output_kind)
        _, requests = self.prepare_requests(request_id, prompt, params, arrival_time, priority, queue)
        added: list[str] = []
        try:
            for request in requests:
                await self.engine_core.add_request_async(request)
                added.append(request.request_id)
        except BaseException:
            await self.engine_core.abort_requests_async(added)
            self.release_failed(requests)
            raise
        return queue

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as they come (per ``sampling_params.output_kind``); the last has finished=True.

        Cancelling the consumer (or closing the generator) aborts the request in the core.
        """
        queue: RequestOutputCollector | None = None
        try:
            queue = await self.add_request(request_id, prompt, sampling_params, priority=priority)
            finished = False
            while not finished:
                output = queue.get_nowait() or await queue.get()
                finished = output.finished
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            if queue is not None:
                await self.abort(request_id)
            raise

    async def abort(self, request_ids: str | Iterable[str], internal: bool = False) -> None:
        """Abort by the caller's ids (all n children) or by internal ids; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        internal_ids = self.output_processor.abort_requests(ids, internal)
        if internal_ids and self._dead_error is None:
            await self.engine_core.abort_requests_async(internal_ids)

    async def reset_prefix_cache(self) -> bool:
        return await self.engine_core.reset_prefix_cache_async()

    def _ensure_output_handler(self) -> None:
        if self._output_handler is None:
            self._output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                chunks = outputs.outputs
                for start in range(0, len(chunks), OUTPUT_CHUNK_SIZE):
                    processed = self.output_processor.process_outputs(chunks[start : start + OUTPUT_CHUNK_SIZE])
                    if processed.reqs_to_abort:
                        await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                    await asyncio.sleep(0)  # let consumers run between chunks
        except Exception as e:
            logger.exception("output handler failed")
            self._dead_error = e
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine failed: {e!r}")
            for state in list(self.output_processor.request_states.values()):
                if state.queue is not None:
                    state.queue.put(error)
            self.output_processor.request_states.clear()
            self.output_processor.external_req_ids.clear()

    def close(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        super().close()
