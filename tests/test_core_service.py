"""The core's Connect stream against a scripted engine: a half-closed stream gets every output of its requests
and then ends, whatever the timing between the engine thread and the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from core_svc.admin import AdminPolicy
from core_svc.engine_loop import EngineLoop
from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs
from core_svc.request import FinishReason
from core_svc.service import CoreServerState, EngineCoreServicer
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb

NUM_TOKENS = 3


class ScriptedCore:
    """Each request produces NUM_TOKENS tokens, one per step, then finishes with LENGTH."""

    dead_error = None

    def __init__(self) -> None:
        self.left: dict[str, int] = {}

    def add_request(self, request: object) -> None:
        self.left[request.request_id] = NUM_TOKENS

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.left.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def shutdown(self) -> None:
        """Nothing of this core runs beside its steps (EngineCore.shutdown stops its compile pool)."""

    def step(self) -> EngineCoreOutputs:
        outputs, finished = [], set()
        for request_id in list(self.left):
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            outputs.append(EngineCoreOutput(request_id, [7], finish_reason=FinishReason.LENGTH if done else None))
            if done:
                finished.add(request_id)
                del self.left[request_id]
        return EngineCoreOutputs(outputs=outputs, finished_requests=finished)


async def _half_closed_stream(servicer: EngineCoreServicer, request_ids: list[str]) -> list[int]:
    async def messages():
        for request_id in request_ids:
            yield core_pb.EngineCoreClientMessage(
                add=core_pb.EngineCoreRequest(
                    request_id=request_id, prompt_token_ids=[1, 2], sampling_params=core_pb.SamplingParams()
                )
            )

    tokens = []
    async for message in servicer.Connect(messages(), None):
        tokens += [t for o in message.outputs for t in o.new_token_ids]
    return tokens


@pytest.mark.parametrize("slow", [None, "_add", "_forget", "_dispatch"])
def test_half_closed_stream_gets_everything_then_ends(slow, monkeypatch):
    if slow is not None:  # widen one window between the engine thread and the event loop
        original = getattr(EngineLoop, slow)

        def delayed(self, *args, **kwargs):
            time.sleep(0.002)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(EngineLoop, slow, delayed)
    engine_loop = EngineLoop(ScriptedCore())
    engine_loop.start()
    servicer = EngineCoreServicer(CoreServerState(engine_loop=engine_loop))
    try:
        for i in range(30):
            ids = [f"r{i}-{j}" for j in range(1 + i % 3)]
            tokens = asyncio.run(asyncio.wait_for(_half_closed_stream(servicer, ids), timeout=5))
            assert tokens == [7] * NUM_TOKENS * len(ids), f"round {i}"
    finally:
        engine_loop.stop()


def test_a_command_racing_stop_is_run_or_refused(monkeypatch):
    """A command submitted while the loop stops either runs or fails; it is never left waiting forever (its
    caller would hang). The queueing is slowed so that stop() lands inside it."""
    import threading

    engine_loop = EngineLoop(ScriptedCore())
    engine_loop.start()
    put = engine_loop._commands.put

    def slow_put(item):
        time.sleep(0.1)
        put(item)

    monkeypatch.setattr(engine_loop._commands, "put", slow_put)
    futures = []
    submitter = threading.Thread(target=lambda: futures.append(engine_loop.submit(lambda: "ran")))
    submitter.start()
    time.sleep(0.02)  # the submitter is inside put now
    engine_loop.stop()
    submitter.join()
    (future,) = futures
    assert future.done()
    assert future.exception() is not None or future.result() == "ran"


class _Aborted(Exception):
    pass


class _Context:
    """The servicer's side of a unary call: records how ``abort`` ended it."""

    code: object = None
    details: str = ""

    async def abort(self, code: object, details: str) -> None:
        self.code, self.details = code, details
        raise _Aborted


@pytest.mark.parametrize(
    ("method", "request_message"),
    [
        ("GetLoad", core_pb.GetLoadRequest()),
        ("ResetPrefixCache", core_pb.ResetPrefixCacheRequest()),
        ("StartProfile", core_pb.StartProfileRequest()),
    ],
)
def test_a_call_racing_the_loop_stop_answers_unavailable(method, request_message, monkeypatch, tmp_path):
    """The loop stops after the servicer saw it alive and before its command ran: the call ends with UNAVAILABLE
    and the loop's reason (GetLoad and ResetPrefixCache used to end with UNKNOWN, an unmapped exception)."""
    import grpc

    engine_loop = EngineLoop(ScriptedCore())
    engine_loop.start()
    call = engine_loop.call

    def stop_then_call(fn):
        engine_loop.stop()
        return call(fn)

    monkeypatch.setattr(engine_loop, "call", stop_then_call)
    admin = AdminPolicy.enabled_with(tmp_path)  # ResetPrefixCache and StartProfile are admin RPCs
    servicer = EngineCoreServicer(CoreServerState(engine_loop=engine_loop, admin=admin))
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(getattr(servicer, method)(request_message, context))
    assert (context.code, context.details) == (grpc.StatusCode.UNAVAILABLE, "the engine loop has stopped")


def test_end_streams_ends_an_open_connect_stream_and_aborts_its_requests():
    """At the server's stop, after the drain, a frontend's Connect stream still open (it never half-closes) ends
    with OK instead of being cancelled by grpc, and the request still on it is aborted. ScriptedCore requests
    run NUM_TOKENS steps; the engine is held between steps so that "r" cannot finish first."""
    import threading

    hold = threading.Event()

    class HeldCore(ScriptedCore):
        def __init__(self) -> None:
            super().__init__()
            self.aborted: list[str] = []

        def step(self) -> EngineCoreOutputs:
            hold.wait(5)
            return super().step()

        def abort_requests(self, request_ids: list[str]) -> None:
            self.aborted += [i for i in request_ids if i in self.left]
            super().abort_requests(request_ids)

    core = HeldCore()
    engine_loop = EngineLoop(core)
    engine_loop.start()
    state = CoreServerState(engine_loop=engine_loop)
    servicer = EngineCoreServicer(state)

    async def scenario() -> list[core_pb.EngineCoreOutputs]:
        async def messages():
            yield core_pb.EngineCoreClientMessage(
                add=core_pb.EngineCoreRequest(
                    request_id="r", prompt_token_ids=[1, 2], sampling_params=core_pb.SamplingParams()
                )
            )
            await asyncio.Event().wait()  # the frontend keeps its stream open

        received = []

        async def consume():
            async for message in servicer.Connect(messages(), None):
                received.append(message)

        stream = asyncio.create_task(consume())
        while not core.left:  # "r" is in the core
            await asyncio.sleep(0.01)
        assert len(state.outboxes) == 1
        state.end_streams()
        await asyncio.wait_for(stream, timeout=5)  # ended: not cancelled, not waiting for "r"
        return received

    try:
        received = asyncio.run(scenario())
        deadline = time.monotonic() + 5
        while core.left and time.monotonic() < deadline:  # the abort reaches the engine thread between steps
            hold.set()
            time.sleep(0.01)
        assert received == [] and core.aborted == ["r"] and not state.outboxes
    finally:
        hold.set()
        engine_loop.stop()
