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


def demo_model_path(build: bool = True) -> Path:
    """Path of the demo checkpoint, building it (with torch) when the cache lacks it.

    Raises:
        ValueError: ``build`` is False and the cache lacks it (a frontend, which has no torch, never builds it).
    """
    name = f"demo-{DEMO_ARCH}-{DEMO_PRESET}-seed{DEMO_SEED}"
    if not build and not (envs.cache_dir() / name / "config.json").is_file():
        raise ValueError(
            f"no model given (--model or SPLITSERVE_MODEL) and no demo model in {envs.cache_dir()}: a core or "
            "`splitserve serve` builds it on first use; a frontend only reads it"
        )
    return cached_test_model(name, arch=DEMO_ARCH, preset=DEMO_PRESET, seed=DEMO_SEED)
