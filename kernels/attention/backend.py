"""The paged-attention backend interface and the metadata every backend receives.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 keys, 1 values).
Token t of a request lives in slot ``block_table[i, t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "cpu", "torch_ref")
# What falling back from the kernel to the reference costs, measured by ``python -m benchmarks.decode_attention
# --model <small checkpoint>`` on 2 cores (docs/benchmarks.md#decode-attention-kernel-and-reference).
FALLBACK_COST = (
    "decode attention 5-15 times slower, and 1.8 times fewer output tokens/s for the small test model with 64 "
    "requests of 64-400 prompt tokens (more with longer contexts)"
)


@dataclass
class AttentionMetadata:
    """One step's flattened batch: requests are contiguous runs of query tokens, the ``num_decodes`` requests with
    one query token first (vLLM v1 reorders its batch the same way), so decode rows are ``query[:num_decodes]``.

    The ``*_cpu`` lists mirror tensors for backends that loop over requests in Python.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, KV slot of each query token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, query token offsets of each request
    seq_lens: torch.Tensor  # [num_reqs] int32, tokens in the KV cache after this step, per request
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32, padded with the null block 0
    query_start_loc_cpu: list[int]  # [num_reqs + 1]
    seq_lens_cpu: list[int]  # [num_reqs]
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0  # leading requests with exactly one query token

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(Protocol):
    """Stores new keys/values in the paged cache and computes causal attention over each request's cache."""

    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` at ``metadata.slot_mapping`` in
        ``kv_cache``, then compute causal attention of ``query`` ``[num_tokens, num_heads, head_size]`` over each
        request's cached keys and values (GQA when num_heads is a multiple of num_kv_heads). A query at position p
        sees keys at positions k with k <= p and, with a sliding window W, k > p - W (transformers' convention).

        Returns ``[num_tokens, num_heads, head_size]`` in the query's dtype.
        """
        ...


def get_attention_backend(
    name: str = "auto", device: torch.device | str = "cpu", build_dir: Path | None = None
) -> AttentionBackend:
    """Backend by name: ``cpu`` (compiled decode kernel, built on first use into ``build_dir``, see
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
        from kernels.attention.cpu import CpuAttentionBackend

        return CpuAttentionBackend(build_dir)
    from kernels.attention.torch_ref import TorchRefAttentionBackend

    return TorchRefAttentionBackend()


def _kernel_loads(build_dir: Path | None) -> bool:
    """Load the CPU kernel; on failure log why, what the reference backend costs, and the fix."""
    from kernels.attention import cpu_ops

    try:
        cpu_ops.load(build_dir)
        return True
    except cpu_ops.KernelBuildError as e:
        reason, details = e.reason, e.details
    except Exception as e:  # anything else the load raised: the reference still serves correctly
        reason, details = f"{type(e).__name__}: {e}", ""
    logger.warning(
        "the CPU attention kernel is unavailable (%s), so attention runs on the slower reference backend "
        "'torch_ref'. Cost: %s. Fix: install a C++ compiler (g++, or set CXX to one) and restart, which builds the "
        "kernel once (about 20 s); or pass --attention-backend torch_ref to choose the reference.",
        reason,
        FALLBACK_COST,
    )
    if details:
        logger.warning("the CPU attention kernel's build: %s", details)
    return False
