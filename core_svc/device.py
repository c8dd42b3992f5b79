"""The device the core runs on: checked at startup, before anything slow, with the fix when torch cannot use it;
its allocator's cache released after an out-of-memory step; on CPU, the C library's allocator told to keep what a
step frees, and the KV cache in huge pages."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
from pathlib import Path

import torch

from core_svc.errors import DeviceUnavailableError
from splitserve.base import cpu_threads, envs

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


# glibc's malloc.h: mallopt's parameters.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# The largest block served from the heap rather than mapped for itself (the most glibc takes on 64-bit: 32 MiB), and
# the free memory at the heap's top kept rather than given back to the system.
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 1 << 30
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own settings, read at process start


def keep_freed_memory() -> str:
    """Tell the C library's allocator (glibc's ``mallopt``) to keep the memory a CPU step frees for the next step:
    blocks up to ``MALLOC_MMAP_THRESHOLD`` come from the heap instead of a mapping of their own, and up to
    ``MALLOC_TRIM_THRESHOLD`` of free heap is kept. By default glibc maps large blocks itself, raising that bound
    only as it sees them freed, and trims the heap's top when more than twice it is free, so a prefill step's
    activations (megabytes each: torch's CPU allocator keeps no cache) were mapped, touched page by page and
    given back again step after step. Measured (docs/benchmarks.md, "The allocator keeps a step's memory"): int8's
    batch throughput on ``small`` went from 1497-1870 to 1979-2064 output tokens/s (four alternated rounds each),
    float32's stayed within its spread. The cost is the peak's memory staying with the process
    (at most ``MALLOC_TRIM_THRESHOLD`` of it free), as tcmalloc, which vLLM's CPU images preload, keeps it too.
    Left alone where ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is set, and where the C library has
    no ``mallopt`` (not glibc). Returns what was done, for the startup log."""
    if any(name in os.environ for name in MALLOC_ENV):
        return "malloc: as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set"
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return "malloc: the C library's defaults (it has no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)):
        return "malloc: the C library's defaults (mallopt refused the thresholds)"
    return (
        f"malloc: blocks up to {MALLOC_MMAP_THRESHOLD >> 20} MiB from the heap, up to "
        f"{MALLOC_TRIM_THRESHOLD >> 30} GiB of freed memory kept for the next step"
    )


def transparent_huge_pages_mode() -> str | None:
    """Linux's transparent huge page mode for this process: the bracketed word of
    ``/sys/kernel/mm/transparent_hugepage/enabled`` (``always``, ``madvise`` or ``never``), or ``never`` where the
    process has them turned off (``prctl(PR_SET_THP_DISABLE)``: ``THP_enabled: 0`` in ``/proc/self/status``); None
    where the file is missing or unreadable (not Linux, no THP)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    match = re.search(r"\[(\w+)\]", text)
    if match is None:
        return None
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    return "never" if re.search(r"^THP_enabled:\s*0\s*$", status, re.MULTILINE) else match.group(1)


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed CPU tensor in memory of its own (an anonymous mapping, never touched before) that Linux was asked
    (``madvise(MADV_HUGEPAGE)``) to back with transparent huge pages, its pages then touched so they are mapped at
    once. Why: a decode step reads every request's keys and values from blocks scattered over the KV cache, and
    with 4 KiB pages nearly each of their 16 KiB blocks cost a few TLB misses. A 64-row decode step of ``small`` on
    two threads: attention 10.5-11.1 ms over the cache in 4 KiB pages, 9.95 ms in huge pages, blocks in order;
    12.3 against 10.9 ms scattered (docs/benchmarks.md, "Prefill attention over the paged cache"; times with the
    softmax's exp then scalar, but the same difference). A mapping of its own, because memory the allocator hands
    back from its heap may have been touched already (the profile run's activations), and touched pages stay small.

    Returns the tensor and whether the advice was taken: False off Linux, where the THP mode is ``never`` or
    unreadable or the process has THP turned off (``transparent_huge_pages_mode``), where madvise is refused, where
    the mapping itself is refused (then the tensor is torch's own allocation), or for an empty shape; the tensor is
    zeroed memory either way. True says Linux may back the cache with huge pages, not that it had 2 MiB pages to
    spare. The mapping lives as long as the tensor (``torch.frombuffer`` keeps it)."""
    numel = math.prod(shape)
    if numel == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype), False
    try:
        mapping = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # ENOMEM under an overcommit limit: torch's allocation then says so in its own words
        return torch.zeros(shape, dtype=dtype), False
    # madvise succeeds under "never" too (the advice is kept for a later change of mode), so ask the mode as well
    advised = transparent_huge_pages_mode() in ("always", "madvise")
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # EINVAL: not built into the kernel
        advised = False
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
    return tensor.zero_(), advised  # zero already (a new mapping): written to map every page now, not mid-step


def set_compute_threads(num_threads: int | None, bind: str | None = None) -> str:
    """Give torch ``num_threads`` compute threads, or when None the cores this process may use (CPU affinity and
    cgroup quota; ``OMP_NUM_THREADS`` when set: ``splitserve.base.cpu_threads``); with a binding ``bind``
    (``--cpu-omp-threads-bind``; None: ``$SPLITSERVE_CPU_OMP_THREADS_BIND``) one thread per CPU of it, every thread
    of the process allowed on those CPUs again (the OpenMP runtime bound the one that loaded it to the first).
    Returns the choice, its reason, the binding and the OpenMP wait policy in words, for the startup log.

    Raises:
        ValueError: ``num_threads`` below 1, or other than the binding's CPU count; a binding that is refused.
    """
    source = "--cpu-omp-threads-bind" if bind is not None else "SPLITSERVE_CPU_OMP_THREADS_BIND"
    value = bind if bind is not None else envs.cpu_omp_threads_bind()
    cpus = cpu_threads.bind_cpus(value, cpu_threads.allowed_cpus(os.environ), cpu_threads.cgroup_cpu_quota(), source)
    bound = cpu_threads.places_cpus(os.environ)
    if cpus is not None and bound is not None:  # bound before torch loaded (cpu_threads.prepare_process)
        cpus = bound
    if cpus is None:
        choice = cpu_threads.detect_threads(num_threads)
        binding = "nobind"
    else:
        if num_threads is not None and num_threads != len(cpus):
            raise ValueError(f"--num-threads {num_threads} and {source}={value} ({len(cpus)} CPUs) disagree")
        cpu_threads.pin_threads(cpus)
        choice = cpu_threads.ThreadChoice(len(cpus), f"one per CPU of {source}={value}")
        binding = f"CPUs {cpu_threads.format_cpu_list(cpus)}, " + (
            f"OMP_PLACES={os.environ['OMP_PLACES']} OMP_PROC_BIND={os.environ.get('OMP_PROC_BIND')}"
            if bound
            else "threads not bound one per CPU: torch was imported before the binding could be set"
        )
    torch.set_num_threads(choice.num_threads)
    return (
        f"CPU threads: {torch.get_num_threads()} ({choice.reason}); binding: {binding}; OpenMP wait policy: "
        f"{cpu_threads.wait_policy_text(os.environ)}"
    )
