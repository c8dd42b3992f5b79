"""The core's edge for a frontend in the same process: the same protobuf messages as over gRPC (not
serialized), and refusals as the wire's ``RequestError`` (gRPC status code, message, field), as a request's
output carries them. A frontend needs nothing else of the core.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.errors import EngineUnavailableError, InvalidRequestError
from core_svc.observability import observe_engine_core
from core_svc.outputs import EngineCoreOutputs
from core_svc.sleep_mode import check_sleep_level, check_wake_up_tags
from core_svc.wire import (
    engine_info_to_pb,
    lora_request_from_pb,
    lora_request_to_pb,
    outputs_to_pb,
    request_error_to_pb,
    request_from_pb,
    sleep_result_to_pb,
)
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb

T = TypeVar("T")


class RefusedError(Exception):
    """The core refused a call: ``error`` is the refusal as the gRPC server would have sent it on a request's
    output (code, message, field)."""

    def __init__(self, error: pb.RequestError) -> None:
        super().__init__(error.message)
        self.error = error


def _refused(error: BaseException) -> RefusedError:
    return error if isinstance(error, RefusedError) else RefusedError(request_error_to_pb(error))


class InprocCore:
    """An ``EngineCore`` driven either step by step (``step``) or by an ``EngineLoop`` thread (``start_engine_loop``).

    Raises:
        ModelLoadError, ValueError: from the constructor, as ``EngineCore``.
    """

    def __init__(self, model: str, **core_config: Any) -> None:
        self.engine_core = EngineCore(CoreConfig(model=model, **core_config))
        self._engine_loop: EngineLoop | None = None
        self._client_index = 0
        self._pending_outputs: list[EngineCoreOutputs] = []  # step by step: what a sleep ended, for the next step
        # Reads adapter folders off the engine thread (submit_add_lora), one at a time.
        self._lora_loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="splitserve-lora-loader")

    # --- step by step (the caller's thread) ---

    def get_engine_info(self) -> pb.EngineInfo:
        return engine_info_to_pb(self.engine_core.get_engine_info())

    def add_request(self, request: pb.EngineCoreRequest) -> None:
        """Raises RefusedError for a request the core refuses."""
        try:
            self.engine_core.add_request(request_from_pb(request))
        except Exception as e:
            raise _refused(e) from e

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def step(self) -> pb.EngineCoreOutputs:
        """Raises RefusedError (UNAVAILABLE) once the core was declared dead."""
        if self._pending_outputs:
            return outputs_to_pb(self._pending_outputs.pop(0))
        try:
            return outputs_to_pb(self.engine_core.step())
        except EngineUnavailableError as e:
            raise _refused(e) from e

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def start_profile(self, output_dir: str | None = None) -> None:
        """``EngineCore.start_profile``; raises RefusedError (FAILED_PRECONDITION: a profile runs already)."""
        try:
            self.engine_core.start_profile(output_dir)
        except Exception as e:
            raise _refused(e) from e

    def stop_profile(self) -> str:
        """``EngineCore.stop_profile``: the trace's path; raises RefusedError (FAILED_PRECONDITION: none runs)."""
        try:
            return self.engine_core.stop_profile()
        except Exception as e:
            raise _refused(e) from e

    def sleep(self, level: int, drain: bool = False) -> pb.SleepResponse:
        """``EngineCore.sleep(level)``; the requests it ends come out of the next ``step``. Raises RefusedError:
        a bad level (INVALID_ARGUMENT), or ``drain`` with requests in the core: step by step, nothing steps them
        while this call waits (run the steps until they finish first)."""
        try:
            check_sleep_level(level)
            if drain and self.engine_core.has_unfinished_requests():
                raise InvalidRequestError(
                    "drain",
                    "the in-process engine is stepped by its caller: step it until its requests have finished, "
                    "then sleep (or sleep without drain, which ends them)",
                )
            result, outputs = self.engine_core.sleep(level)
        except Exception as e:
            raise _refused(e) from e
        if outputs.outputs or outputs.finished_requests:
            self._pending_outputs.append(outputs)
        return sleep_result_to_pb(result)

    def wake_up(self, tags: list[str] | None) -> None:
        """``EngineCore.wake_up(tags)``. Raises RefusedError: a bad tag (INVALID_ARGUMENT)."""
        try:
            self.engine_core.wake_up(tags)
        except Exception as e:
            raise _refused(e) from e

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def add_lora(self, lora_request: pb.LoRARequest) -> pb.LoRARequest:
        """Load an adapter (or find it loaded); returns it as loaded. Raises RefusedError."""
        try:
            return lora_request_to_pb(self.engine_core.add_lora(lora_request_from_pb(lora_request)))
        except Exception as e:
            raise _refused(e) from e

    def remove_lora(self, lora_name: str) -> None:
        """Raises RefusedError (NOT_FOUND: no such adapter)."""
        try:
            self.engine_core.remove_lora(lora_name)
        except Exception as e:
            raise _refused(e) from e

    def list_loras(self) -> list[pb.LoRARequest]:
        """Raises RefusedError (FAILED_PRECONDITION: LoRA is off)."""
        try:
            return [lora_request_to_pb(r) for r in self.engine_core.list_loras()]
        except Exception as e:
            raise _refused(e) from e

    # --- on the engine loop's thread ---

    def start_engine_loop(
        self, sink: Callable[[pb.EngineCoreOutputs], None], on_death: Callable[[BaseException], None]
    ) -> None:
        """Run the core on its own thread; ``sink`` gets every step's outputs (on that thread)."""

        def deliver(outputs: EngineCoreOutputs) -> None:
            sink(outputs_to_pb(outputs))

        self._engine_loop = EngineLoop(self.engine_core)
        self._client_index = self._engine_loop.register_client(deliver)
        self._engine_loop.on_death(on_death)
        self._engine_loop.start()

    def stop_engine_loop(self) -> None:
        if self._engine_loop is not None:
            self._engine_loop.stop()

    def shutdown(self) -> None:
        """Stop the engine loop, if any, and the core's threads (``EngineCore.shutdown``)."""
        self.stop_engine_loop()
        self._lora_loader.shutdown(wait=False, cancel_futures=True)
        self.engine_core.shutdown()

    @property
    def engine_loop_failed(self) -> bool:
        return self._engine_loop is not None and self._engine_loop.dead_error is not None

    def submit_add(self, requests: list[pb.EngineCoreRequest]) -> concurrent.futures.Future[None]:
        """All or none; the future fails with RefusedError. Cancelling it before it runs skips the add. The
        messages become ``Request``s on the engine's thread (16384 children take half a second: not the
        caller's event loop's)."""
        return _translated(self._running_engine_loop().add_requests(self._client_index, requests, request_from_pb))

    def submit_abort(self, request_ids: list[str]) -> concurrent.futures.Future[None]:
        return _translated(self._running_engine_loop().abort_requests(request_ids))

    def submit_observe(
        self, model_name: str, registry: CollectorRegistry | None, tracer_provider: TracerProvider | None
    ) -> concurrent.futures.Future[None]:
        """Add the core's Prometheus metrics (``registry``) and request spans (``tracer_provider``), on the
        engine's thread; None leaves either off."""

        return self._running_engine_loop().call(
            lambda core: observe_engine_core(core, model_name, registry, tracer_provider)
        )

    def submit_reset_prefix_cache(self) -> concurrent.futures.Future[bool]:
        return _translated(self._running_engine_loop().call(lambda core: core.reset_prefix_cache()))

    def submit_start_profile(self, output_dir: str | None) -> concurrent.futures.Future[None]:
        return _translated(self._running_engine_loop().call(lambda core: core.start_profile(output_dir)))

    def submit_stop_profile(self) -> concurrent.futures.Future[str]:
        return _translated(self._running_engine_loop().call(lambda core: core.stop_profile()))

    def submit_sleep(
        self,
        level: int,
        drain: bool,
        on_start: Callable[[], None] | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> concurrent.futures.Future[pb.SleepResponse]:
        """``EngineLoop.sleep``; the future fails with RefusedError (a bad level: INVALID_ARGUMENT). Cancelling it
        calls nothing off (the sleep runs, after its drain). A sleep the engine loop takes: ``on_start()`` first,
        here, then ``on_done()`` once it has run or failed, on the engine thread, also when the future was
        cancelled; a refused one (a bad level, no engine loop) calls neither."""
        try:
            check_sleep_level(level)
            engine_loop = self._running_engine_loop()
        except Exception as e:
            failed: concurrent.futures.Future[pb.SleepResponse] = concurrent.futures.Future()
            failed.set_exception(_refused(e))
            return failed
        if on_start is not None:
            on_start()
        future = engine_loop.sleep(level, drain, on_done=(lambda _: on_done()) if on_done is not None else None)
        result: concurrent.futures.Future[pb.SleepResponse] = concurrent.futures.Future()

        def convert(done: concurrent.futures.Future[Any]) -> None:
            if done.cancelled() or not result.set_running_or_notify_cancel():
                return  # the caller gave up waiting: nobody to tell
            error = done.exception()
            if error is not None:
                result.set_exception(_refused(error))
            else:
                result.set_result(sleep_result_to_pb(done.result()))

        future.add_done_callback(convert)
        return result

    def submit_wake_up(
        self, tags: list[str] | None, on_done: Callable[[], None] | None = None
    ) -> concurrent.futures.Future[None]:
        """``EngineLoop.wake_up``; ``on_done()`` runs once the engine thread has run it, or it failed or was called
        off (cancelling the future before it runs does), as ``submit_sleep``'s."""
        try:
            check_wake_up_tags(tags)
            future = self._running_engine_loop().wake_up(tags)
        except Exception as e:
            if on_done is not None:
                on_done()
            failed: concurrent.futures.Future[None] = concurrent.futures.Future()
            failed.set_exception(_refused(e))
            return failed
        if on_done is not None:
            future.add_done_callback(lambda _: on_done())
        return _translated(future)

    def submit_is_sleeping(self) -> concurrent.futures.Future[bool]:
        return _translated(self._running_engine_loop().call(lambda core: core.is_sleeping()))

    def submit_add_lora(self, lora_request: pb.LoRARequest) -> concurrent.futures.Future[pb.LoRARequest]:
        """Load an adapter: its files are read on a worker thread, then it is registered on the engine thread
        between steps (a step never waits for the file system). An adapter already loaded under that name and
        folder comes back at once."""
        engine_loop, core = self._running_engine_loop(), self.engine_core
        request = lora_request_from_pb(lora_request)

        def load() -> pb.LoRARequest:
            loaded = core.find_lora(request)
            if loaded is None:
                model = core.read_lora(request)
                loaded = engine_loop.call(lambda c: c.install_lora(model)).result()
            return lora_request_to_pb(loaded)

        return _translated(self._lora_loader.submit(load))

    def submit_remove_lora(self, lora_name: str) -> concurrent.futures.Future[None]:
        return _translated(self._running_engine_loop().call(lambda core: core.remove_lora(lora_name)))

    def submit_list_loras(self) -> concurrent.futures.Future[list[pb.LoRARequest]]:
        return _translated(
            self._running_engine_loop().call(lambda core: [lora_request_to_pb(r) for r in core.list_loras()])
        )

    def _running_engine_loop(self) -> EngineLoop:
        if self._engine_loop is None:
            raise EngineUnavailableError("the engine loop is not running")
        return self._engine_loop


def _translated(future: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
    """``future`` with its exception turned into RefusedError; cancelling the result cancels ``future``."""
    result: concurrent.futures.Future[T] = concurrent.futures.Future()

    def forward(done: concurrent.futures.Future[T]) -> None:
        if done.cancelled():
            result.cancel()
        elif not result.cancelled():
            error = done.exception()
            if result.set_running_or_notify_cancel():
                if error is not None:
                    result.set_exception(_refused(error))
                else:
                    result.set_result(done.result())

    result.add_done_callback(lambda r: future.cancel() if r.cancelled() else None)
    future.add_done_callback(forward)
    return result
