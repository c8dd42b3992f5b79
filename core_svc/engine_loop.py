"""The engine core's busy loop on its own thread (vLLM's ``EngineCoreProc.run_busy_loop``).

Commands (add, abort, calls on the core) arrive from any thread; the loop applies them between steps, steps
while there is work, and hands each step's outputs to the client each request came from. So a long step never
blocks a transport's event loop, and several clients (gRPC streams) share one core.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from core_svc.engine_core import EngineCore
from core_svc.errors import EngineUnavailableError, SleepCancelledError, fault_message
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import FinishReason, Request
from core_svc.sleep_mode import SleepResult, check_sleep_level, check_wake_up_tags

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Receives one client's share of a step (called on the engine thread; must not block).
OutputSink = Callable[[EngineCoreOutputs], None]


@dataclasses.dataclass
class _Client:
    sink: OutputSink
    request_ids: set[str] = dataclasses.field(default_factory=set)


class EngineLoop:
    """Owns an ``EngineCore`` and the thread that drives it.

    Every method may be called from any thread. A refused request (also one queued when the loop stopped or
    died) is reported to its client's sink as an output with finish_reason ERROR and ``error``, the exception.
    When the core is declared dead (``EngineCore.dead_error``) or a step raises, the loop dies: every request
    still in the core ends with ``EngineUnavailableError``, and the death callbacks run.
    """

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.Queue()
        self._clients: dict[int, _Client] = {}
        self._owner: dict[str, int] = {}  # request_id -> client index
        self._next_client = 0
        self._lock = threading.Lock()  # guards _clients / _next_client across threads
        self._stopping = threading.Event()
        # Held while a command is queued and while the loop is marked stopping: a command is either queued
        # before the stop (and then run, or failed by the final drain) or refused; none is left waiting.
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="splitserve-engine-loop", daemon=True)
        self.dead_error: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        # sleep(drain=True) calls waiting for the core to empty, in order: (level, the caller's future)
        self._pending_sleeps: list[tuple[int, concurrent.futures.Future[SleepResult]]] = []

    def on_death(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` (on the engine thread) if the loop dies of an exception."""
        self._death_callbacks.append(callback)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._submit_lock:
            self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._fail_pending(EngineUnavailableError("the engine loop has stopped"))
        self._fail_pending_sleeps(EngineUnavailableError("the engine loop has stopped"))
        self.engine_core.shutdown()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def register_client(self, sink: OutputSink) -> int:
        """A new client (one gRPC stream); returns its client_index."""
        with self._lock:
            index = self._next_client
            self._next_client += 1
            self._clients[index] = _Client(sink)
        return index

    def unregister_client(self, client_index: int) -> concurrent.futures.Future[None]:
        """Forget a client and abort every request it still has in the core."""
        return self.submit(lambda: self._drop_client(client_index))

    def add_requests(
        self, client_index: int, requests: Sequence[Any], convert: Callable[[Any], Request] | None = None
    ) -> concurrent.futures.Future[None]:
        """Queue requests for the core; all are added or none. A refusal is also reported to the client's sink,
        a loop that stopped or died before the add ran included. ``convert``: turns each of ``requests`` (which
        has a ``request_id``) into a ``Request``, on the engine thread (None: they are ``Request``s)."""
        ran = threading.Event()

        def add() -> None:
            ran.set()
            self._add(client_index, [convert(r) for r in requests] if convert is not None else list(requests))

        def refuse_if_never_run(done: concurrent.futures.Future[None]) -> None:
            client = self._clients.get(client_index)
            if ran.is_set() or done.cancelled() or client is None:
                return
            error = done.exception()
            if error is not None:  # the loop stopped or died first: tell the client now
                client.sink(_error_outputs([r.request_id for r in requests], error))

        future = self.submit(add)
        future.add_done_callback(refuse_if_never_run)
        return future

    def abort_requests(
        self, request_ids: list[str], client_index: int | None = None
    ) -> concurrent.futures.Future[None]:
        """Abort requests; with ``client_index``, only those that client added (one stream cannot abort
        another's). Each owner hears of its aborted ids in ``finished_requests`` at once."""
        return self.submit(lambda: self._abort(request_ids, client_index))

    def call(self, fn: Callable[[EngineCore], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine_core)`` on the engine thread, between steps."""
        return self.submit(lambda: fn(self.engine_core))

    def sleep(
        self,
        level: int = 1,
        drain: bool = False,
        on_done: Callable[[concurrent.futures.Future[SleepResult]], None] | None = None,
    ) -> concurrent.futures.Future[SleepResult]:
        """``EngineCore.sleep(level)`` on the engine thread, the requests it ends told to their clients at once.
        ``drain``: first refuse new requests (UNAVAILABLE, "the engine core is going to sleep") and let those in
        the core finish, then sleep (vLLM's mode "wait"); else they end now with UNAVAILABLE (vLLM's default,
        "abort").

        The returned future only reports: cancelling it (a caller that gives up, as ``asyncio.wrap_future`` does
        when its task is cancelled) calls nothing off. Once submitted, the sleep runs, after its drain; only a
        ``wake_up`` calls a drain off. ``on_done`` hears of the sleep on the engine thread once it has run or
        failed (its future done), whether or not the returned future was cancelled; it must not block.

        The future fails with InvalidRequestError for a level that is not 1 or 2, with EngineUnavailableError
        when the loop stops (or dies) first."""
        check_sleep_level(level)
        # The engine's own future, which decides: no caller can cancel it. The caller's is told its outcome.
        engine_side: concurrent.futures.Future[SleepResult] = concurrent.futures.Future()
        result: concurrent.futures.Future[SleepResult] = concurrent.futures.Future()
        if on_done is not None:
            engine_side.add_done_callback(on_done)
        engine_side.add_done_callback(lambda done: _notify(done, result))

        def begin() -> None:
            if drain and self.engine_core.has_unfinished_requests():
                self.engine_core.stop_admitting(
                    f"the engine core is going to sleep (level {level}) once its requests in flight have finished"
                )
                self._pending_sleeps.append((level, engine_side))
            elif engine_side.set_running_or_notify_cancel():
                try:
                    engine_side.set_result(self._sleep_now(level))
                except Exception as e:
                    engine_side.set_exception(e)

        def forward_failure(command: concurrent.futures.Future[None]) -> None:
            error = command.exception()  # the loop stopped before ``begin`` ran
            if error is not None and not engine_side.done() and engine_side.set_running_or_notify_cancel():
                engine_side.set_exception(error)

        self.submit(begin).add_done_callback(forward_failure)
        return result

    def wake_up(self, tags: list[str] | None = None) -> concurrent.futures.Future[None]:
        """``EngineCore.wake_up(tags)`` on the engine thread. A ``sleep(drain=True)`` still draining is called
        off: its future fails with ``SleepCancelledError`` and the core takes requests again."""

        def wake() -> None:
            check_wake_up_tags(tags)  # a bad tag calls nothing off
            self._fail_pending_sleeps(
                SleepCancelledError("a wake_up came while the engine core drained to sleep: it stays awake")
            )
            self.engine_core.wake_up(tags)

        return self.submit(wake)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._submit_lock:
            if not self._stopping.is_set():
                self._commands.put((fn, future))
                return future
        future.set_exception(EngineUnavailableError("the engine loop has stopped"))
        return future

    def num_unfinished_requests(self) -> int:
        return len(self._owner)

    # --- engine thread ---

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine_core.has_unfinished_requests())
                if self._pending_sleeps and not self.engine_core.has_unfinished_requests():
                    self._run_pending_sleeps()
                if self.engine_core.has_unfinished_requests():
                    self._dispatch(self.engine_core.step())  # a failed step's requests end in its outputs
                    if self.engine_core.dead_error is not None:
                        raise self.engine_core.dead_error
        except BaseException as e:
            if isinstance(e, EngineUnavailableError):
                logger.error("engine loop stopped: %s", e)  # the core logged the steps that failed
                unavailable = e
            else:
                logger.exception("engine loop died")
                unavailable = EngineUnavailableError(f"the engine core died: {fault_message(e)}")
            self.dead_error = e
            with self._submit_lock:
                self._stopping.set()
            self._fail_owned(unavailable)
            self._fail_pending(unavailable)
            self._fail_pending_sleeps(unavailable)
            for callback in self._death_callbacks:
                callback(e)

    def _apply_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as e:
                    future.set_exception(e)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _sleep_now(self, level: int) -> SleepResult:
        result, outputs = self.engine_core.sleep(level)
        self._dispatch(outputs)  # the requests it ended, to their clients
        return result

    def _run_pending_sleeps(self) -> None:
        """The core has drained: run the sleeps that waited for it (a deeper level after a lighter one)."""
        pending, self._pending_sleeps = self._pending_sleeps, []
        for level, future in pending:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._sleep_now(level))
                except Exception as e:
                    future.set_exception(e)

    def _fail_pending_sleeps(self, error: BaseException) -> None:
        pending, self._pending_sleeps = self._pending_sleeps, []
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _add(self, client_index: int, requests: list[Request]) -> None:
        client = self._clients.get(client_index)
        if client is None:
            return  # the stream went away before its requests got here
        added: list[str] = []
        try:
            for request in requests:
                request.client_index = client_index
                self.engine_core.add_request(request)
                added.append(request.request_id)
                self._owner[request.request_id] = client_index
                client.request_ids.add(request.request_id)
        except Exception as e:
            self._abort(added, notify=False)
            client.sink(_error_outputs([r.request_id for r in requests], e))
            raise

    def _abort(self, request_ids: list[str], client_index: int | None = None, notify: bool = True) -> None:
        if client_index is not None:
            request_ids = [i for i in request_ids if self._owner.get(i) == client_index]
        self.engine_core.abort_requests(request_ids)
        by_owner: dict[int, set[str]] = {}
        for request_id in request_ids:
            owner = self._owner.get(request_id)
            if owner is not None:
                by_owner.setdefault(owner, set()).add(request_id)
            self._forget(request_id)
        for owner, ids in by_owner.items():
            client = self._clients.get(owner)
            if notify and client is not None:
                client.sink(EngineCoreOutputs(finished_requests=ids))

    def _drop_client(self, client_index: int) -> None:
        with self._lock:
            client = self._clients.pop(client_index, None)
        if client is not None and client.request_ids:
            self._abort(sorted(client.request_ids), notify=False)

    def _forget(self, request_id: str) -> None:
        index = self._owner.pop(request_id, None)
        client = self._clients.get(index) if index is not None else None
        if client is not None:
            client.request_ids.discard(request_id)

    def _dispatch(self, outputs: EngineCoreOutputs) -> None:
        """Split a step's outputs by client; every client with something in it, or with a request still in the
        core, gets its share and the stats. So a step that produced no output (prefill chunks only) still
        brings its stats, its admissions' prefix-cache lookups among them, to the frontends waiting on it."""
        shares: dict[int, EngineCoreOutputs] = {}

        def share_of(index: int) -> EngineCoreOutputs:
            if index not in shares:
                shares[index] = EngineCoreOutputs(scheduler_stats=outputs.scheduler_stats, timestamp=outputs.timestamp)
            return shares[index]

        def share(request_id: str) -> EngineCoreOutputs | None:
            index = self._owner.get(request_id)
            if index is None or index not in self._clients:
                return None
            return share_of(index)

        for output in outputs.outputs:
            target = share(output.request_id)
            if target is not None:
                target.outputs.append(output)
        for request_id in outputs.finished_requests:
            target = share(request_id)
            if target is not None:
                target.finished_requests.add(request_id)
            self._forget(request_id)
        if outputs.scheduler_stats is not None:
            with self._lock:  # other threads register clients
                waiting = [index for index, client in self._clients.items() if client.request_ids]
            for index in waiting:
                share_of(index)
        for index, client_outputs in shares.items():
            try:
                self._clients[index].sink(client_outputs)
            except Exception:
                logger.exception("output sink of client %d failed", index)

    def _fail_owned(self, error: Exception) -> None:
        """End every request still in the core with ``error``, an output to its client (the loop is dying)."""
        by_owner: dict[int, list[str]] = {}
        for request_id, owner in self._owner.items():
            by_owner.setdefault(owner, []).append(request_id)
        for owner, request_ids in by_owner.items():
            for request_id in request_ids:
                self._forget(request_id)
            client = self._clients.get(owner)
            if client is not None:
                try:
                    client.sink(_error_outputs(request_ids, error))
                except Exception:
                    logger.exception("output sink of client %d failed", owner)

    def _fail_pending(self, error: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(error)


def _notify(done: concurrent.futures.Future[T], caller: concurrent.futures.Future[T]) -> None:
    """Tell ``caller`` the outcome of ``done``, unless its caller has cancelled it (it has given up waiting)."""
    if not caller.set_running_or_notify_cancel():
        return
    error = done.exception()
    if error is not None:
        caller.set_exception(error)
    else:
        caller.set_result(done.result())


def _error_outputs(request_ids: list[str], error: BaseException) -> EngineCoreOutputs:
    """Outputs that end requests with finish_reason ERROR and ``error``."""
    if not isinstance(error, Exception):  # KeyboardInterrupt and the like: the loop is gone
        error = EngineUnavailableError("the engine loop stopped")
    return EngineCoreOutputs(
        outputs=[EngineCoreOutput(i, [], finish_reason=FinishReason.ERROR, error=error) for i in request_ids]
    )
