"""The core's gRPC servicer: thin, typed; the engine runs on ``EngineLoop``'s thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from core_svc.admin import AdminPolicy, disabled_message
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.errors import EngineUnavailableError, InvalidRequestError
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import FinishReason
from core_svc.sleep_mode import SleepResult, check_sleep_level, check_wake_up_tags
from core_svc.wire import (
    engine_info_to_pb,
    engine_load_to_pb,
    lora_request_from_pb,
    lora_request_to_pb,
    outputs_to_pb,
    outputs_to_pb_messages,
    request_from_pb,
    sleep_result_to_pb,
)
from splitserve.base.grpc_errors import UndecodableRequestError, finish_reading
from splitserve.base.grpc_status import abort
from splitserve.base.thread_handoff import ThreadToLoopQueue
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
ENGINE_CORE_GRPC_SERVICE = pb.DESCRIPTOR.services_by_name["EngineCore"].full_name
T = TypeVar("T")


@dataclass(frozen=True)
class _ReaderDone:
    """The client stopped sending (half-close), or sent something the core cannot take (``error``: a message
    that does not parse)."""

    error: Exception | None = None


@dataclass(frozen=True)
class _ServerStopping:
    """The server stops: the stream ends now."""


# A stream's messages, from the engine thread (outputs) and from its own event loop (the reader, the server's stop).
_Outbox = ThreadToLoopQueue[pb.EngineCoreOutputs | _ReaderDone | _ServerStopping]


@dataclass
class CoreServerState:
    """What the servicer needs from the server: the loop once the model is loaded, whether it drains, and whether
    its admin RPCs are on."""

    engine_loop: EngineLoop | None = None
    draining: bool = False
    max_receive_message_bytes: int = 0  # the server's receive limit, told to frontends (0: not told)
    max_send_message_bytes: int = 0  # the server's send limit: larger steps go out split (0: no limit)
    outboxes: set[_Outbox] = field(default_factory=set)  # one per open Connect stream
    admin: AdminPolicy = AdminPolicy()  # ResetPrefixCache, StartProfile, StopProfile, Sleep, WakeUp: off unless enabled
    # Readiness (the health status of ENGINE_CORE_GRPC_SERVICE) to SERVING or NOT_SERVING, soon; set by the server.
    set_serving: Callable[[bool], None] | None = None

    _readiness_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update_readiness(self) -> None:
        """Readiness from the core's state: SERVING while its loop runs, it is awake (and not draining to sleep)
        and the server not draining. Any thread (the engine thread after a sleep, the event loop after a call):
        the lock posts the statuses in the order their states were read, so the last one posted is the newest."""
        engine_loop = self.engine_loop
        if self.set_serving is not None and engine_loop is not None:
            with self._readiness_lock:
                awake = not engine_loop.engine_core.is_sleeping() and engine_loop.engine_core.refusal is None
                self.set_serving(engine_loop.is_alive and awake and not self.draining)

    def end_streams(self) -> None:
        """End every open ``Connect`` stream with status OK (at shutdown, after the drain: grpc would cancel
        them, and may log a traceback for each); the requests still on one are aborted as it closes."""
        for outbox in self.outboxes:
            outbox.put_nowait(_ServerStopping())


class EngineCoreServicer(pb_grpc.EngineCoreServicer):
    def __init__(self, state: CoreServerState) -> None:
        self.state = state

    async def Connect(
        self, request_iterator: AsyncIterator[pb.EngineCoreClientMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EngineCoreOutputs]:
        """Serve one frontend stream. When the client half-closes, its requests still run to the end, then the
        stream ends; when it goes away, they are aborted. A message that does not parse ends the stream with
        INVALID_ARGUMENT naming it, once the client has half-closed (``grpc_errors.finish_reading``), and aborts
        its requests. At the server's stop (``CoreServerState.end_streams``) it ends with OK, and what it still has
        running is aborted."""
        engine_loop = await self._engine_loop(context)
        outbox: _Outbox = ThreadToLoopQueue()
        outbox.bind()

        def sink(outputs: EngineCoreOutputs) -> None:  # on the engine thread
            # One message over the send limit would end this stream and every request on it: split the step, and
            # end (and abort) a request whose output alone is too large.
            messages, too_large = outputs_to_pb_messages(outputs, self.state.max_send_message_bytes)
            if too_large:
                engine_loop.abort_requests(too_large, client_index)
            outbox.put_threadsafe(*messages)

        client_index = engine_loop.register_client(sink)
        # Requests of this stream not yet finished, kept on this event loop in the order the outbox delivers:
        # added before each add is submitted, removed when an output or a finished_requests entry ends them.
        open_ids: set[str] = set()
        reader = asyncio.create_task(self._read(request_iterator, engine_loop, client_index, outbox, open_ids))
        reader_done: _ReaderDone | None = None
        self.state.outboxes.add(outbox)
        try:
            while reader_done is None or open_ids:
                item = await outbox.get()
                if isinstance(item, _ServerStopping):
                    return
                if isinstance(item, _ReaderDone):
                    reader_done = item
                    if item.error is not None:
                        logger.warning("stream %d ends: %s", client_index, item.error)
                        await abort(context, item.error)
                    continue
                open_ids.difference_update(item.finished_requests)
                open_ids.difference_update(
                    o.request_id for o in item.outputs if o.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                )
                yield item
        finally:
            self.state.outboxes.discard(outbox)
            reader.cancel()
            engine_loop.unregister_client(client_index)  # aborts whatever this stream still had running

    async def _read(
        self,
        request_iterator: AsyncIterator[pb.EngineCoreClientMessage],
        engine_loop: EngineLoop,
        client_index: int,
        outbox: _Outbox,
        open_ids: set[str],
    ) -> None:
        error: Exception | None = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("message")
                if kind == "add":
                    request = request_from_pb(message.add)
                    open_ids.add(request.request_id)
                    if self.state.draining:
                        refusal = EngineCoreOutput(
                            request.request_id,
                            [],
                            finish_reason=FinishReason.ERROR,
                            error=EngineUnavailableError("the engine core is shutting down"),
                        )
                        outbox.put_nowait(outputs_to_pb(EngineCoreOutputs(outputs=[refusal])))
                        continue
                    engine_loop.add_requests(client_index, [request])  # a refusal comes back through the sink
                elif kind == "abort":
                    engine_loop.abort_requests(list(message.abort.request_ids), client_index)
        except asyncio.CancelledError:
            return
        except UndecodableRequestError as e:
            error = e
            await finish_reading(request_iterator)  # else an asyncio client may get INTERNAL instead of this error
        except Exception as e:  # a fault of ours: INTERNAL
            logger.exception("stream %d: reading its messages failed", client_index)
            error = e
        outbox.put_nowait(_ReaderDone(error))

    async def GetEngineInfo(self, request: pb.GetEngineInfoRequest, context: grpc.aio.ServicerContext) -> pb.EngineInfo:
        engine_loop = await self._engine_loop(context, allow_draining=True)
        return engine_info_to_pb(engine_loop.engine_core.get_engine_info(), self.state.max_receive_message_bytes)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.EngineLoad:
        engine_loop = await self._engine_loop(context, allow_draining=True)
        return engine_load_to_pb(await self._call(context, engine_loop, lambda core: core.get_load()))

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        await self._check_admin(context, "ResetPrefixCache")
        engine_loop = await self._engine_loop(context)
        success = await self._call(context, engine_loop, lambda core: core.reset_prefix_cache())
        return pb.ResetPrefixCacheResponse(success=success)

    async def StartProfile(
        self, request: pb.StartProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartProfileResponse:
        """Profile every step until ``StopProfile``; the trace goes to ``output_dir`` under the core's profile
        directory (empty: the directory itself). INVALID_ARGUMENT when it would lie outside."""
        await self._check_admin(context, "StartProfile")
        try:
            output_dir = self.state.admin.profile_output_dir(request.output_dir)
        except InvalidRequestError as e:
            await abort(context, e)
        engine_loop = await self._engine_loop(context)
        await self._call(context, engine_loop, lambda core: core.start_profile(str(output_dir)))
        return pb.StartProfileResponse()

    async def StopProfile(
        self, request: pb.StopProfileRequest, context: grpc.aio.ServicerContext
    ) -> pb.StopProfileResponse:
        await self._check_admin(context, "StopProfile")
        engine_loop = await self._engine_loop(context, allow_draining=True)
        path = await self._call(context, engine_loop, lambda core: core.stop_profile())
        return pb.StopProfileResponse(trace_path=path)

    async def Sleep(self, request: pb.SleepRequest, context: grpc.aio.ServicerContext) -> pb.SleepResponse:
        """``EngineCore.sleep(level)`` (admin): readiness goes NOT_SERVING first, so frontends send their new
        requests elsewhere; with ``drain``, those in flight finish first, else they end with UNAVAILABLE.
        INVALID_ARGUMENT naming ``level`` for a level that is not 1 or 2. The sleep goes on, and its drain, if the
        caller cancels the call or its deadline passes (a ``WakeUp`` calls a drain off: FAILED_PRECONDITION).
        Readiness is computed again from the core's state once the sleep has run or failed, on the engine thread
        (so a ``WakeUp`` that ran meanwhile cannot leave a sleeping core SERVING), and when the call ends."""
        await self._check_admin(context, "Sleep")
        engine_loop = await self._engine_loop(context)
        try:
            check_sleep_level(request.level)
        except InvalidRequestError as e:
            await abort(context, e)
        if self.state.set_serving is not None:
            self.state.set_serving(False)
        sleeping: concurrent.futures.Future[SleepResult] | None = None
        try:
            sleeping = engine_loop.sleep(request.level, request.drain, on_done=lambda _: self.state.update_readiness())
            # A cancelled call cancels ``sleeping``, which only reports: the engine's own future decides.
            result = await asyncio.wrap_future(sleeping)
        except Exception as e:
            await abort(context, e)
        finally:
            # Asleep: NOT_SERVING; it did not sleep: ready again, unless otherwise not. A call that ends before the
            # sleep has run (cancelled) leaves readiness NOT_SERVING to the sleep's ``on_done``.
            if sleeping is None or (sleeping.done() and not sleeping.cancelled()):
                self.state.update_readiness()
        logger.info(
            "Sleep(level=%d, drain=%s): %d request(s) ended, %d bytes of KV cache and %d of weights released",
            request.level,
            request.drain,
            result.num_aborted_requests,
            result.kv_cache_bytes_freed,
            result.weights_bytes_freed,
        )
        return sleep_result_to_pb(result)

    async def WakeUp(self, request: pb.WakeUpRequest, context: grpc.aio.ServicerContext) -> pb.WakeUpResponse:
        """``EngineCore.wake_up(tags)`` (admin; no tags: everything); readiness SERVING once nothing sleeps.
        INVALID_ARGUMENT naming ``tags[i]`` for a tag that is neither ``weights`` nor ``kv_cache``."""
        await self._check_admin(context, "WakeUp")
        engine_loop = await self._engine_loop(context)
        tags = list(request.tags)
        try:
            check_wake_up_tags(tags)
        except InvalidRequestError as e:
            await abort(context, e)
        try:
            await asyncio.wrap_future(engine_loop.wake_up(tags or None))
        except Exception as e:
            await abort(context, e)
        finally:
            # Also after a failure or a cancelled call: what did wake stays awake (the weights, before a KV cache
            # that failed), and a wake that ran before the caller gave up counts.
            self.state.update_readiness()
        return pb.WakeUpResponse()

    async def IsSleeping(
        self, request: pb.IsSleepingRequest, context: grpc.aio.ServicerContext
    ) -> pb.IsSleepingResponse:
        """Whether the core sleeps (not an admin RPC: it changes nothing)."""
        engine_loop = await self._engine_loop(context, allow_draining=True)
        return pb.IsSleepingResponse(is_sleeping=await self._call(context, engine_loop, lambda c: c.is_sleeping()))

    async def AddLora(self, request: pb.AddLoraRequest, context: grpc.aio.ServicerContext) -> pb.AddLoraResponse:
        """Load a PEFT adapter folder: its files are read and checked on a worker thread, then it is registered
        on the engine thread between steps. The same name and folder again answers the adapter as loaded
        (idempotent, as vLLM's ``add_lora``); the name loaded from another folder is ALREADY_EXISTS; a folder the
        core cannot serve INVALID_ARGUMENT with the reason; LoRA off (no ``--enable-lora``) FAILED_PRECONDITION."""
        engine_loop = await self._engine_loop(context)
        core = engine_loop.engine_core
        lora_request = lora_request_from_pb(request.lora_request)
        try:
            loaded = core.find_lora(lora_request)
            if loaded is None:
                model = await asyncio.to_thread(core.read_lora, lora_request)
                loaded = await asyncio.wrap_future(engine_loop.call(lambda c: c.install_lora(model)))
        except Exception as e:
            await abort(context, e)
        return pb.AddLoraResponse(lora_request=lora_request_to_pb(loaded))

    async def RemoveLora(
        self, request: pb.RemoveLoraRequest, context: grpc.aio.ServicerContext
    ) -> pb.RemoveLoraResponse:
        """Unload an adapter by name (NOT_FOUND: none loaded under it): later requests naming it are NOT_FOUND,
        running ones finish with it."""
        engine_loop = await self._engine_loop(context, allow_draining=True)
        await self._call(context, engine_loop, lambda core: core.remove_lora(request.lora_name))
        return pb.RemoveLoraResponse()

    async def ListLoras(self, request: pb.ListLorasRequest, context: grpc.aio.ServicerContext) -> pb.ListLorasResponse:
        engine_loop = await self._engine_loop(context, allow_draining=True)
        loras = await self._call(context, engine_loop, lambda core: core.list_loras())
        return pb.ListLorasResponse(lora_requests=[lora_request_to_pb(lora) for lora in loras])

    async def _check_admin(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """End the call with UNIMPLEMENTED unless the admin RPCs are on: gRPC's code for an operation "not
        supported/enabled in this service", which a client cannot change by asking otherwise (PERMISSION_DENIED
        would suggest another identity could), and what a core without the method would answer."""
        if not self.state.admin.enabled:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, disabled_message(method))

    async def _engine_loop(self, context: grpc.aio.ServicerContext, allow_draining: bool = False) -> EngineLoop:
        engine_loop = self.state.engine_loop
        if engine_loop is None or not engine_loop.is_alive:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine core is not ready (loading or stopped)")
        if self.state.draining and not allow_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine core is shutting down")
        return engine_loop

    @staticmethod
    async def _call(context: grpc.aio.ServicerContext, engine_loop: EngineLoop, fn: Callable[[EngineCore], T]) -> T:
        """``fn(engine_core)`` on the engine thread. Its error, or the loop's if it stopped or died before
        running it (``EngineUnavailableError``), ends the call with its status (``splitserve.base.grpc_status``)."""
        try:
            return await asyncio.wrap_future(engine_loop.call(fn))
        except Exception as e:
            await abort(context, e)  # raises
