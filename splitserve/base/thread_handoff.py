"""Items handed from a thread to an asyncio event loop: the engine core's outputs, from the ``EngineLoop`` thread to
a ``Connect`` stream (the core's server) or to ``AsyncLLM`` (the in-process client), and from the gRPC client's
transport thread to ``AsyncLLM``. The one place where another thread gives the event loop work."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class ThreadToLoopQueue(Generic[T]):
    """A FIFO queue put to from any thread and got from on one asyncio event loop: the one that last called
    ``bind`` (``get`` binds too). A later loop (another ``asyncio.run``) binds anew, to an empty queue: what was
    put for the old loop is not carried over. An item put while unbound, or once its loop has closed, is dropped.

    An exception put in the queue is raised by the ``get`` that takes it (an engine core that died, a client that
    was closed), so a waiting consumer hears of it in order, after the items put before it.
    """

    def __init__(self) -> None:
        # One attribute, replaced whole: a thread that reads it sees a loop with its own queue.
        self._bound: tuple[asyncio.AbstractEventLoop, asyncio.Queue[T | BaseException]] | None = None

    def bind(self) -> None:
        """Hand items to the running event loop from now on (nothing changes if it already does).

        Raises:
            RuntimeError: no event loop is running in this thread.
        """
        self._queue()

    @property
    def is_bound(self) -> bool:
        """Whether some event loop takes the items (the callers that never bind take them otherwise)."""
        return self._bound is not None

    def put_threadsafe(self, *items: T | BaseException) -> None:
        """From any thread: queue ``items``, in order, with one wake-up of the loop for all of them."""
        bound = self._bound
        if bound is None or not items:
            return
        loop, queue = bound
        if not loop.is_closed():
            loop.call_soon_threadsafe(_put_all, queue, items)

    def put_nowait(self, item: T | BaseException) -> None:
        """On the bound loop's thread: queue ``item`` now.

        Raises:
            RuntimeError: the queue is not bound to a loop.
        """
        if self._bound is None:
            raise RuntimeError("the queue is not bound to an event loop")
        self._bound[1].put_nowait(item)

    async def get(self) -> T:
        """The next item, waiting for one; binds the queue to this loop first.

        Raises:
            BaseException: the item is an exception.
        """
        item = await self._queue().get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _queue(self) -> asyncio.Queue[T | BaseException]:
        loop = asyncio.get_running_loop()
        if self._bound is None or self._bound[0] is not loop:
            self._bound = (loop, asyncio.Queue())
        return self._bound[1]


def _put_all(queue: asyncio.Queue[T | BaseException], items: tuple[T | BaseException, ...]) -> None:
    for item in items:
        queue.put_nowait(item)
