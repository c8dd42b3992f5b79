"""The demo model: a seeded ``small`` Llama checkpoint with the builtin tokenizer, built on first use; the cache of
seeded checkpoints it lives in (the benchmarks keep theirs there too); and the notice that its random weights write
gibberish by design, which ``splitserve demo`` and ``splitserve stack`` print first."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from splitserve.base import envs

DEMO_ARCH, DEMO_PRESET, DEMO_SEED = "llama", "small", 0
DEMO_NAME = f"demo-{DEMO_ARCH}-{DEMO_PRESET}-seed{DEMO_SEED}"  # its folder in the cache
# A small instruct model on the hub, as the notice's example of a real one (docker compose's README line uses it too).
REAL_MODEL_EXAMPLE = "Qwen/Qwen2.5-0.5B-Instruct"
logger = logging.getLogger(__name__)


def cached_test_model(name: str, **make_test_model_args: Any) -> Path:
    """``$SPLITSERVE_CACHE_DIR/<name>``, built by ``make_test_model(**make_test_model_args)`` (a few seconds)
    when the cache lacks it."""
    path = envs.cache_dir() / name
    if (path / "config.json").is_file():
        return path
    from splitserve.entrypoints.test_model import make_test_model

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
    if not build and not (envs.cache_dir() / DEMO_NAME / "config.json").is_file():
        raise ValueError(
            f"no model given (--model or SPLITSERVE_MODEL) and no demo model in {envs.cache_dir()}: a core or "
            "`splitserve serve` builds it on first use; a frontend only reads it"
        )
    return cached_test_model(DEMO_NAME, arch=DEMO_ARCH, preset=DEMO_PRESET, seed=DEMO_SEED)


def is_demo_model(model: str) -> bool:
    """Whether ``model`` (a folder or a hub id, as ``--model`` takes it) is the demo checkpoint's folder."""
    demo = envs.cache_dir() / DEMO_NAME
    return Path(model).expanduser().resolve() == demo.resolve()


def model_notice(model: str, command: str = "demo") -> str:
    """What ``splitserve demo`` or ``splitserve stack`` (``command``) prints first: the model's name and, for the
    demo model, that its random weights write gibberish by design and how to run a real model instead (the
    Makefile's ``run`` target runs ``demo``, its ``stack`` target ``stack``; both take ``MODEL=``)."""
    if not is_demo_model(model):
        return f"Model: {model}"
    target = "run" if command == "demo" else command
    where = "below" if command == "demo" else "it generates"
    return (
        f"Model: the demo checkpoint ({model})\n"
        f"  Its weights are random (it is built for testing), so the text {where} is gibberish by design; every\n"
        "  step (tokenizer, scheduler, KV cache, sampling, streaming) is real.\n"
        f"  For real text: make {target} MODEL={REAL_MODEL_EXAMPLE} (a hub id, needs network)\n"
        f"             or: make {target} MODEL=/path/to/hf-folder (a local Hugging Face checkpoint)\n"
        f"  (splitserve {command} --model ... alike)"
    )
