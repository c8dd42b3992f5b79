"""``python tests/torchless.py <splitserve args>``: the ``splitserve`` command as if torch were not installed
(``frontend_svc.without_torch.hide_torch`` before anything runs): ``import torch`` raises ModuleNotFoundError and
``importlib.util.find_spec("torch")`` is None, which is what transformers checks. ``splitserve frontend`` does this
itself; a ``serve`` or a tool started this way shows that it needs no torch, as in the frontend image."""

from __future__ import annotations

import sys

from frontend_svc.without_torch import hide_torch

if __name__ == "__main__":
    hide_torch()
    from splitserve.entrypoints.cli import main

    sys.exit(main(sys.argv[1:], owns_process=True))
