"""ThreadToLoopQueue: items from another thread reach the bound event loop in order, an exception is raised where
it stands, and a new loop starts empty."""

import asyncio
import threading

import pytest

from splitserve.base.thread_handoff import ThreadToLoopQueue


def test_items_from_a_thread_arrive_in_order_and_an_exception_is_raised_in_its_place():
    queue: ThreadToLoopQueue[int] = ThreadToLoopQueue()

    async def consume() -> list[object]:
        queue.bind()
        thread = threading.Thread(target=lambda: (queue.put_threadsafe(1, 2), queue.put_threadsafe(ValueError("x"))))
        thread.start()
        got: list[object] = [await queue.get(), await queue.get()]
        with pytest.raises(ValueError, match="^x$"):
            await queue.get()
        thread.join()
        queue.put_nowait(3)  # on the loop's own thread
        got.append(await queue.get())
        return got

    assert asyncio.run(consume()) == [1, 2, 3]


def test_unbound_items_are_dropped_and_a_new_loop_starts_empty():
    queue: ThreadToLoopQueue[int] = ThreadToLoopQueue()
    queue.put_threadsafe(1)  # nobody takes items yet
    assert not queue.is_bound

    async def put_and_leave() -> None:
        queue.bind()
        queue.put_nowait(2)

    asyncio.run(put_and_leave())
    queue.put_threadsafe(3)  # that loop has closed

    async def take_next() -> int:
        queue.bind()
        queue.put_threadsafe(4)
        return await queue.get()

    assert asyncio.run(take_next()) == 4
    with pytest.raises(RuntimeError, match="not bound"):
        ThreadToLoopQueue().put_nowait(5)
