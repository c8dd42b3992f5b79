"""``TokenizeBudget``: tokenizations on worker threads, at most a budget of text bytes at a time, first come first
served; and the InputProcessor's use of it (a text too long is refused before it waits)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from frontend_svc import ValidationError
from frontend_svc.input_processor import InputProcessor
from frontend_svc.tokenize_budget import TokenizeBudget, utf8_size
from tests.conftest import shared_tokenizer
from tests.test_input_processor import CountingTokenizer, engine_info, load


class Calls:
    """Blocking calls that each wait for their own release, recording the order they start in and the bytes the
    budget holds as each starts."""

    def __init__(self, budget: TokenizeBudget) -> None:
        self.budget = budget
        self.started: list[str] = []
        self.in_use_at_start: list[int] = []
        self.release = {name: threading.Event() for name in "abcdefg"}
        self.running = {name: asyncio.Event() for name in "abcdefg"}

    def call(self, name: str, loop: asyncio.AbstractEventLoop) -> str:
        self.started.append(name)
        self.in_use_at_start.append(self.budget.in_use_bytes)
        loop.call_soon_threadsafe(self.running[name].set)
        assert self.release[name].wait(10)
        return name

    def start(self, name: str, num_bytes: int) -> asyncio.Task[str]:
        loop = asyncio.get_running_loop()
        return asyncio.create_task(self.budget.run(num_bytes, lambda: self.call(name, loop)))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_calls_start_in_order_within_the_budget_and_a_larger_one_runs_alone():
    async def scenario() -> Calls:
        calls = Calls(TokenizeBudget(budget_bytes=100))
        a, b = calls.start("a", 60), calls.start("b", 40)  # 100: both run
        await calls.running["a"].wait()
        await calls.running["b"].wait()
        c = calls.start("c", 500)  # larger than the budget: waits to run alone
        d = calls.start("d", 1)  # behind c, though it would fit once a or b ends
        await settle()
        assert calls.started == ["a", "b"] and calls.budget.in_use_bytes == 100
        calls.release["a"].set()
        await a
        await settle()
        assert calls.started == ["a", "b"] and calls.budget.in_use_bytes == 40  # c waits for b; d for c
        calls.release["b"].set()
        await b
        await calls.running["c"].wait()
        assert calls.budget.in_use_bytes == 100  # c holds all of it
        calls.release["c"].set()
        await c
        await calls.running["d"].wait()
        calls.release["d"].set()
        assert await d == "d"
        assert calls.budget.in_use_bytes == 0
        return calls

    calls = asyncio.run(scenario())
    assert calls.started == ["a", "b", "c", "d"]
    assert calls.in_use_at_start == [60, 100, 100, 1]


def test_a_caller_cancelled_while_waiting_leaves_the_line_and_one_cancelled_while_running_holds_its_bytes():
    """The thread of a cancelled caller runs on: its bytes stay taken until it returns."""

    async def scenario() -> Calls:
        calls = Calls(TokenizeBudget(budget_bytes=100))
        a = calls.start("a", 80)
        await calls.running["a"].wait()
        b, c = calls.start("b", 50), calls.start("c", 20)  # b waits; c waits behind it
        await settle()
        b.cancel()  # leaves the line: c fits beside a
        await calls.running["c"].wait()
        assert calls.budget.in_use_bytes == 100
        a.cancel()  # its thread still runs
        await settle()
        assert a.cancelled() and calls.budget.in_use_bytes == 100
        d = calls.start("d", 50)
        await settle()
        assert "d" not in calls.started
        calls.release["a"].set()  # now a's bytes come back
        await calls.running["d"].wait()
        assert calls.budget.in_use_bytes == 70
        calls.release["c"].set()
        calls.release["d"].set()
        assert [await c, await d] == ["c", "d"]
        assert calls.budget.in_use_bytes == 0
        return calls

    calls = asyncio.run(scenario())
    assert calls.started == ["a", "c", "d"]


def test_an_error_in_the_call_gives_its_bytes_back():
    def refuse() -> int:
        raise ValueError("bad text")

    async def scenario() -> int:
        budget = TokenizeBudget(budget_bytes=10)
        with pytest.raises(ValueError, match="bad text"):
            await budget.run(10, refuse)
        assert await budget.run(10, lambda: 7) == 7
        return budget.in_use_bytes

    assert asyncio.run(scenario()) == 0


def test_utf8_size():
    for text in ["", "hello", "é", "日本語", "🙂👍🏽", "a\udc80b"]:
        assert utf8_size(text) == len(text.encode("utf-8", "surrogatepass"))


def test_a_text_too_long_is_refused_before_it_waits_for_the_budget():
    """The budget is full (a call holds all of it), yet a prompt too long for max_model_len is refused at once,
    without tokenizing; a prompt that fits waits its turn, then is tokenized."""
    tokenizer = CountingTokenizer(load(shared_tokenizer("builtin")))
    processor = InputProcessor(tokenizer, engine_info(max_model_len=64))

    async def scenario() -> list[int]:
        release = threading.Event()
        holding = asyncio.create_task(processor.budget.run(processor.budget.budget_bytes, lambda: release.wait(10)))
        await settle()
        with pytest.raises(ValidationError, match="prompt: the prompt has"):
            await processor.tokenize_async("x" * 10**6)
        waiting = asyncio.create_task(processor.tokenize_async("Hello world"))
        await settle()
        assert not waiting.done() and tokenizer.calls == 0
        release.set()
        await holding
        return (await waiting)[1]

    assert asyncio.run(scenario()) == tokenizer.inner("Hello world").input_ids
    assert tokenizer.calls == 1
