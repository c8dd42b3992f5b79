"""Choosing an attention backend by name (as vLLM's ``vllm/attention/selector.py``): the interface lives in
``backend``, each backend in its own module, and only this module imports them all, so every file imports
downward.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kernels.attention import cpu_ops
from kernels.attention.backend import AttentionBackend
from kernels.attention.cpu import CpuAttentionBackend
from kernels.attention.torch_ref import TorchRefAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "torch_ref")
# What falling back from the kernel to the reference costs, measured by ``python -m benchmarks.decode_attention
# --model <small checkpoint>`` on 2 cores (docs/benchmarks.md#decode-attention-kernel-and-reference).
FALLBACK_COST = (
    "decode attention 5-15 times slower, and 1.8 times fewer output tokens/s for the small test model with 64 "
    "requests of 64-400 prompt tokens (more with longer contexts)"
)


def get_attention_backend(name: str, device: torch.device | str, build_dir: Path) -> AttentionBackend:
    """Backend by name on ``device``: ``cpu`` (compiled decode kernel, built on first use into ``build_dir``, see
    ``cpu_ops.load``), ``torch_ref`` (plain torch, runs anywhere), or ``auto``: ``cpu`` on CPU when its kernel
    builds and loads, else ``torch_ref`` with a WARNING giving the reason, what the reference costs and the fix.

    Raises:
        ValueError: an unknown name.
        RuntimeError: ``cpu`` asked for explicitly and its kernel cannot be built or loaded
            (``cpu_ops.KernelBuildError``, whose message ends with the compiler's output).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "torch_ref" if torch.device(device).type != "cpu" or not _kernel_loads(build_dir) else "cpu"
    if name == "cpu":
        return CpuAttentionBackend(build_dir)
    return TorchRefAttentionBackend()


def _kernel_loads(build_dir: Path) -> bool:
    """Load the CPU kernel; on failure log why, what the reference backend costs, and the fix."""
    try:
        cpu_ops.load(build_dir)
        return True
    except cpu_ops.KernelBuildError as e:
        reason, details, fix = e.reason, e.details, e.fix
    except Exception as e:  # anything else the load raised: the reference still serves correctly
        reason, details, fix = f"{type(e).__name__}: {e}", "", cpu_ops.INSTALL_A_COMPILER
    logger.warning(
        "the CPU attention kernel is unavailable (%s), so attention runs on the slower reference backend "
        "'torch_ref'. Cost: %s. Fix: %s; or pass --attention-backend torch_ref to choose the reference.",
        reason,
        FALLBACK_COST,
        fix,
    )
    if details:
        logger.warning("the CPU attention kernel's build: %s", details)
    return False
