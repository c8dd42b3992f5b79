"""The demo model: a seeded ``small`` Llama checkpoint with the builtin tokenizer, built on first use; and the
cache of seeded checkpoints it lives in (the benchmarks keep theirs there too)."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from splitserve import envs

DEMO_ARCH, DEMO_PRESET, DEMO_SEED = "llama", "small", 0
logger = logging.getLogger(__name__)


def cached_test_model(name: str, **make_test_model_args: Any) -> Path:
    """``$SPLITSERVE_CACHE_DIR/<name>``, built by ``make_test_model(**make_test_model_args)`` (a few seconds)
    when the cache lacks it."""
    path = envs.cache_dir() / name
    if (path / "config.json").is_file():
        return path
    from splitserve.test_model import make_test_model

    logger.info("building %s (first use only)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a crash never leaves a half-written checkpoint behind.
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent))
    try:
        make_test_model(tmp, **make_test_model_args)
        tmp.rename(path)
    except OSError:
        if not (path / "config.json").is_file():  # not a concurrent builder winning the rename
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def demo_model_path() -> Path:
    """Path of the demo checkpoint, building it when the cache lacks it."""
    return cached_test_model(
        f"demo-{DEMO_ARCH}-{DEMO_PRESET}-seed{DEMO_SEED}", arch=DEMO_ARCH, preset=DEMO_PRESET, seed=DEMO_SEED
    )
