"""Large n and half-failed adds on an in-process core (LLMEngine, AsyncLLM): whatever ends a request, nothing of it
stays in the frontend or the core. Functional tests: no timing (``splitserve bench n`` measures the costs)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import pytest

from core_svc.engine_core import EngineCore
from frontend_svc import AsyncLLM, LLMEngine, RequestOutputKind, SamplingParams, ValidationError
from frontend_svc.sampling_params import INT64_MAX
from tests.conftest import real_or_builtin

NUM_KV_BLOCKS = 257
T = TypeVar("T")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model

    return str(
        make_test_model(tmp_path_factory.mktemp("large-n"), "llama", "tiny", tokenizer=real_or_builtin("llama2"))
    )


def on_core_thread(engine: LLMEngine | AsyncLLM, fn: Callable[[EngineCore], T]) -> T:
    """``fn(engine_core)`` where the core's state is whole: on its engine thread, between steps and after every
    command queued before (an abort is applied there request by request), or here when no thread drives it."""
    edge = engine.engine_core._edge()
    engine_loop = edge._engine_loop
    if engine_loop is None:  # LLMEngine: the caller's thread drives the core
        return fn(edge.engine_core)
    return engine_loop.call(fn).result(timeout=300)


def core_leftovers(core: EngineCore) -> tuple[int, bool, int]:
    return len(core.scheduler.requests), core.has_unfinished_requests(), core.scheduler.kv_cache_manager.num_free_blocks


def unfinished(core: EngineCore) -> int:
    return core.scheduler.get_num_unfinished_requests()


def assert_nothing_left(engine: LLMEngine | AsyncLLM) -> None:
    processor = engine.output_processor
    assert not processor.request_states and not processor.parent_requests and not processor.external_req_ids
    assert on_core_thread(engine, core_leftovers) == (0, False, NUM_KV_BLOCKS - 1)


async def until_core_idle(engine: AsyncLLM) -> None:
    """The core's thread applies aborts between steps: wait for it (a hang guard, not a speed check)."""
    for _ in range(600):
        if not on_core_thread(engine, EngineCore.has_unfinished_requests):
            if not engine.output_processor.has_unfinished_requests():
                return
        await asyncio.sleep(0.05)


def test_a_child_refused_half_way_takes_back_those_sent(model, monkeypatch):
    """LLMEngine: the third of 5 children is refused after two reached the core: both are aborted there, and
    nothing of the request stays; the engine then serves a request as usual."""
    engine = LLMEngine(model, num_kv_blocks=NUM_KV_BLOCKS)
    try:
        client = engine.engine_core
        real_add, added = client.add_request, []

        def add_two_then_refuse(request):
            if len(added) == 2:
                raise ValidationError("request", "refused")
            real_add(request)
            added.append(request.request_id)

        monkeypatch.setattr(client, "add_request", add_two_then_refuse)
        params = SamplingParams(n=5, temperature=1.0, max_tokens=400, ignore_eos=True)
        with pytest.raises(ValidationError, match="refused"):
            engine.add_request("half", "hello", params)
        assert len(added) == 2
        assert_nothing_left(engine)
        monkeypatch.undo()
        engine.add_request("next", "hello", SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert sorted(len(c.token_ids) for o in outputs for c in o.outputs if c.finished()) == [3, 3]
        assert_nothing_left(engine)
    finally:
        engine.close()


def test_async_batch_refused_after_some_children_got_in_takes_them_back(model, monkeypatch):
    """AsyncLLM with a client whose batch add fails after the core took two children: generate raises the
    refusal, and those two are aborted in the core."""

    async def scenario():
        engine = AsyncLLM(model, num_kv_blocks=NUM_KV_BLOCKS)
        try:
            client = engine.engine_core
            real_add = client.add_requests_async

            async def add_two_then_refuse(requests):
                await real_add(requests[:2])
                raise ValidationError("request", "refused")

            monkeypatch.setattr(client, "add_requests_async", add_two_then_refuse)
            params = SamplingParams(n=5, temperature=1.0, max_tokens=400, ignore_eos=True)
            with pytest.raises(ValidationError, match="refused"):
                async for _ in engine.generate("hello", params, "half"):
                    pass
            await until_core_idle(engine)
            assert_nothing_left(engine)
        finally:
            engine.close()

    asyncio.run(scenario())


def test_cancelled_during_fan_out_sends_nothing_and_keeps_nothing(model, monkeypatch):
    """The caller goes away while the 4096 children are being registered (between two chunks): no child
    reaches the core, and the frontend forgets those it registered."""

    async def scenario():
        engine = AsyncLLM(model, num_kv_blocks=NUM_KV_BLOCKS)
        try:
            sent = []
            real_send = engine.engine_core.add_requests_async

            async def record_send(requests):
                sent.extend(requests)
                await real_send(requests)

            monkeypatch.setattr(engine.engine_core, "add_requests_async", record_send)
            real_add_child, registered = engine.add_child, []
            task: asyncio.Task[None] | None = None

            def add_child(*args):
                registered.append(args[3])
                if len(registered) == 300 and task is not None:
                    task.cancel()  # delivered at the next yield, after child 383
                return real_add_child(*args)

            monkeypatch.setattr(engine, "add_child", add_child)

            async def consume():
                params = SamplingParams(n=4096, temperature=1.0, max_tokens=400, ignore_eos=True)
                async for _ in engine.generate("hello", params, "gone"):
                    pass

            task = asyncio.create_task(consume())
            with pytest.raises(asyncio.CancelledError):
                await task
            assert 300 <= len(registered) < 4096 and not sent
            await until_core_idle(engine)
            assert_nothing_left(engine)
        finally:
            engine.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_cancelling_a_4096_child_request_leaves_nothing(model, kind):
    """n = 4096, cancelled once it streams (DELTA) or after a while (FINAL_ONLY): the core holds no child and
    every KV block is free, the output processor is empty; another request is served as before."""

    async def scenario():
        engine = AsyncLLM(model, num_kv_blocks=NUM_KV_BLOCKS)
        try:
            started = asyncio.Event()
            params = SamplingParams(n=4096, temperature=1.0, max_tokens=400, ignore_eos=True, output_kind=kind)

            async def consume():
                async for _ in engine.generate("hello", params, "big"):
                    started.set()

            task = asyncio.create_task(consume())
            if kind == RequestOutputKind.DELTA:
                await asyncio.wait_for(started.wait(), 300)
            else:
                while on_core_thread(engine, unfinished) < 4096:  # every child is in the core
                    await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until_core_idle(engine)
            assert_nothing_left(engine)
            small = SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True, output_kind=kind)
            outputs = [o async for o in engine.generate("hello", small, "after")]
            assert outputs[-1].finished
            assert_nothing_left(engine)
        finally:
            engine.close()

    asyncio.run(scenario())


def test_abort_by_the_callers_id_ends_every_completion_of_a_streaming_consumer(model):
    """AsyncLLM.abort("r") while a consumer reads an n = 300 DELTA stream: the consumer's last output is
    finished, and every one of the 300 completions it saw ended ("length" or "abort"), each once."""

    async def scenario():
        engine = AsyncLLM(model, num_kv_blocks=NUM_KV_BLOCKS)
        try:
            params = SamplingParams(n=300, temperature=1.0, max_tokens=400, ignore_eos=True, output_kind="DELTA")
            finish_reasons: dict[int, list[str]] = {}
            last = None
            async for output in engine.generate("hello", params, "r"):
                last = output
                for completion in output.outputs:
                    if completion.finish_reason is not None:
                        finish_reasons.setdefault(completion.index, []).append(completion.finish_reason)
                if any(c.token_ids for c in output.outputs) and not output.finished:
                    await engine.abort("r")
            assert last is not None and last.finished
            assert sorted(finish_reasons) == list(range(300))
            assert all(len(reasons) == 1 and reasons[0] in ("length", "abort") for reasons in finish_reasons.values())
            await until_core_idle(engine)
            assert_nothing_left(engine)
        finally:
            engine.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"priority": 2**40}, "priority"),
        ({"arrival_time": "now"}, "arrival_time"),
        ({"cache_salt": "\ud800"}, "cache_salt"),
        ({"trace_headers": {"traceparent": 7}}, "trace_headers['traceparent']"),
    ],
)
def test_python_api_options_the_wire_cannot_carry_are_refused_up_front(model, kwargs, field):
    engine = LLMEngine(model, num_kv_blocks=NUM_KV_BLOCKS)
    try:
        kwargs = dict(kwargs)
        arrival_time = kwargs.pop("arrival_time", None)
        params = SamplingParams(n=2, temperature=1.0, max_tokens=4)
        with pytest.raises(ValidationError) as info:
            engine.add_request("r", "hello", params, arrival_time, **kwargs)
        assert info.value.field == field
        with pytest.raises(ValidationError) as info:
            engine.add_request("r\udc00", "hello", params)
        assert info.value.field == "request_id"
        assert_nothing_left(engine)
    finally:
        engine.close()


def test_seed_at_the_top_of_int64_is_served_in_process(model):
    """n = 2 with seed 2**63 - 1: child 1's seed wraps to -2**63, and it samples what an n = 1 request seeded
    -2**63 samples (the same generator)."""
    engine = LLMEngine(model, num_kv_blocks=NUM_KV_BLOCKS)
    try:

        def run(request_id, params):
            engine.add_request(request_id, "hello", params)
            outputs = []
            while engine.has_unfinished_requests():
                outputs += engine.step()
            return {c.index: c.token_ids for c in outputs[-1].outputs}

        final = RequestOutputKind.FINAL_ONLY
        two = run("two", SamplingParams(n=2, temperature=1.0, seed=INT64_MAX, max_tokens=8, output_kind=final))
        top = run("top", SamplingParams(temperature=1.0, seed=INT64_MAX, max_tokens=8, output_kind=final))
        wrapped = run("wrapped", SamplingParams(temperature=1.0, seed=-(2**63), max_tokens=8, output_kind=final))
        assert two == {0: top[0], 1: wrapped[0]} and top[0] != wrapped[0]
        assert_nothing_left(engine)
    finally:
        engine.close()
