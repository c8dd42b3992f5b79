"""How much text a frontend tokenizes at once. Tokenizing takes memory per token (about 200 to 400 bytes with
Hugging Face tokenizers: the ids, offsets and token strings of the encoding), and a text of n UTF-8 bytes can have
up to n tokens (byte-level and byte-fallback tokenizers), so a few large texts tokenized at once could take
gigabytes. ``TokenizeBudget`` runs tokenizations on its own threads while the text they hold together fits in a
budget of bytes; the others wait their turn, first come first served.

Image preprocessing runs on the same threads and is charged to the same budget, its estimated memory converted at
``MEMORY_BYTES_PER_TEXT_BYTE`` (``budget_bytes_of_memory``): text and images compete for the same memory, and one
line keeps them first come first served with no second budget to wait for while holding the first.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# 4 MiB of text: up to about 4M tokens, 1.5 GB, in the worst case (one token per byte); 0.5 GB for ordinary text
# (3 bytes per token). Ordinary prompts (kilobytes) never wait for each other; a text larger than the budget
# waits until it can run alone.
DEFAULT_BUDGET_BYTES = 4 * 2**20
# Memory that a byte of the budget stands for when work other than tokenizing is charged to it: tokenizing takes
# about 100 to 200 bytes of memory per byte of text (docs/operations.md), the low end taken. Image requests running
# together under the 4 MiB budget are estimated at 512 MiB at most; one estimated at more runs alone (``run``), so
# the peak is the larger of 512 MiB and the largest single request (docs/operations.md, "Preprocessing at once").
MEMORY_BYTES_PER_TEXT_BYTE = 128


def utf8_size(text: str) -> int:
    """``text``'s size in UTF-8 bytes (O(1) for ASCII text, whose size CPython knows)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def budget_bytes_of_memory(memory_bytes: int) -> int:
    """The budget bytes charged for work estimated to take ``memory_bytes`` of memory (rounded up)."""
    return -(-max(memory_bytes, 0) // MEMORY_BYTES_PER_TEXT_BYTE)


class TokenizeBudget:
    """Runs tokenizations (any blocking call) on worker threads, at most ``budget_bytes`` of text at a time.

    A call's bytes are taken when it starts and given back when its thread is done, even if its caller was
    cancelled meanwhile (a thread cannot be stopped). Used from one event loop.
    """

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.in_use_bytes = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def num_waiting(self) -> int:
        """Calls waiting for their turn (a cancelled one leaves the line at once)."""
        return len(self._waiting)

    async def run(self, num_bytes: int, fn: Callable[[], T]) -> T:
        """``fn()`` on a worker thread, once ``num_bytes`` (the text's UTF-8 size) fit in the budget beside what
        runs already; a text larger than the whole budget runs alone. Callers start in the order they came."""
        loop = asyncio.get_running_loop()
        need = min(max(num_bytes, 0), self.budget_bytes)
        await self._take(need, loop)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="splitserve-tokenize")
        try:
            future = self._executor.submit(fn)
        except BaseException:
            self._give_back(need)
            raise

        def done(_: concurrent.futures.Future[T]) -> None:  # on the worker thread, or here if cancelled unstarted
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._give_back, need)

        future.add_done_callback(done)
        return await asyncio.wrap_future(future)

    async def _take(self, need: int, loop: asyncio.AbstractEventLoop) -> None:
        if not self._waiting and self.in_use_bytes + need <= self.budget_bytes:
            self.in_use_bytes += need
            return
        turn: asyncio.Future[None] = loop.create_future()
        self._waiting.append((need, turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # its turn came as it was cancelled
                self._give_back(need)
            else:
                if (need, turn) in self._waiting:
                    self._waiting.remove((need, turn))
                self._start_waiting()  # the next in line may fit now
            raise

    def _give_back(self, need: int) -> None:
        self.in_use_bytes -= need
        self._start_waiting()

    def _start_waiting(self) -> None:
        while self._waiting and self.in_use_bytes + self._waiting[0][0] <= self.budget_bytes:
            need, turn = self._waiting.popleft()
            if not turn.cancelled():  # a cancelled caller takes itself out of the line
                self.in_use_bytes += need
                turn.set_result(None)
