"""Reference paged attention in plain torch: runs on any device, and is the oracle the other backends are tested
against.

Decode requests (one query token) are batched into one ``scaled_dot_product_attention`` call over their gathered,
padded block tables. Each prefill chunk gets its own call: over the keys and values it brings when nothing of its
request is cached yet, else over its request's gathered blocks with a causal mask offset by the cached tokens.
A cache narrower than the queries (``--kv-cache-dtype bfloat16`` under a float32 model) is widened as it is read,
and a first chunk's own keys and values are rounded as the cache rounds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention.backend import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` at ``slot_mapping`` (int64 slots), rounded
    to the cache's dtype where it is narrower (``--kv-cache-dtype``)."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def as_cached(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """Keys or values as the cache holds them, in ``x``'s dtype: rounded through a narrower cache dtype, so a
    prefill over the step's own keys sees what a later step reads back."""
    return x if x.dtype == kv_cache.dtype else x.to(kv_cache.dtype).to(x.dtype)


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    output: torch.Tensor,
) -> None:
    """Attention of every request from ``metadata.num_decodes`` on (the prefill chunks) into ``output``, one
    ``scaled_dot_product_attention`` call per request. The KV of this step must already be written."""
    block_size = kv_cache.shape[2]
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for i in range(metadata.num_decodes, metadata.num_reqs):
        start, end = starts[i], starts[i + 1]
        seq_len = seq_lens[i]
        num_context = seq_len - (end - start)
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_size]
        if num_context == 0:
            keys = as_cached(key[start:end], kv_cache).transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, seq_len, D]
            values = as_cached(value[start:end], kv_cache).transpose(0, 1).unsqueeze(0)
        else:
            num_blocks = -(seq_len // -block_size)
            block_table = metadata.block_table[i : i + 1, :num_blocks].long()
            keys = _gather(kv_cache[0], block_table)[:, :, :seq_len].to(query.dtype)
            values = _gather(kv_cache[1], block_table)[:, :, :seq_len].to(query.dtype)
        if num_context == 0 and (sliding_window is None or sliding_window >= seq_len):
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            query_pos = torch.arange(num_context, seq_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
            if sliding_window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        output[start:end] = out[0].transpose(0, 1)


class TorchRefAttentionBackend:
    name = "torch_ref"
    supports_cuda_graphs = False  # loops over requests with the *_cpu lists
    supports_narrow_kv_cache = True  # write_kv rounds, every read widens (as_cached for a first chunk's own)

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
        if metadata.num_decodes:
            self._decode(query, kv_cache, metadata, scale, sliding_window, output)
        prefill_attention(query, key, value, kv_cache, metadata, scale, sliding_window, output)
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
        block_size = kv_cache.shape[2]
        seq_lens = metadata.seq_lens[:num_decodes].long()  # [D]
        num_blocks = -(max(metadata.seq_lens_cpu[:num_decodes]) // -block_size)
        block_table = metadata.block_table[:num_decodes, :num_blocks].long()  # [D, nb]
        keys = _gather(kv_cache[0], block_table).to(query.dtype)  # [D, num_kv_heads, nb * block_size, head_size]
        values = _gather(kv_cache[1], block_table).to(query.dtype)
        key_pos = torch.arange(keys.shape[2], device=query.device)
        mask = key_pos[None, :] < seq_lens[:, None]  # [D, L]
        if sliding_window is not None:
            mask &= key_pos[None, :] > (seq_lens[:, None] - 1 - sliding_window)
        q = query[:num_decodes].unsqueeze(2)  # [D, num_heads, 1, head_size]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        output[:num_decodes] = out.squeeze(2)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, H, D] cache, [B, nb] table -> [B, H, nb * block_size, D]."""
    blocks = cache[block_table]  # [B, nb, block_size, H, D]
    batch, nb, block_size, heads, dim = blocks.shape
    return blocks.view(batch, nb * block_size, heads, dim).transpose(1, 2)
