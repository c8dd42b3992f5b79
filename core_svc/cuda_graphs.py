"""CUDA graphs for decode steps (vLLM v1's ``GPUModelRunner.capture_model`` and ``CUDAGraphWrapper``).

A decode-only step (every scheduled request has exactly one query token) of ``num_reqs`` requests is padded to
the next captured size and replays that size's graph. The graphs are captured on slices of the model runner's
persistent input buffers (``core_svc.input_buffers``) after the KV cache exists, largest size first, each after
a warm-up run, all in one memory pool (as vLLM does). Pad rows are fake requests that read and write only the
null KV block 0 (``InputBuffers.pad_decode_rows``).

Capturing goes through a ``GraphCapturer``: ``CudaGraphCapturer`` records real CUDA graphs; ``EagerCapturer``
"replays" by calling the same function again on the same static buffers, so the padding, the static buffers
and the replay logic run, and are tested, on CPU.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

Forward = Callable[[], torch.Tensor]  # one decode forward on the static buffers -> hidden [size, hidden_size]


def cuda_graph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, then every multiple of 8 (vLLM's default list), up to
    ``min(max_num_seqs, max_num_batched_tokens)``, and that limit itself when it is not on the list, so that
    every decode batch the scheduler can form has a graph to pad to."""
    limit = min(max_num_seqs, max_num_batched_tokens)
    sizes = [size for size in (1, 2, 4, *range(8, limit + 1, 8)) if size <= limit]
    if sizes[-1] != limit:
        sizes.append(limit)
    return sizes


class GraphCapturer(Protocol):
    """Turns a forward on static buffers into a replayable one."""

    def capture(self, forward: Forward) -> Forward:
        """Record ``forward``; the returned callable re-runs it on whatever the static buffers hold then and
        returns its output tensor (the same tensor every replay)."""
        ...

    def used_memory_bytes(self) -> int:
        """Device memory in use now (bytes), to report what capturing took; 0 where not measured."""
        ...


class CudaGraphCapturer:
    """Records ``torch.cuda.CUDAGraph`` s sharing one memory pool (``torch.cuda.graph_pool_handle``), as vLLM's
    ``CUDAGraphWrapper``: graphs captured largest first reuse the largest one's activation memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> Forward:
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        torch.cuda.synchronize(self.device)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def used_memory_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device)
        return total_bytes - free_bytes


class EagerCapturer:
    """Stands in for CUDA graphs where there are none (CPU tests): replaying calls the captured forward again,
    on the same static buffers, so everything but the graph itself runs as on CUDA."""

    def capture(self, forward: Forward) -> Forward:
        return forward

    def used_memory_bytes(self) -> int:
        return 0


class DecodeGraphs:
    """The captured decode graphs by batch size.

    Args:
        sizes: batch sizes to capture (``cuda_graph_capture_sizes``).
    """

    def __init__(self, sizes: list[int]) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive, got {sizes}")
        self.sizes = sorted(set(sizes))
        self._replays: dict[int, Forward] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest captured size >= ``num_reqs``; None when ``num_reqs`` exceeds the largest (eager)."""
        index = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def capture(self, make_forward: Callable[[int], Forward], capturer: GraphCapturer) -> None:
        """Capture every size, largest first: ``make_forward(size)`` prepares the static buffers (pad rows only)
        and returns the forward on them; it runs once as a warm-up (lazy initialization such as cuBLAS handles
        must not happen while capturing), then is captured. Logs the time and memory it took, as vLLM."""
        start_s = time.perf_counter()
        start_bytes = capturer.used_memory_bytes()
        for size in reversed(self.sizes):
            forward = make_forward(size)
            forward()
            self._replays[size] = capturer.capture(forward)
        took_bytes = capturer.used_memory_bytes() - start_bytes
        logger.info(
            "Graph capturing finished in %.1f secs, took %.2f GiB (decode batch sizes %s)",
            time.perf_counter() - start_s,
            took_bytes / 2**30,
            ", ".join(map(str, self.sizes)),
        )

    def replay(self, size: int) -> torch.Tensor:
        """Run ``size``'s graph on what the static buffers hold; returns hidden ``[size, hidden_size]``, valid
        until the next replay.

        Raises:
            KeyError: ``size`` was not captured.
        """
        return self._replays[size]()
