"""``python -m splitserve ...``: the ``splitserve`` command."""

from __future__ import annotations

from splitserve.entrypoints.cli import run

if __name__ == "__main__":
    run()
