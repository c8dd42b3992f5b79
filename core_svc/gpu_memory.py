"""Sizing the KV cache from the GPU's memory (vLLM v1's ``Worker.determine_available_memory`` with
``vllm.utils.mem_utils.memory_profiling``).

The arithmetic (``MemoryProfile``) is a pure function of measured numbers; ``measure_profile_run`` measures them
on CUDA around the model runner's profile run:

    requested    = total_memory * gpu_memory_utilization
    non_kv_cache = weights + peak activation increase of the profile run + non-torch memory increase
    KV budget    = requested - non_kv_cache

where ``weights`` is what torch allocated between the baseline (before loading) and the profile run, the peak
increase is torch's peak allocation during the profile run over what was allocated when it began, and the
non-torch increase is the growth, since the baseline, of device memory in use outside torch's allocator (CUDA
libraries' workspaces, NCCL, ...). Memory other processes hold is in the baseline and so outside the budget;
CUDA graphs are captured afterwards, from the share ``gpu_memory_utilization`` leaves free (as in vLLM).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory at one moment, in bytes (vLLM's ``MemorySnapshot``)."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free on the device (all processes)
    torch_allocated_bytes: int  # held by live tensors of this process
    torch_reserved_bytes: int  # held by torch's caching allocator (allocated + cached)
    torch_peak_bytes: int  # torch's peak allocation since the last reset of the peak stats

    @property
    def used_bytes(self) -> int:
        return self.total_bytes - self.free_bytes

    @property
    def non_torch_bytes(self) -> int:
        """In use outside torch's allocator: CUDA contexts, library workspaces, other processes."""
        return self.used_bytes - self.torch_reserved_bytes

    @classmethod
    def measure(cls, device: torch.device) -> MemorySnapshot:
        """Snapshot ``device`` (CUDA) now; initializes CUDA on first use."""
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        return cls(
            total_bytes=total_bytes,
            free_bytes=free_bytes,
            torch_allocated_bytes=stats.get("allocated_bytes.all.current", 0),
            torch_reserved_bytes=stats.get("reserved_bytes.all.current", 0),
            torch_peak_bytes=stats.get("allocated_bytes.all.peak", 0),
        )


@dataclass(frozen=True)
class MemoryProfile:
    """The measured numbers of a profile run, in bytes, and the KV cache budget they leave."""

    total_bytes: int
    gpu_memory_utilization: float  # (0, 1]
    weights_bytes: int  # torch allocation from the baseline to the start of the profile run
    peak_activation_bytes: int  # torch's peak during the profile run over its allocation at the start
    non_torch_increase_bytes: int  # non-torch memory growth since the baseline

    @property
    def requested_bytes(self) -> int:
        return int(self.total_bytes * self.gpu_memory_utilization)

    @property
    def non_kv_cache_bytes(self) -> int:
        return self.weights_bytes + self.peak_activation_bytes + self.non_torch_increase_bytes

    @property
    def available_kv_cache_bytes(self) -> int:
        """The KV cache budget; negative when the model and a step alone exceed the requested share."""
        return self.requested_bytes - self.non_kv_cache_bytes

    @classmethod
    def from_snapshots(
        cls, baseline: MemorySnapshot, before: MemorySnapshot, after: MemorySnapshot, gpu_memory_utilization: float
    ) -> MemoryProfile:
        """``baseline``: before loading the weights; ``before``: at the start of the profile run, after
        resetting the peak stats; ``after``: at its end."""
        return cls(
            total_bytes=baseline.total_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            weights_bytes=before.torch_allocated_bytes - baseline.torch_allocated_bytes,
            peak_activation_bytes=after.torch_peak_bytes - before.torch_allocated_bytes,
            non_torch_increase_bytes=after.non_torch_bytes - baseline.non_torch_bytes,
        )

    def describe(self) -> str:
        """The breakdown in GiB, as vLLM's debug line."""
        return (
            f"total {self.total_bytes / GIB:.2f} GiB x gpu_memory_utilization {self.gpu_memory_utilization} = "
            f"{self.requested_bytes / GIB:.2f} GiB requested; weights {self.weights_bytes / GIB:.2f} GiB, peak "
            f"activations {self.peak_activation_bytes / GIB:.2f} GiB, non-torch memory "
            f"{self.non_torch_increase_bytes / GIB:.2f} GiB; KV cache {self.available_kv_cache_bytes / GIB:.2f} GiB"
        )


def check_free_memory(baseline: MemorySnapshot, gpu_memory_utilization: float) -> None:
    """Refuse to start when the device has less free memory than the share asked for, as vLLM's worker.

    Raises:
        ValueError: with the numbers and the fixes.
    """
    requested_bytes = int(baseline.total_bytes * gpu_memory_utilization)
    if baseline.free_bytes < requested_bytes:
        raise ValueError(
            f"free memory on the device ({baseline.free_bytes / GIB:.2f}/{baseline.total_bytes / GIB:.2f} GiB) at "
            f"startup is less than the requested share (gpu_memory_utilization {gpu_memory_utilization}, "
            f"{requested_bytes / GIB:.2f} GiB): lower --gpu-memory-utilization, or free memory other processes hold"
        )


def measure_profile_run(
    device: torch.device, profile_run: Callable[[], None], baseline: MemorySnapshot, gpu_memory_utilization: float
) -> MemoryProfile:
    """Run ``profile_run`` (the largest step) with torch's peak stats reset and return what it measured."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = MemorySnapshot.measure(device)
    profile_run()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()  # what the run cached is free again for the KV cache; the peak stat keeps its mark
    after = MemorySnapshot.measure(device)
    return MemoryProfile.from_snapshots(baseline, before, after, gpu_memory_utilization)


def num_kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    """Blocks (the null block among them) that fit ``budget_bytes``; 0 for a budget of no block."""
    return max(0, budget_bytes // bytes_per_block)
