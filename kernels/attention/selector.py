"""Choosing an attention backend by name (as vLLM's ``vllm/attention/selector.py``): the interface lives in
``backend``, each backend in its own module, and only this module imports them all, so every file imports
downward.

``triton`` (``triton_attn``) is the GPU backend: Triton kernels (OpenAI's Python-embedded GPU kernel language,
compiled on first use per shape class) for the KV write and for one-launch paged attention of mixed batches. Its
module is imported only when it is chosen, so a CPU core never imports triton.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.attention import cpu_ops
from kernels.attention.backend import AttentionBackend
from kernels.attention.cpu import CpuAttentionBackend
from kernels.attention.flash_attn_backend import (
    FLASH_ATTN_MIN_VERSION,
    INSTALL_FLASH_ATTN,
    FlashAttnBackend,
    flash_attn_misfits,
    parse_version,
)
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


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend must fit (vLLM's ``get_attn_backend`` takes the same): the dtype of the queries, keys and
    values (the KV cache's is the same, or narrower on a backend that ``supports_narrow_kv_cache``:
    ``core_svc.engine_core.kv_cache_dtype_for``), tokens per KV block, and the head size (elements)."""

    dtype: torch.dtype
    block_size: int
    head_size: int


def get_attention_backend(
    name: str, device: torch.device | str, build_dir: Path, spec: AttentionSpec | None = None
) -> AttentionBackend:
    """Backend by name on ``device``: ``cpu`` (compiled decode kernel, built on first use into ``build_dir``, see
    ``cpu_ops.load``), ``torch_ref`` (plain torch, runs anywhere), ``flash_attn`` (the flash-attn package, CUDA
    only, when ``spec`` fits it: ``flash_attn_backend.flash_attn_misfits``), ``triton`` (Triton kernels: on CUDA,
    or on CPU in Triton's interpreter when ``TRITON_INTERPRET=1``, slowly, for tests), or ``auto``: on CPU ``cpu``
    when its kernel builds and loads, else ``torch_ref`` with a WARNING giving the reason, what the reference costs
    and the fix; on CUDA ``flash_attn`` when flash-attn imports and fits ``spec``, else ``triton`` (the choice and
    its reason logged at INFO); elsewhere ``torch_ref``.

    Raises:
        ValueError: an unknown name; ``flash_attn`` asked for explicitly where it cannot serve (not installed, not
            on CUDA, a dtype, block size, head size or GPU it does not support, no ``spec``), every reason given
            with its numbers and fix.
        RuntimeError: ``cpu`` asked for explicitly and its kernel cannot be built or loaded
            (``cpu_ops.KernelBuildError``, whose message ends with the compiler's output); ``triton`` on a device
            it cannot run on, or without the triton package.
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(BACKEND_NAMES)}")
    device = torch.device(device)
    if name == "auto" and device.type == "cuda":
        name = choose_cuda_backend(device, spec)
    elif name == "auto":
        name = "torch_ref" if device.type != "cpu" or not _kernel_loads(build_dir) else "cpu"
    if name == "flash_attn":
        reasons = flash_attn_unfit_reasons(device, spec)
        if reasons:
            raise ValueError(f"the flash_attn attention backend cannot serve here: {'; '.join(reasons)}")
        return FlashAttnBackend()
    if name == "triton":
        return _triton_backend(device)
    if name == "cpu":
        return CpuAttentionBackend(build_dir)
    return TorchRefAttentionBackend()


def choose_cuda_backend(device: torch.device, spec: AttentionSpec | None) -> str:
    """``auto`` on CUDA: ``flash_attn`` when flash-attn imports and fits ``spec``, else ``triton``; logs which at
    INFO, and why."""
    reasons = flash_attn_unfit_reasons(device, spec)
    if reasons or spec is None:  # (no spec is one of the reasons)
        logger.info("attention backend: triton, not flash_attn, since %s", "; ".join(reasons))
        return "triton"
    logger.info(
        "attention backend: flash_attn (flash-attn imports and fits %s, block_size %d, head_size %d)",
        str(spec.dtype).removeprefix("torch."),
        spec.block_size,
        spec.head_size,
    )
    return "flash_attn"


def flash_attn_unfit_reasons(device: torch.device, spec: AttentionSpec | None) -> list[str]:
    """Why the flash_attn backend cannot serve on ``device`` for ``spec``, each reason with its numbers and fix
    (empty: it can). The GPU's compute capability is checked when CUDA is available."""
    if device.type != "cuda":
        return [f"it runs on CUDA only, and the device is {device.type} (pass --device cuda)"]
    try:
        flash_attn = importlib.import_module("flash_attn")
    except ModuleNotFoundError:
        return [f"the flash-attn package is not installed (to install it: {INSTALL_FLASH_ATTN})"]
    except Exception as e:  # ImportError, OSError: a build for another torch or CUDA fails to load its library
        return [f"the flash-attn package does not import ({type(e).__name__}: {e}; reinstall it: {INSTALL_FLASH_ATTN})"]
    version = str(getattr(flash_attn, "__version__", "unknown"))
    if parse_version(version) < FLASH_ATTN_MIN_VERSION:
        minimum = ".".join(map(str, FLASH_ATTN_MIN_VERSION))
        return [
            f"flash-attn {version} is older than {minimum}, the first to page its KV cache (fix: {INSTALL_FLASH_ATTN})"
        ]
    if spec is None:
        return ["the model's dtype, block size and head size were not given (AttentionSpec)"]
    capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
    return flash_attn_misfits(spec.dtype, spec.block_size, spec.head_size, capability)


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
