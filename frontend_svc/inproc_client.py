"""The in-process engine-core client: the one frontend module that imports ``core_svc``, lazily, when
``core_client_factory.make_client`` chooses it (the import is inside the constructor).

It talks to the core's in-process edge, ``core_svc.inproc.InprocCore``, in the same protobuf messages (refusals as
``RequestError``) as the gRPC client, so a refusal reads the same either way. ``InprocClient`` runs a core step per
``get_output`` call (for ``LLMEngine``); ``AsyncInprocClient`` runs the core on its engine-loop thread, as the
core server does, and hands outputs to the asyncio loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from collections.abc import Callable
from typing import Any

from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreOutputs, EngineCoreRequest, EngineInfo, LoRARequest
from frontend_svc.errors import EngineDeadError
from frontend_svc.wire import (
    engine_info_from_pb,
    error_from_pb,
    lora_request_from_pb,
    lora_request_to_pb,
    outputs_from_pb,
    request_to_pb,
)
from splitserve.base.thread_handoff import ThreadToLoopQueue
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb

# Requests converted to protobuf between yields to the event loop (about 1 ms of work).
CONVERT_CHUNK_SIZE = 128


class InprocClient(EngineCoreClient):
    """Owns an engine core in this process."""

    def __init__(self, model: str, **core_config: Any) -> None:
        from splitserve.base import cpu_threads, envs

        # Before core_svc imports torch, whose OpenMP runtime reads its wait policy once, when loaded.
        bind = core_config.get("cpu_omp_threads_bind")
        if bind is None:
            cpu_threads.prepare_process(envs.omp_wait_policy(), envs.cpu_omp_threads_bind())
        else:
            cpu_threads.prepare_process(envs.omp_wait_policy(), bind, "cpu_omp_threads_bind")
        from core_svc.inproc import InprocCore, RefusedError

        self._refused_error = RefusedError
        self._core_edge: InprocCore | None = InprocCore(model, **core_config)
        # The EngineCore itself, for introspection and tests (Any: core_svc is imported here only, lazily).
        self.engine_core: Any = self._core_edge.engine_core

    def _edge(self) -> Any:
        if self._core_edge is None:
            raise EngineDeadError("the engine core has been shut down")
        return self._core_edge

    def get_engine_info(self) -> EngineInfo:
        return engine_info_from_pb(self._edge().get_engine_info())

    def add_request(self, request: EngineCoreRequest) -> None:
        try:
            self._edge().add_request(request_to_pb(request))
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._edge().abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        try:
            return outputs_from_pb(self._edge().step())
        except self._refused_error as e:  # the core was declared dead
            raise error_from_pb(e.error) from e

    def reset_prefix_cache(self) -> bool:
        return self._edge().reset_prefix_cache()

    def start_profile(self, output_dir: str | None = None) -> None:
        try:
            self._edge().start_profile(output_dir)
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def stop_profile(self) -> list[str]:
        try:
            return [self._edge().stop_profile()]
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def sleep(self, level: int = 1, drain: bool = False) -> None:
        try:
            self._edge().sleep(level, drain)
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def wake_up(self, tags: list[str] | None = None) -> None:
        try:
            self._edge().wake_up(tags)
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def is_sleeping(self) -> bool:
        return bool(self._edge().is_sleeping())

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        try:
            return lora_request_from_pb(self._edge().add_lora(lora_request_to_pb(lora_request)))
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def remove_lora(self, lora_name: str) -> None:
        try:
            self._edge().remove_lora(lora_name)
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def list_loras(self) -> list[LoRARequest]:
        try:
            return [lora_request_from_pb(r) for r in self._edge().list_loras()]
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def shutdown(self) -> None:
        if self._core_edge is not None:
            self._core_edge.shutdown()
            self._core_edge = None
            self.engine_core = None
            gc.collect()  # the model and KV cache go now, not at some later collection


class AsyncInprocClient(InprocClient):
    """The core on its own thread; outputs posted to the asyncio loop that uses the client (a later
    ``asyncio.run`` gets them on its own loop). torch releases the GIL in its kernels, so the event loop keeps
    serving while a step runs."""

    def __init__(self, model: str, **core_config: Any) -> None:
        super().__init__(model, **core_config)
        self._outputs: ThreadToLoopQueue[EngineCoreOutputs] = ThreadToLoopQueue()
        self._death_lock = threading.Lock()
        self._death_listeners: list[Callable[[BaseException], None]] = []
        self.dead_error: BaseException | None = None  # why the core's engine loop died, once it has
        self._availability_listeners: list[Callable[[bool], None]] = []
        self._available = True  # the core takes requests: neither asleep nor draining to sleep
        self._availability_lock = threading.Lock()
        self._edge().start_engine_loop(self._sink, self._on_core_death)

    def is_available(self) -> bool:
        """The core takes requests: it is neither asleep nor draining to sleep (as the gRPC client's: a core whose
        readiness is SERVING). False from the start of a sleep through this client until a wake-up restores it."""
        return self._available

    def unavailable_reason(self) -> str:
        refusal = self.engine_core.refusal
        return (
            str(refusal)
            if refusal is not None
            else "the engine core is sleeping: it takes requests again after wake_up"
        )

    def add_availability_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(available)`` on each change through a sleep or wake-up (``serve``'s readiness): False as a
        sleep starts (its drain included), then the core's state once the engine thread has run it, or a wake-up.
        Called on the caller's thread or on the engine thread; it must not block."""
        self._availability_listeners.append(listener)

    def _refresh_availability(self) -> None:
        """Availability from the core's state, after a sleep or a wake-up has run (on the engine thread, not from
        the coroutine awaiting it, whose caller may have given up meanwhile)."""
        core = self.engine_core
        with self._availability_lock:
            self._set_available(not core.is_sleeping() and core.refusal is None)

    def _set_available(self, available: bool) -> None:  # with _availability_lock held
        if available != self._available:
            self._available = available
            for listener in self._availability_listeners:
                listener(available)

    def _submit_sleep(self, edge: Any, level: int, drain: bool) -> concurrent.futures.Future[Any]:
        """Unavailable from the sleep's start (a drain refuses new requests at once, as a core server's readiness
        goes NOT_SERVING), then as the core is once the sleep has run or failed; a refused level changes nothing."""
        return edge.submit_sleep(level, drain, on_start=self._mark_unavailable, on_done=self._refresh_availability)

    def _mark_unavailable(self) -> None:
        with self._availability_lock:
            self._set_available(False)

    def add_death_listener(self, listener: Callable[[BaseException], None]) -> None:
        """``listener(error)`` once, when the core's engine loop dies (declared dead, or any fault on its
        thread): on that thread, or at once here if it already has. A shutdown is no death."""
        with self._death_lock:
            self._death_listeners.append(listener)
            error = self.dead_error
        if error is not None:
            listener(error)

    def observe_core(self, model_name: str, registry: Any | None, tracer_provider: Any | None) -> None:
        """Give the core its Prometheus metrics (in ``registry``) and request spans (from ``tracer_provider``);
        None leaves either off."""
        self._wait_sync(lambda edge: edge.submit_observe(model_name, registry, tracer_provider))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([request])

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self._outputs.bind()
        messages = []
        for start in range(0, len(requests), CONVERT_CHUNK_SIZE):  # 16384 children: yield between chunks
            if start:
                await asyncio.sleep(0)
            messages += [request_to_pb(r) for r in requests[start : start + CONVERT_CHUNK_SIZE]]
        await self._wait(lambda edge: edge.submit_add(messages))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            # Shielded: an abort must reach the core even if its caller is cancelled meanwhile.
            await asyncio.shield(self._wait(lambda edge: edge.submit_abort(request_ids)))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids and self._core_edge is not None:
            self._core_edge.submit_abort(request_ids)

    async def reset_prefix_cache_async(self) -> bool:
        return await self._wait(lambda edge: edge.submit_reset_prefix_cache())

    def start_profile(self, output_dir: str | None = None) -> None:
        self._wait_sync_refused(lambda edge: edge.submit_start_profile(output_dir))

    def stop_profile(self) -> list[str]:
        return [self._wait_sync_refused(lambda edge: edge.submit_stop_profile())]

    async def start_profile_async(self, output_dir: str | None = None) -> None:
        await self._wait(lambda edge: edge.submit_start_profile(output_dir))

    async def stop_profile_async(self) -> list[str]:
        return [await self._wait(lambda edge: edge.submit_stop_profile())]

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    def sleep(self, level: int = 1, drain: bool = False) -> None:
        self._wait_sync_refused(lambda edge: self._submit_sleep(edge, level, drain))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._wait_sync_refused(lambda edge: edge.submit_wake_up(tags, on_done=self._refresh_availability))

    def is_sleeping(self) -> bool:
        return bool(self._wait_sync_refused(lambda edge: edge.submit_is_sleeping()))

    async def sleep_async(self, level: int = 1, drain: bool = False) -> None:
        """Returns once the core sleeps. A caller that gives up (its task cancelled) calls nothing off: the sleep
        goes on, its drain included, and availability follows it."""
        await self._wait(lambda edge: self._submit_sleep(edge, level, drain))

    async def wake_up_async(self, tags: list[str] | None = None) -> None:
        await self._wait(lambda edge: edge.submit_wake_up(tags, on_done=self._refresh_availability))

    async def is_sleeping_async(self) -> bool:
        return bool(await self._wait(lambda edge: edge.submit_is_sleeping()))

    # The sync LoRA calls would touch the core from this thread while its engine loop steps: through the loop.
    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        return self._wait_sync_translated(lambda edge: edge.submit_add_lora(lora_request_to_pb(lora_request)), True)

    def remove_lora(self, lora_name: str) -> None:
        self._wait_sync_translated(lambda edge: edge.submit_remove_lora(lora_name), False)

    def list_loras(self) -> list[LoRARequest]:
        return self._wait_sync_translated(lambda edge: edge.submit_list_loras(), False)

    async def add_lora_async(self, lora_request: LoRARequest) -> LoRARequest:
        loaded = await self._wait(lambda edge: edge.submit_add_lora(lora_request_to_pb(lora_request)))
        return lora_request_from_pb(loaded)

    async def remove_lora_async(self, lora_name: str) -> None:
        await self._wait(lambda edge: edge.submit_remove_lora(lora_name))

    async def list_loras_async(self) -> list[LoRARequest]:
        return [lora_request_from_pb(r) for r in await self._wait(lambda edge: edge.submit_list_loras())]

    def _wait_sync_translated(self, submit: Any, one: bool) -> Any:
        """``submit(edge)``'s result, refusals as the frontend's errors; LoRARequest messages converted."""
        try:
            result = submit(self._edge()).result()
        except self._refused_error as e:
            raise error_from_pb(e.error) from e
        if result is None:
            return None
        return lora_request_from_pb(result) if one else [lora_request_from_pb(r) for r in result]

    def shutdown(self) -> None:
        if self._core_edge is not None:
            self._core_edge.stop_engine_loop()
        self._outputs.put_threadsafe(EngineDeadError("the engine core has been shut down"))
        super().shutdown()

    def _wait_sync(self, submit: Any) -> Any:
        return submit(self._edge()).result()

    def _wait_sync_refused(self, submit: Any) -> Any:
        """``_wait_sync``, refusals as the frontend's errors (a sync caller of the threaded core)."""
        try:
            return self._wait_sync(submit)
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    async def _wait(self, submit: Any) -> Any:
        """Submit a command to the core's thread and await it; refusals become the frontend's errors."""
        edge = self._edge()
        if edge.engine_loop_failed:
            raise EngineDeadError("the engine core has stopped")
        future: concurrent.futures.Future[Any] = submit(edge)
        try:
            return await asyncio.wrap_future(future)
        except self._refused_error as e:
            raise error_from_pb(e.error) from e

    def _sink(self, outputs: pb.EngineCoreOutputs) -> None:  # on the engine thread
        self._outputs.put_threadsafe(outputs_from_pb(outputs))

    def _on_core_death(self, error: BaseException) -> None:  # on the engine thread
        # Its message, not its Python class: the engine loop has logged both, with the traceback.
        self._outputs.put_threadsafe(
            EngineDeadError(f"the engine core failed: {error}" if str(error) else "the engine core failed")
        )
        with self._death_lock:
            self.dead_error = error
            listeners = list(self._death_listeners)
        for listener in listeners:
            listener(error)
