"""The CPU attention backend: decode rows through the compiled paged kernel (``csrc/paged_attention_cpu.cpp``),
which reads each request's keys and values in place from its blocks; prefill chunks as in ``torch_ref``.

The reference backend's decode gathers every request's blocks into a padded copy, so its cost grows with the
longest sequence in the batch times the batch size; the kernel reads only what each request has.
"""

from __future__ import annotations

import torch

from kernels.attention import cpu_ops
from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import prefill_attention, write_kv


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        cpu_ops.load()

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
        # query: [num_tokens, num_heads, head_size] -> same shape
        write_kv(key, value, kv_cache, metadata.slot_mapping)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # contiguous, whatever query is
        num_decodes = metadata.num_decodes
        if num_decodes:
            cpu_ops.paged_decode_attention(
                output[:num_decodes],
                query[:num_decodes].contiguous(),
                kv_cache[0],
                kv_cache[1],
                metadata.block_table[:num_decodes],
                metadata.seq_lens[:num_decodes],
                scale,
                sliding_window,
            )
        prefill_attention(query, key, value, kv_cache, metadata, scale, sliding_window, output)
        return output
