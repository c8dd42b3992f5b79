"""``python tests/torchless.py <splitserve args>``: the ``splitserve`` command as if torch were not installed.
Every import finder is wrapped so that it finds no ``torch`` (nor any ``torch.*``): ``import torch`` raises
ModuleNotFoundError and ``importlib.util.find_spec("torch")`` is None, which is what transformers checks. A
frontend started this way shows that the frontend image, which has no torch, works."""

from __future__ import annotations

import importlib.abc
import sys
from importlib.machinery import ModuleSpec
from typing import Any


class _WithoutTorch(importlib.abc.MetaPathFinder):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name == "torch" or name.startswith("torch."):
            return None
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, *args: Any, **kwargs: Any) -> Any:
        """importlib.metadata asks here too: no torch distribution either."""
        if not hasattr(self.inner, "find_distributions"):
            return iter(())
        return (d for d in self.inner.find_distributions(*args, **kwargs) if d.metadata["Name"] != "torch")

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


if __name__ == "__main__":
    sys.meta_path[:] = [_WithoutTorch(finder) for finder in sys.meta_path]
    from splitserve.entrypoints.cli import main

    sys.exit(main(sys.argv[1:]))
