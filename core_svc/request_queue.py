"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival_time, request_id)), as vLLM's
``request_queue.py``."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from core_svc.config import SchedulingPolicy
from core_svc.request import Request


class RequestQueue(Protocol):
    def add_request(self, request: Request) -> None: ...
    def prepend_request(self, request: Request) -> None: ...
    def peek_request(self) -> Request: ...
    def pop_request(self) -> Request: ...
    def remove_requests(self, requests: set[Request]) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek_request(self) -> Request:
        return self._queue[0]

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def remove_requests(self, requests: set[Request]) -> None:
        self._queue = deque(r for r in self._queue if r not in requests)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Lowest ``priority`` first, then earliest arrival, then request id. Preempted requests simply re-enter
    the heap at their place."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.request_id, request))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][3]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove_requests(self, requests: set[Request]) -> None:
        self._heap = [entry for entry in self._heap if entry[3] not in requests]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
