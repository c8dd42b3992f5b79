"""Chained content hashes of full KV blocks, the keys of automatic prefix caching (vLLM
``kv_cache_utils.hash_block_tokens`` and the request block hasher).

``hash(block i) = sha256(pickle((hash(block i-1), token ids of block i, extra keys)))``, so a block hash
identifies the whole prefix up to and including that block. Extra keys make equal token ids under
different conditions hash apart: the LoRA adapter (name and content hash), multimodal items overlapping the block
(identifier and the item's start relative to the block), and the cache salt (block 0 only).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

from core_svc.request import Request

# Parent hash of block 0 (vLLM's NONE_HASH). Fixed, so hashes are stable across processes and restarts.
NONE_HASH = hashlib.sha256(b"splitserve-none-hash").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple[Any, ...] | None
) -> bytes:
    """sha256 digest (32 bytes) of one block, chained on its parent's digest (NONE_HASH for block 0)."""
    payload = (parent_hash if parent_hash is not None else NONE_HASH, token_ids, extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def block_extra_keys(request: Request, block_index: int, block_size: int) -> tuple[Any, ...] | None:
    """Extra keys of block ``block_index`` of ``request``: LoRA name and content hash, overlapping multimodal items
    and, for block 0, the cache salt. None when there are none."""
    keys: list[Any] = []
    if request.lora_name is not None:
        # The adapter's content hash (its weights and config), not only its name: a name removed and loaded again
        # with other weights must not hit the KV of the old ones.
        keys.append(("lora", request.lora_name, request.lora_hash))
    start, end = block_index * block_size, (block_index + 1) * block_size
    for feature in request.mm_features:
        if feature.offset < end and feature.offset + feature.length > start:
            keys.append(("mm", feature.identifier, feature.offset - start))
    if block_index == 0 and request.cache_salt:  # an empty salt is none (vLLM's generate_block_hash_extra_keys)
        keys.append(("cache_salt", request.cache_salt))
    return tuple(keys) if keys else None


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens; returns the list."""
    hashes = request.block_hashes
    num_full_blocks = request.num_tokens // block_size
    for i in range(len(hashes), num_full_blocks):
        tokens = tuple(request.all_token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(hash_block_tokens(hashes[i - 1] if i else None, tokens, block_extra_keys(request, i, block_size)))
    return hashes
