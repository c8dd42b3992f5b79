"""A request's structured-output state, as the scheduler sees it (vLLM ``StructuredOutputRequest``): the
constraint, and its grammar once compiled off the engine loop's thread. No torch, no xgrammar: the grammar is
any object with ``accept_token`` / ``is_terminated`` (``core_svc.structured_output.XgrammarGrammar``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from splitserve.base.structured_outputs import StructuredOutputsParams


class Grammar(Protocol):
    """One request's matcher over the compiled constraint."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted where the grammar is complete."""
        ...


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    future: Future[Grammar]  # the compilation, on the manager's thread pool

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed: ``error``)."""
        return self.future.done()

    @property
    def grammar(self) -> Grammar:
        """The matcher; call once ``is_ready`` and ``error`` is None."""
        return self.future.result()

    @property
    def error(self) -> BaseException | None:
        return self.future.exception() if self.future.done() else None
