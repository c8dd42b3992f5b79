"""The in-process engine-core client: the one frontend module that imports ``core_svc`` (only when chosen, by
``EngineCoreClient.make_client``).

Requests and outputs cross as the protobuf messages of the wire contract (converted by each side's converter
module), without serialization. ``InprocClient`` runs a core step per ``get_output`` call (for ``LLMEngine``);
``AsyncInprocClient`` runs the core's busy loop on its own thread and hands outputs to the asyncio loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
from typing import Any

from core_svc import errors as core_errors
from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.wire import outputs_to_pb, request_from_pb
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from frontend_svc.errors import EngineDeadError, RequestTooLargeError, ValidationError
from frontend_svc.wire import outputs_from_pb, request_to_pb

logger = logging.getLogger(__name__)


class InprocClient(EngineCoreClient):
    """Owns an ``EngineCore`` in this process."""

    def __init__(self, model: str, **core_config: Any) -> None:
        self.engine_core: EngineCore | None = EngineCore(CoreConfig(model=model, **core_config))

    def _core(self) -> EngineCore:
        if self.engine_core is None:
            raise EngineDeadError("the engine core has been shut down")
        return self.engine_core

    def get_engine_info(self) -> EngineInfo:
        info = self._core().get_engine_info()
        return EngineInfo(
            model=info.model,
            max_model_len=info.max_model_len,
            block_size=info.block_size,
            num_kv_blocks=info.num_kv_blocks,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            max_num_seqs=info.max_num_seqs,
            max_num_batched_tokens=info.max_num_batched_tokens,
            max_logprobs=info.max_logprobs,
            dtype=info.dtype,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        core = self._core()
        try:
            core.add_request(request_from_pb(request_to_pb(request)))
        except core_errors.InvalidRequestError as e:
            raise ValidationError("request", str(e)) from e
        except core_errors.RequestTooLargeError as e:
            raise RequestTooLargeError(str(e)) from e

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._core().abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return outputs_from_pb(outputs_to_pb(self._core().step()))

    def reset_prefix_cache(self) -> bool:
        return self._core().reset_prefix_cache()

    def shutdown(self) -> None:
        if self.engine_core is not None:
            self.engine_core = None
            gc.collect()  # the model and KV cache go now, not at some later collection


class AsyncInprocClient(InprocClient):
    """The core's busy loop on a thread: take commands, step while there is work, post outputs to asyncio.

    The thread starts with the first async call (it needs the running event loop). torch releases the GIL in
    its kernels, so the event loop keeps serving while a step runs.
    """

    def __init__(self, model: str, **core_config: Any) -> None:
        super().__init__(model, **core_config)
        self._commands: queue.Queue[tuple[str, Any, concurrent.futures.Future[Any]]] = queue.Queue()
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._call("add", [request])

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        """Add several requests (n > 1 children) in one command: all or none, never split by an abort."""
        await self._call("add", requests)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await self._call("abort", request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Queue an abort without waiting (from cancellation paths); it runs after every command queued before."""
        if request_ids and not self._stopping.is_set():
            self._commands.put(("abort", request_ids, concurrent.futures.Future()))

    async def reset_prefix_cache_async(self) -> bool:
        return await self._call("reset_prefix_cache", None)

    async def get_output_async(self) -> EngineCoreOutputs:
        outputs = self._ensure_started()
        output = await outputs.get()
        if isinstance(output, BaseException):
            raise output
        return output

    def shutdown(self) -> None:
        """Stop the core thread, fail queued commands and wake the output reader, then free the core."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        self._fail_pending_commands()
        self._post(EngineDeadError("the engine core has been shut down"))
        super().shutdown()

    async def _call(self, command: str, argument: Any) -> Any:
        self._ensure_started()
        if self._stopping.is_set() or self.engine_core is None:
            raise EngineDeadError("the engine core has been shut down")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((command, argument, future))
        return await asyncio.wrap_future(future)

    def _ensure_started(self) -> asyncio.Queue[EngineCoreOutputs | BaseException]:
        """Start the core thread on first use; returns the output queue. A new event loop (a later
        ``asyncio.run``) gets a new queue: outputs go to the loop in use."""
        loop = asyncio.get_running_loop()
        if self._outputs is None or self._loop is not loop:
            self._loop = loop
            self._outputs = asyncio.Queue()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="splitserve-engine-core", daemon=True)
            self._thread.start()
        return self._outputs

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                core = self._core()
                self._handle_commands(block=not core.has_unfinished_requests())
                if core.has_unfinished_requests():
                    outputs = self.get_output()
                    if outputs.outputs or outputs.finished_requests:
                        self._post(outputs)
        except BaseException as e:  # the core failed: every waiting stream must hear of it
            logger.exception("engine core loop died")
            self._stopping.set()
            self._post(EngineDeadError(f"the engine core failed: {e!r}"))
            self._fail_pending_commands()

    def _handle_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command, argument, future = item
            # A cancelled caller no longer wants an add or a reset; an abort runs regardless.
            wanted = future.set_running_or_notify_cancel()
            if wanted or command == "abort":
                try:
                    result = self._execute(command, argument)
                    if wanted:
                        future.set_result(result)
                except Exception as e:
                    if wanted:
                        future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, command: str, argument: Any) -> Any:
        if command == "add":
            added: list[str] = []
            try:
                for request in argument:
                    self.add_request(request)
                    added.append(request.request_id)
            except Exception:
                self.abort_requests(added)
                raise
            return None
        if command == "abort":
            return self.abort_requests(argument)
        return self.reset_prefix_cache()

    def _post(self, item: EngineCoreOutputs | BaseException) -> None:
        if self._loop is not None and self._outputs is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, item)

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the engine core has stopped"))
