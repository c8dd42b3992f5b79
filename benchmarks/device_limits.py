"""What the device can do, measured in the run that reports against it: the matmul peak of a dtype (the
denominator of MFU) and the memory copy bandwidth (the denominator of the weight-read bound), on CPU or CUDA.

Both time the best of several trials: a shared machine's noise and a GPU's clock ramp only ever make a trial
slower, so the best is the closest to the hardware's limit. On CUDA every timed span ends with
``torch.cuda.synchronize()``, so it covers the kernels and not only their launch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# n of the n x n x n products: the large square products where MKL / oneDNN (CPU) and cuBLAS (GPU) come closest
# to the hardware's limit. 8192 in bfloat16 is where an H200 reaches about 790 TFLOP/s.
DEFAULT_MATMUL_SIZES = {"cpu": (2048, 4096), "cuda": (8192,)}
# Bytes of the buffer copied: well past every cache (an H200's L2 is 60 MB), and small enough to allocate twice.
DEFAULT_COPY_BYTES = {"cpu": 256 * 2**20, "cuda": 4 * 2**30}
# Back-to-back repeats per timed trial: one on CPU (each call takes milliseconds and returns when done); on CUDA
# several, so the launch and the synchronization are a small part of the span.
_REPEATS = {"cpu": 1, "cuda": 10}


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); on CPU work is done when the call returns."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class MatmulPeak:
    """The fastest ``torch.mm`` of two ``size x size`` matrices of ``dtype`` on ``device``."""

    dtype: str
    device: str
    size: int  # n of the fastest n x n x n product
    best_s: float  # seconds of one product
    flops_per_s: float  # 2 n^3 / best_s

    @classmethod
    def from_timing(cls, dtype: str, device: str, size: int, best_s: float) -> MatmulPeak:
        """A product of two n x n matrices is n^2 dot products of length n: n^3 multiplies and n^3 adds."""
        return cls(dtype, device, size, best_s, 2 * size**3 / best_s)


def matmul_peak(
    dtype: str = "float32", device: str = "cpu", sizes: tuple[int, ...] | None = None, trials: int = 5
) -> MatmulPeak:
    """The device's matmul peak for ``dtype``: the best of ``trials`` timed products (after a warm-up product:
    thread pool, allocator, the library's kernel choice, GPU clocks) for each n in ``sizes`` (default
    ``DEFAULT_MATMUL_SIZES``), on torch's current thread count.

    Raises:
        ValueError: an unknown dtype or device type.
    """
    kind = torch.device(device).type
    if kind not in DEFAULT_MATMUL_SIZES:
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    repeats = _REPEATS[kind]
    best: MatmulPeak | None = None
    for size in sizes or DEFAULT_MATMUL_SIZES[kind]:
        a = torch.randn(size, size, device=device).to(getattr(torch, dtype))
        b = torch.randn(size, size, device=device).to(getattr(torch, dtype))
        for _ in range(3 if kind == "cuda" else 1):
            torch.mm(a, b)
        for _ in range(trials):
            synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                torch.mm(a, b)
            synchronize(device)
            trial = MatmulPeak.from_timing(dtype, device, size, (time.perf_counter() - start) / repeats)
            if best is None or trial.flops_per_s > best.flops_per_s:
                best = trial
        del a, b
    if best is None:
        raise ValueError("sizes must name at least one matrix size")
    return best


@dataclass(frozen=True)
class CopyBandwidth:
    """The fastest copy of a ``num_bytes`` buffer into another on ``device`` (``Tensor.copy_``).

    ``bytes_per_s`` counts the bytes read and the bytes written (2 x num_bytes per copy): the memory's whole
    traffic rate, which a decode step spends reading its weights alone. Counting only one side would halve it.
    """

    device: str
    num_bytes: int  # size of the buffer copied
    best_s: float  # seconds of one copy
    bytes_per_s: float  # (read + written) / best_s = 2 x num_bytes / best_s

    @classmethod
    def from_timing(cls, device: str, num_bytes: int, best_s: float) -> CopyBandwidth:
        return cls(device, num_bytes, best_s, 2 * num_bytes / best_s)


def copy_bandwidth(device: str = "cpu", num_bytes: int | None = None, trials: int = 5) -> CopyBandwidth:
    """The device's copy bandwidth: the best of ``trials`` timed device-to-device (or RAM-to-RAM) copies of a
    ``num_bytes`` buffer (default ``DEFAULT_COPY_BYTES``), after one untimed copy.

    Raises:
        ValueError: an unknown device type, or ``num_bytes`` not a positive multiple of 4.
    """
    kind = torch.device(device).type
    if kind not in DEFAULT_COPY_BYTES:
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    num_bytes = num_bytes or DEFAULT_COPY_BYTES[kind]
    if num_bytes <= 0 or num_bytes % 4:
        raise ValueError(f"num_bytes must be a positive multiple of 4, got {num_bytes}")
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    repeats = _REPEATS[kind]
    best_s = float("inf")
    for _ in range(trials):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        synchronize(device)
        best_s = min(best_s, (time.perf_counter() - start) / repeats)
    return CopyBandwidth.from_timing(device, num_bytes, best_s)
