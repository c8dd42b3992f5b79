"""A split frontend's process as in the frontend image, which has no torch: torch hidden from imports.

The frontend never computes with torch (tokenizers, chat templates and image processors run on numpy and PIL),
but transformers imports torch, and with it ``torch.distributed`` and sympy, as soon as a tokenizer or a config
loads when torch is installed beside it: on the project's 2-core machine that made loading a tokenizer take 4.0 s
instead of 1.3 s, and the process's exit 0.8 s more. It also lets transformers choose torch-backed image
processors where the image uses PIL's. ``splitserve frontend`` (cores on the network) hides torch before anything
imports transformers, so a frontend starts and preprocesses the same whatever else is installed; ``splitserve
serve``, which runs its core in the same process, keeps it.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from typing import Any

# What transformers logs at import when it finds no torch: true of every frontend, and nothing to act on.
_TRANSFORMERS_NO_TORCH_ADVICE = "PyTorch was not found."


class _WithoutTorch(importlib.abc.MetaPathFinder):
    """Wraps one import finder so that it finds no ``torch`` (nor any ``torch.*``) module or distribution."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name == "torch" or name.startswith("torch."):
            return None
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """``importlib.metadata`` asks here too: no torch distribution either."""
        if not hasattr(self.inner, "find_distributions"):
            return iter(())
        return (d for d in self.inner.find_distributions(*args, **kwargs) if d.metadata["Name"] != "torch")

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


class _DropNoTorchAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TRANSFORMERS_NO_TORCH_ADVICE)


def hide_torch() -> bool:
    """Make ``import torch`` raise ModuleNotFoundError and ``importlib.util.find_spec("torch")`` (what transformers
    checks) return None in this process, from now on, and drop transformers' "PyTorch was not found" advice.
    Returns False, changing nothing, when torch is already imported."""
    if "torch" in sys.modules:
        return False
    if not any(isinstance(finder, _WithoutTorch) for finder in sys.meta_path):
        sys.meta_path[:] = [_WithoutTorch(finder) for finder in sys.meta_path]
    logging.getLogger("transformers").addFilter(_DropNoTorchAdvice())
    return True
