"""Faults injected into the core's forward, for the fault tests; the production code has no such hook.

``python tests/faulty_core.py MODE <splitserve args>`` runs the ``splitserve`` command (``core`` for the split
stack, or ``serve``) with ``inject(MODE)`` applied, as ``tests/torchless.py`` runs it without torch. In-process
tests call ``faulty_forward`` with pytest's monkeypatch instead. Modes:

- ``poison_once``: the first forward whose batch holds a request whose first prompt token is
  ``POISON_TOKEN_ID`` raises; later ones run (so the same prompt, sent again, shows what the cache kept).
- ``poison``: every forward with such a request raises.
- ``broken``: every forward raises (a dead device).

Only position 0 is checked, so a generated token equal to ``POISON_TOKEN_ID`` never trips it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

POISON_TOKEN_ID = 7
FAULT_MESSAGE = "injected fault"
MODES = ("poison_once", "poison", "broken")


def faulty_forward(mode: str, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``LlamaForCausalLM.forward`` that raises ``RuntimeError(FAULT_MESSAGE)`` as ``mode`` says (see above)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    tripped = []

    def patched(self: Any, input_ids: Any, positions: Any, *args: Any) -> Any:
        poisoned = bool((input_ids[positions == 0] == POISON_TOKEN_ID).any())
        if mode == "broken" or (poisoned and not (mode == "poison_once" and tripped)):
            tripped.append(True)
            raise RuntimeError(FAULT_MESSAGE)
        return forward(self, input_ids, positions, *args)

    return patched


def inject(mode: str) -> None:
    from core_svc.models.llama import LlamaForCausalLM

    LlamaForCausalLM.forward = faulty_forward(mode, LlamaForCausalLM.forward)  # type: ignore[method-assign]  # the fault


if __name__ == "__main__":
    inject(sys.argv[1])
    from splitserve.entrypoints.cli import main

    sys.exit(main(sys.argv[2:]))
