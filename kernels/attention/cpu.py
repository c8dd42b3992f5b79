"""The CPU attention backend: decode rows through the compiled paged decode kernel
(``csrc/paged_attention_cpu.cpp``) and prefill chunks through the paged prefill kernel
(``csrc/prefill_attention_cpu.cpp``), both reading each request's keys and values in place from its blocks; the KV
write of a step with prefill chunks as in ``torch_ref``.

The reference backend's decode gathers every request's blocks into a padded copy, so its cost grows with the
longest sequence in the batch times the batch size; the kernel reads only what each request has. A decode-only step
(every row one request's one new token: the whole of single-request decoding) writes its keys and values and attends
in one kernel call per layer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.attention import cpu_ops
from kernels.attention.backend import AttentionMetadata
from kernels.attention.torch_ref import TorchRefAttentionBackend, write_kv


class CpuAttentionBackend(TorchRefAttentionBackend):
    name = "cpu"
    supports_cuda_graphs = False
    supports_narrow_kv_cache = True  # the compiled kernel converts as it writes and reads; the rest is torch_ref's

    def __init__(self, build_dir: Path) -> None:
        """Loads the kernel, compiling it first if ``build_dir`` has no binary for it (``cpu_ops.load``).

        Raises:
            cpu_ops.KernelBuildError: the kernel cannot be built or loaded.
        """
        cpu_ops.load(build_dir)

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
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.num_decodes != query.shape[0]:  # prefill chunks in the step
            write_kv(key, value, kv_cache, metadata.slot_mapping)
            if metadata.num_decodes:
                self._decode(query, kv_cache, metadata, scale, sliding_window, output)
            cpu_ops.paged_prefill_attention(output, query, kv_cache[0], kv_cache[1], metadata, scale, sliding_window)
            return output
        cpu_ops.decode_attention_with_kv_write(
            output,
            query,  # a view of the fused projection: the kernel reads its rows in place
            key,
            value,
            kv_cache[0],
            kv_cache[1],
            metadata.slot_mapping,
            metadata.block_table,
            metadata.seq_lens,
            scale,
            sliding_window,
        )
        return output

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        output: torch.Tensor,
    ) -> None:
        num_decodes = metadata.num_decodes
        cpu_ops.paged_decode_attention(
            output[:num_decodes],  # contiguous: forward allocates output so
            query[:num_decodes],
            kv_cache[0],
            kv_cache[1],
            metadata.block_table[:num_decodes],
            metadata.seq_lens[:num_decodes],
            scale,
            sliding_window,
        )
