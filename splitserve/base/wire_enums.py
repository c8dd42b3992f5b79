"""The engine wire's enums as both services use them: why a request finished (vLLM's ``FinishReason``) and what
happened to it in the core (vLLM's ``EngineCoreEventType``)."""

from __future__ import annotations

import enum


class FinishReason(enum.IntEnum):
    """Values equal the wire enum ``splitserve.engine.v1.FinishReason``; ``str()`` gives the API string
    ("stop", "length", "abort", "error")."""

    STOP = 1
    LENGTH = 2
    ABORT = 3
    ERROR = 4

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreEventType(enum.IntEnum):
    """Values equal the wire enum ``splitserve.engine.v1.EngineCoreEventType``."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3
