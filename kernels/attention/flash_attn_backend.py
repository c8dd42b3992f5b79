"""The flash_attn backend: FlashAttention-2 (Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning", 2023) from the optional ``flash-attn`` package (2.6 or newer; the ``cuda`` extra), reading
keys and values in place through the block table.

A step's keys and values are written as ``torch_ref`` writes them (one ``index_copy_`` per cache, which CUDA graphs
capture). A batch with any prefill chunk is one ``flash_attn_varlen_func`` call with ``block_table`` (decode rows
are runs of one query token in it); a decode-only batch is one ``flash_attn_with_kvcache`` call, whose inputs are
all device tensors: nothing is read from the host, so it can be captured in a CUDA graph.

What flash-attn accepts (its ``csrc/flash_attn/flash_api.cpp``, 2.6 to 2.8; ``FLASH_ATTN_*`` below):
float16 and bfloat16 only; a paged cache's block size (``page_block_size``) a multiple of 256; head sizes up to
256 (a head size that is not a multiple of 8 is padded by a copy of the whole cache at every call, so it is
refused here too); GPUs of compute capability 8.0 (Ampere) or newer. vLLM serves block size 16 through its own
fork of flash-attn (vllm-flash-attn); upstream flash-attn needs ``--block-size 256``.

Masks, in flash-attn's terms: ``causal=True`` aligns the mask to the bottom right, so query i of a request with
``seqlen_q`` new tokens and ``seqlen_k`` tokens in the cache sits at position ``i + seqlen_k - seqlen_q``, and
``window_size=(left, right)`` lets it see keys from ``position - left`` to ``position + right`` inclusive. The
transformers sliding window W (a query at p sees keys k with p - W < k <= p) is therefore ``(W - 1, 0)``; no window
is ``(-1, -1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import write_kv

FLASH_ATTN_MIN_VERSION = (2, 6)  # flash_attn_varlen_func's block_table (paged KV) came with 2.6.0
FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
FLASH_ATTN_BLOCK_SIZE_MULTIPLE = 256  # "Paged KV cache block size must be divisible by 256"
FLASH_ATTN_MAX_HEAD_SIZE = 256
FLASH_ATTN_HEAD_SIZE_MULTIPLE = 8
FLASH_ATTN_MIN_CAPABILITY = (8, 0)  # "FlashAttention only supports Ampere GPUs or newer"
INSTALL_FLASH_ATTN = (
    "pip install 'flash-attn>=2.6' --no-build-isolation into the core's environment (or the project's cuda extra: "
    "pip install '.[core,cuda]' --no-build-isolation); it compiles against the installed torch's CUDA build"
)


def flash_attn_misfits(
    dtype: torch.dtype, block_size: int, head_size: int, capability: tuple[int, int] | None
) -> list[str]:
    """Why flash-attn cannot serve this model and cache, one reason per constraint it breaks, each with the numbers
    and the fix (empty: it fits). ``capability``: the GPU's compute capability (major, minor); None skips that
    check."""
    reasons = []
    if dtype not in FLASH_ATTN_DTYPES:
        reasons.append(
            f"dtype {str(dtype).removeprefix('torch.')} is not supported (float16 or bfloat16 only: pass --dtype "
            "bfloat16 or float16)"
        )
    if block_size % FLASH_ATTN_BLOCK_SIZE_MULTIPLE:
        reasons.append(
            f"block_size {block_size} is not a multiple of {FLASH_ATTN_BLOCK_SIZE_MULTIPLE}, which flash-attn's paged "
            f"KV cache needs (pass --block-size {FLASH_ATTN_BLOCK_SIZE_MULTIPLE})"
        )
    if head_size > FLASH_ATTN_MAX_HEAD_SIZE or head_size % FLASH_ATTN_HEAD_SIZE_MULTIPLE:
        reasons.append(
            f"head_size {head_size} is not supported (a multiple of {FLASH_ATTN_HEAD_SIZE_MULTIPLE} up to "
            f"{FLASH_ATTN_MAX_HEAD_SIZE})"
        )
    if capability is not None and capability < FLASH_ATTN_MIN_CAPABILITY:
        major, minor = capability
        reasons.append(
            f"the GPU's compute capability {major}.{minor} is below {FLASH_ATTN_MIN_CAPABILITY[0]}."
            f"{FLASH_ATTN_MIN_CAPABILITY[1]} (flash-attn 2 needs Ampere or newer)"
        )
    return reasons


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"2.7.4.post1"``; (0, 0) when it does not start so."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return 0, 0


class FlashAttnBackend:
    """Paged attention through flash-attn (see the module docstring for the calls and what they accept).

    Raises:
        ImportError: from the constructor, when ``flash_attn`` does not import.
    """

    name = "flash_attn"
    supports_cuda_graphs = True  # the decode-only call reads nothing from the host
    supports_narrow_kv_cache = False

    def __init__(self) -> None:
        import flash_attn

        self._varlen: Callable[..., Any] = flash_attn.flash_attn_varlen_func
        self._with_kvcache: Callable[..., Any] = flash_attn.flash_attn_with_kvcache

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
        # query: [num_tokens, num_heads, head_size] -> same shape; kv_cache[i]: [num_blocks, block_size,
        # num_kv_heads, head_size], flash-attn's paged layout as it is.
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        window_size = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if metadata.num_decodes == metadata.num_reqs:
            num_reqs = query.shape[0]  # one query token per request
            out = self._with_kvcache(
                query.unsqueeze(1),  # [num_reqs, 1, num_heads, head_size]
                k_cache,
                v_cache,
                cache_seqlens=metadata.seq_lens[:num_reqs],
                block_table=metadata.block_table[:num_reqs],
                softmax_scale=scale,
                causal=True,
                window_size=window_size,
            )
            return out.squeeze(1)
        # Keys come from the block table; cu_seqlens_k only gives each request's number of them.
        cu_seqlens_k = F.pad(torch.cumsum(metadata.seq_lens, 0, dtype=torch.int32), (1, 0))  # [num_reqs + 1]
        out = self._varlen(
            query,
            k_cache,
            v_cache,
            cu_seqlens_q=metadata.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=metadata.max_query_len,
            max_seqlen_k=metadata.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window_size,
            block_table=metadata.block_table,
        )
        return out  # [num_tokens, num_heads, head_size]
