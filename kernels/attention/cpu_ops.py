"""Builds and loads the C++ CPU kernels (``csrc/``) with torch's JIT extension builder.

The first ``load()`` in a fresh environment compiles with the system C++ compiler (about 20 s on 2 cores) into
torch's extension folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); later loads reuse the
build, which torch rebuilds when the source or flags change. The library name carries the torch version, so
environments with different torch builds or CPUs never share a binary.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
# -march=native: the build happens on the machine that runs it. -fopenmp: the kernel's OpenMP pragmas, resolved
# against the OpenMP runtime torch has already loaded. -ffast-math: vectorized expf (glibc libmvec) and reassociated
# sums; the kernel sees finite scores only.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


@functools.cache
def _build() -> BaseException | None:
    """The build and load, once per process; a failure is kept, not retried (a failed build costs seconds)."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the ninja wheel (a dependency) when the system has none on PATH
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    # The name carries the torch version and the CPU's feature flags: -march=native code must never be loaded
    # by another kind of CPU sharing the extensions folder (a home directory on several machines, an image).
    name = f"splitserve_cpu_{re.sub(r'[^0-9a-zA-Z]', '_', torch.__version__)}_{_cpu_signature()}"
    logger.info("loading the CPU attention kernel (compiled on first use)")
    try:
        cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS, is_python_module=False)
    except Exception as e:
        return e
    return None


def _cpu_signature() -> str:
    """A short hash of the machine type and the CPU flags /proc/cpuinfo lists (the machine type alone elsewhere)."""
    text = platform.machine()
    try:
        text += next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("flags", "Features"))
        )
    except (OSError, StopIteration):
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def load() -> None:
    """Compile (first time) and load the kernels, registering ``torch.ops.splitserve_cpu.*``.

    Raises:
        RuntimeError: no C++ compiler or ninja, or the build or load failed (the message says which).
    """
    error = _build()
    if error is not None:
        raise RuntimeError(f"cannot build or load {_SOURCE.name}: {error}") from error


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Attention of one query token per request over its paged keys and values, written into ``out``.

    Args:
        out, query: ``[num_reqs, num_heads, head_size]``, contiguous, the cache's dtype (float32, bfloat16 or
            float16; scores and sums are float32).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous.
        block_table: ``[num_reqs, max_blocks]`` int32; seq_lens: ``[num_reqs]`` int32, at least 1.
        sliding_window: keys at positions > seq_len - 1 - W only; None for full attention.
    """
    torch.ops.splitserve_cpu.paged_decode_attention(
        out, query, key_cache, value_cache, block_table, seq_lens, scale, sliding_window or 0
    )
