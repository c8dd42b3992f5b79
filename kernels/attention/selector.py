"""Choosing an attention backend by name (as vLLM's ``vllm/attention/selector.py``): the interface lives in
``backend``, each backend in its own module, and only this module imports them all, so every file imports
downward.

``triton`` (``triton_attn``) is the GPU backend: Triton kernels (OpenAI's Python-embedded GPU kernel language,
compiled on first use per shape class) for the KV write and for one-launch paged attention of mixed batches. Its
module is imported only when it is chosen, so a CPU core never imports triton.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from kernels.attention import cpu_ops
from kernels.attention.backend import AttentionBackend
from kernels.attention.cpu import CpuAttentionBackend
from kernels.attention.torch_ref import TorchRefAttentionBackend

logger = logging.getLogger(__name__)

# The same names as core_svc.config.ATTENTION_BACKEND_NAMES (kernels may not import core_svc; a test compares them).
BACKEND_NAMES = ("auto", "cpu", "torch_ref", "triton", "flash_attn")
# Values of TRITON_INTERPRET that Triton reads as true.
_TRUE_VALUES = ("1", "true", "yes", "on")
# What falling back from the kernel to the reference costs, measured by ``python -m benchmarks.decode_attention
# --model <small checkpoint>`` on 2 cores (docs/benchmarks.md#decode-attention-kernel-and-reference).
FALLBACK_COST = (
    "decode attention 5-15 times slower, and 1.8 times fewer output tokens/s for the small test model with 64 "
    "requests of 64-400 prompt tokens (more with longer contexts)"
)


def get_attention_backend(name: str, device: torch.device | str, build_dir: Path) -> AttentionBackend:
    """Backend by name on ``device``: ``cpu`` (compiled decode kernel, built on first use into ``build_dir``, see
    ``cpu_ops.load``), ``torch_ref`` (plain torch, runs anywhere), ``triton`` (Triton kernels: on CUDA, or on CPU
    in Triton's interpreter when ``TRITON_INTERPRET=1``, slowly, for tests), or ``auto``: ``triton`` on CUDA;
    on CPU ``cpu`` when its kernel builds and loads, else ``torch_ref`` with a WARNING giving the reason, what the
    reference costs and the fix; ``torch_ref`` on other devices.

    Raises:
        ValueError: an unknown name.
        RuntimeError: ``cpu`` asked for explicitly and its kernel cannot be built or loaded
            (``cpu_ops.KernelBuildError``, whose message ends with the compiler's output); ``triton`` on a device
            it cannot run on, or without the triton package; ``flash_attn``, not available in this build.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            name = "triton"
        else:
            name = "cpu" if device_type == "cpu" and _kernel_loads(build_dir) else "torch_ref"
    if name == "triton":
        return _triton_backend(torch.device(device))
    if name == "flash_attn":
        raise RuntimeError("the flash_attn attention backend is not available in this build; use triton on CUDA")
    if name == "cpu":
        return CpuAttentionBackend(build_dir)
    return TorchRefAttentionBackend()


def _triton_backend(device: torch.device) -> AttentionBackend:
    """The ``triton`` backend, importing triton only now.

    Raises:
        RuntimeError: ``device`` is not CUDA and ``TRITON_INTERPRET=1`` is not set, or triton cannot be imported.
    """
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "").strip().lower() not in _TRUE_VALUES:
        raise RuntimeError(
            f"the triton attention backend needs a CUDA device, got {device}; or set TRITON_INTERPRET=1 to "
            "interpret its kernels on CPU (slowly, for tests)"
        )
    try:
        from kernels.attention.triton_attn import TritonAttentionBackend
    except ImportError as e:
        raise RuntimeError(
            f"the triton attention backend needs the triton package, which cannot be imported ({e}); fix: "
            "pip install triton"
        ) from e
    return TritonAttentionBackend(device)


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
