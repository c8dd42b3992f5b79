"""The device the core runs on: checked at startup, before anything slow, with the fix when torch cannot use it;
its allocator's cache released after an out-of-memory step."""

from __future__ import annotations

import os

import torch

from core_svc.errors import DeviceUnavailableError
from splitserve.base import cpu_threads

INSTALL_CUDA_TORCH = (
    'install torch\'s CUDA build for your driver (README.md, "Running on a GPU"), e.g. pip install torch '
    "--index-url https://download.pytorch.org/whl/cu128"
)


def check_device(name: str) -> torch.device:
    """``torch.device(name)`` once torch can run on it (``cpu`` always can).

    Raises:
        DeviceUnavailableError: ``cuda`` with a torch built without CUDA (``torch.version.cuda`` is None), or with
            no GPU visible to the process (``CUDA_VISIBLE_DEVICES``, the driver, a container without GPUs); the
            message says which and the fix.
    """
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if torch.version.cuda is None:
        raise DeviceUnavailableError(
            f"--device cuda: this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None); "
            f"{INSTALL_CUDA_TORCH}"
        )
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "unset" if visible is None else repr(visible)
        raise DeviceUnavailableError(
            f"--device cuda: torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no GPU "
            f"(CUDA_VISIBLE_DEVICES is {shown}). Check that nvidia-smi lists a GPU (the NVIDIA driver is installed "
            "and loaded), that CUDA_VISIBLE_DEVICES names it, and in a container that it was given GPUs (docker "
            "run --gpus all / the NVIDIA Container Toolkit; a nvidia.com/gpu limit in Kubernetes)"
        )
    return device


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back (``torch.cuda.empty_cache`` on CUDA; nothing on CPU), so
    that the next step starts from what is really in use rather than from a fragmented cache."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def set_compute_threads(num_threads: int | None) -> str:
    """Give torch ``num_threads`` compute threads, or when None the cores this process may use (CPU affinity and
    cgroup quota; ``OMP_NUM_THREADS`` when set: ``splitserve.base.cpu_threads``); returns the choice, its reason and
    the OpenMP wait policy in words, for the startup log.

    Raises:
        ValueError: ``num_threads`` below 1.
    """
    choice = cpu_threads.detect_threads(num_threads)
    torch.set_num_threads(choice.num_threads)
    return (
        f"CPU threads: {torch.get_num_threads()} ({choice.reason}); OpenMP wait policy: "
        f"{cpu_threads.wait_policy_text(os.environ)}"
    )
