"""The model runner's persistent input buffers: host staging arrays and the device tensors they are copied to
(vLLM v1 ``GPUModelRunner``'s ``CpuGpuBuffer`` s).

Every step fills the host side (numpy views of torch tensors, pinned on CUDA so the copies can be
non-blocking) and copies the used prefix to the device. On CPU the device tensor *is* the host tensor: no copy.
The device tensors never move, so a CUDA graph captured on slices of them sees each step's inputs; the decode
graphs' pad rows are written here too (``pad_decode_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class HostDeviceBuffer:
    """One host staging tensor and its device twin, of the same shape and dtype.

    Args:
        shape: the buffer's full shape; steps use a prefix of dim 0.
        dtype: torch dtype of both sides.
        device: where the device side lives; on CPU both sides are one tensor.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        self.np: np.ndarray = self.host.numpy()  # shares memory with ``host``
        self.device = self.host if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)

    def copy_to_device(self, num_rows: int) -> torch.Tensor:
        """Copy rows ``[:num_rows]`` host -> device without blocking the host; returns the device rows. The
        host rows must not change until the copy is done: each step ends with a host sync, so the next step may
        refill them."""
        if self.device is not self.host:
            self.device[:num_rows].copy_(self.host[:num_rows], non_blocking=True)
        return self.device[:num_rows]

    def copy_columns_to_device(self, num_columns: int) -> torch.Tensor:
        """``copy_to_device`` of columns ``[:, :num_columns]`` of a 2-D buffer (M-RoPE's ``[3, tokens]``), one
        row at a time: each row's prefix is contiguous, so each copy reads the pinned rows in place."""
        if self.device is not self.host:
            for row in range(self.host.shape[0]):
                self.device[row, :num_columns].copy_(self.host[row, :num_columns], non_blocking=True)
        return self.device[:, :num_columns]


@dataclass(frozen=True)
class BufferLimits:
    """Sizes of the persistent buffers: the most any step holds."""

    max_num_batched_tokens: int  # rows of input_ids, positions, slot_mapping
    max_num_seqs: int  # rows of seq_lens, block_table, sample_rows (query_start_loc has one more)
    max_num_blocks_per_req: int  # cdiv(max_model_len, block_size): block_table's columns
    uses_mrope: bool = False  # the model takes M-RoPE positions [3, num_tokens] (Qwen2-VL)


class InputBuffers:
    """The step's flattened batch in persistent buffers: ``input_ids``, ``positions``, ``slot_mapping``
    ``[max_num_batched_tokens]`` int64; ``query_start_loc`` ``[max_num_seqs + 1]`` int32; ``seq_lens``
    ``[max_num_seqs]`` int32; ``block_table`` ``[max_num_seqs, max_num_blocks_per_req]`` int32 (0, the null
    block, past each request's blocks); ``sample_rows`` ``[max_num_seqs]`` int64; for an M-RoPE model,
    ``mrope_positions`` ``[3, max_num_batched_tokens]`` int64 (what the model takes in place of ``positions``)."""

    def __init__(self, limits: BufferLimits, device: torch.device) -> None:
        self.limits = limits
        tokens, seqs = limits.max_num_batched_tokens, limits.max_num_seqs
        self.input_ids = HostDeviceBuffer((tokens,), torch.int64, device)
        self.positions = HostDeviceBuffer((tokens,), torch.int64, device)
        self.slot_mapping = HostDeviceBuffer((tokens,), torch.int64, device)
        self.query_start_loc = HostDeviceBuffer((seqs + 1,), torch.int32, device)
        self.seq_lens = HostDeviceBuffer((seqs,), torch.int32, device)
        self.block_table = HostDeviceBuffer((seqs, limits.max_num_blocks_per_req), torch.int32, device)
        self.sample_rows = HostDeviceBuffer((seqs,), torch.int64, device)
        self.mrope_positions = HostDeviceBuffer((3, tokens), torch.int64, device) if limits.uses_mrope else None
        # Host block_table rows [:rows] x columns [:columns] may hold stale ids from an earlier step.
        self._dirty_rows = 0
        self._dirty_columns = 0

    def clear_block_table(self, num_rows: int, num_columns: int) -> None:
        """Zero what earlier steps wrote in the host block table, then mark ``[:num_rows, :num_columns]`` as
        about to be written: only the used corner is ever cleared (the table may be wide)."""
        self.block_table.np[: self._dirty_rows, : self._dirty_columns] = 0
        self._dirty_rows, self._dirty_columns = num_rows, num_columns

    def pad_decode_rows(self, num_reqs: int, padded_size: int) -> None:
        """Make rows ``[num_reqs:padded_size]`` fake one-token requests that touch only the null block 0: input
        id 0 at position 0, slot 0, seq_len 1, an all-zero block table row, one query token each. Decode rows
        only: request i's query token is row i."""
        if padded_size <= num_reqs:
            return
        rows = slice(num_reqs, padded_size)
        self.input_ids.np[rows] = 0
        self.positions.np[rows] = 0
        if self.mrope_positions is not None:
            self.mrope_positions.np[:, rows] = 0
        self.slot_mapping.np[rows] = 0
        self.seq_lens.np[rows] = 1
        self.block_table.np[rows] = 0
        self.query_start_loc.np[num_reqs + 1 : padded_size + 1] = np.arange(
            num_reqs + 1, padded_size + 1, dtype=np.int32
        )
