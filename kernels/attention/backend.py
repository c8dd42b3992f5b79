"""The paged-attention backend interface and the metadata every backend receives.

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 keys, 1 values).
Token t of a request lives in slot ``block_table[i, t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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

    @classmethod
    def for_decodes(cls, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> AttentionMetadata:
        """A decode-only step (benchmarks and tests): request i's one new token at position ``seq_lens[i] - 1``,
        its slot from ``block_table`` [num_reqs, max_blocks] int32; ``seq_lens`` [num_reqs] int32, at least 1."""
        num_reqs = seq_lens.shape[0]
        last = seq_lens.long() - 1
        slots = block_table[torch.arange(num_reqs), last // block_size].long() * block_size + last % block_size
        return cls(
            slot_mapping=slots,
            query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32),
            seq_lens=seq_lens,
            block_table=block_table,
            query_start_loc_cpu=list(range(num_reqs + 1)),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            num_decodes=num_reqs,
        )

    @classmethod
    def for_requests(
        cls, block_table: torch.Tensor, requests: list[tuple[int, int]], block_size: int, num_decodes: int | None = None
    ) -> AttentionMetadata:
        """A step of ``requests`` (benchmarks and tests), each (tokens already cached, tokens this step) in row
        order, their new tokens' slots from ``block_table`` [num_reqs, max_blocks] int32; ``num_decodes``: the
        leading requests to treat as decodes (None: every leading request with one new token)."""
        starts, slots = [0], []
        for i, (cached, new) in enumerate(requests):
            starts.append(starts[-1] + new)
            blocks = block_table[i].tolist()
            slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, cached + new)]
        if num_decodes is None:
            num_decodes = next((i for i, (_, new) in enumerate(requests) if new != 1), len(requests))
        lengths = [cached + new for cached, new in requests]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lengths, dtype=torch.int32),
            block_table=block_table,
            query_start_loc_cpu=starts,
            seq_lens_cpu=lengths,
            max_query_len=max((new for _, new in requests), default=0),
            max_seq_len=max(lengths, default=0),
            num_decodes=num_decodes,
        )


class AttentionBackend(Protocol):
    """Stores new keys/values in the paged cache and computes causal attention over each request's cache."""

    name: str
    # True when forward reads only device tensors of the metadata and launches work sized by tensor shapes alone,
    # so a CUDA graph captured once replays correctly with new metadata contents (the CUDA graph runner reads it).
    supports_cuda_graphs: bool
    # True when the KV cache may be narrower than float32 queries (--kv-cache-dtype bfloat16): keys and values are
    # rounded to the cache's dtype as they are stored and widened as they are read (core_svc.engine_core checks).
    supports_narrow_kv_cache: bool

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
        ``kv_cache`` (rounded to its dtype where it is narrower), then compute causal attention of ``query``
        ``[num_tokens, num_heads, head_size]`` over each request's cached keys and values (GQA when num_heads is a
        multiple of num_kv_heads). A query at position p sees keys at positions k with k <= p and, with a sliding
        window W, k > p - W (transformers' convention).

        Returns ``[num_tokens, num_heads, head_size]`` in the query's dtype.
        """
        ...
