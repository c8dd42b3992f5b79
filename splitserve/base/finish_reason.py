"""Why a request finished, as both services name it (vLLM's ``FinishReason``)."""

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
