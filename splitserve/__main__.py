"""``python -m splitserve ...``: the ``splitserve`` command."""

from __future__ import annotations

import sys

from splitserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
