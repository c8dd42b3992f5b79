"""The demo model: a seeded ``small`` Llama checkpoint with the builtin tokenizer, built on first use."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from splitserve import envs

DEMO_ARCH, DEMO_PRESET, DEMO_SEED = "llama", "small", 0
logger = logging.getLogger(__name__)


def demo_model_path() -> Path:
    """Path of the demo checkpoint, building it (a few seconds) when the cache lacks it."""
    path = envs.cache_dir() / f"demo-{DEMO_ARCH}-{DEMO_PRESET}-seed{DEMO_SEED}"
    if (path / "config.json").is_file():
        return path
    from splitserve.test_model import make_test_model

    logger.info("building the demo model into %s (first use only)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash never leaves a half-written checkpoint behind.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        make_test_model(tmp, arch=DEMO_ARCH, preset=DEMO_PRESET, seed=DEMO_SEED)
        tmp.rename(path)
    except OSError:
        if not (path / "config.json").is_file():  # not a concurrent builder winning the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
