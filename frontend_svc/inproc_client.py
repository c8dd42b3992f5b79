"""The in-process engine-core client: the one frontend module that imports ``core_svc`` (only when chosen, by
``EngineCoreClient.make_client``).

Requests and outputs cross as the protobuf messages of the wire contract (converted by each side's converter
module), without serialization. ``InprocClient`` runs a core step per ``get_output`` call (for ``LLMEngine``);
``AsyncInprocClient`` runs the core on ``core_svc.engine_loop.EngineLoop``'s thread, as the core server does,
and hands outputs to the asyncio loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
from typing import Any

from core_svc import errors as core_errors
from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.outputs import EngineCoreOutputs as CoreOutputs
from core_svc.wire import engine_info_to_pb, outputs_to_pb, request_from_pb
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from frontend_svc.errors import EngineDeadError, RequestTooLargeError, ValidationError
from frontend_svc.wire import engine_info_from_pb, outputs_from_pb, request_to_pb


def _frontend_error(error: BaseException) -> BaseException:
    if isinstance(error, core_errors.InvalidRequestError):
        return ValidationError("request", str(error))
    if isinstance(error, core_errors.RequestTooLargeError):
        return RequestTooLargeError(str(error))
    if isinstance(error, RuntimeError):
        return EngineDeadError(str(error))
    return error


class InprocClient(EngineCoreClient):
    """Owns an ``EngineCore`` in this process."""

    def __init__(self, model: str, **core_config: Any) -> None:
        self.engine_core: EngineCore | None = EngineCore(CoreConfig(model=model, **core_config))

    def _core(self) -> EngineCore:
        if self.engine_core is None:
            raise EngineDeadError("the engine core has been shut down")
        return self.engine_core

    def get_engine_info(self) -> EngineInfo:
        return engine_info_from_pb(engine_info_to_pb(self._core().get_engine_info()))

    def add_request(self, request: EngineCoreRequest) -> None:
        try:
            self._core().add_request(request_from_pb(request_to_pb(request)))
        except core_errors.EngineError as e:
            raise _frontend_error(e) from e

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
    """The core on its own thread; outputs posted to the asyncio loop that uses the client (a later
    ``asyncio.run`` gets them on its own loop). torch releases the GIL in its kernels, so the event loop keeps
    serving while a step runs."""

    def __init__(self, model: str, **core_config: Any) -> None:
        super().__init__(model, **core_config)
        self._engine_loop = EngineLoop(self._core(), lambda e: 0)
        self._client_index = self._engine_loop.register_client(self._sink)
        self._engine_loop.on_death(lambda e: self._post(EngineDeadError(f"the engine core failed: {e!r}")))
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine_loop.start()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([request])

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self._bind_loop()
        core_requests = [request_from_pb(request_to_pb(r)) for r in requests]
        await self._wait(self._engine_loop.add_requests(self._client_index, core_requests))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            # Shielded: an abort must reach the core even if its caller is cancelled meanwhile.
            await asyncio.shield(self._wait(self._engine_loop.abort_requests(request_ids)))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids:
            self._engine_loop.abort_requests(request_ids)

    async def reset_prefix_cache_async(self) -> bool:
        return await self._wait(self._engine_loop.call(lambda core: core.reset_prefix_cache()))

    async def get_output_async(self) -> EngineCoreOutputs:
        output = await self._bind_loop().get()
        if isinstance(output, BaseException):
            raise output
        return output

    def shutdown(self) -> None:
        self._engine_loop.stop()
        self._post(EngineDeadError("the engine core has been shut down"))
        super().shutdown()

    def _bind_loop(self) -> asyncio.Queue[EngineCoreOutputs | BaseException]:
        loop = asyncio.get_running_loop()
        if self._outputs is None or self._loop is not loop:
            self._loop, self._outputs = loop, asyncio.Queue()
        return self._outputs

    async def _wait(self, future: concurrent.futures.Future[Any]) -> Any:
        if self._engine_loop.dead_error is not None or self.engine_core is None:
            future.cancel()
            raise EngineDeadError("the engine core has stopped")
        try:
            return await asyncio.wrap_future(future)
        except core_errors.EngineError as e:
            raise _frontend_error(e) from e
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from e

    def _sink(self, outputs: CoreOutputs) -> None:  # on the engine thread
        self._post(outputs_from_pb(outputs_to_pb(outputs)))

    def _post(self, item: EngineCoreOutputs | BaseException) -> None:
        loop, queue = self._loop, self._outputs
        if loop is not None and queue is not None and not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, item)
