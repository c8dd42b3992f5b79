"""KV cache blocks, the free-block queue and the block pool (vLLM ``block_pool.py`` / ``kv_cache_utils.py``).

No torch here: a block is an id into the model runner's KV cache tensors; this module only tracks who uses
which block and which blocks hold reusable (hashed) content.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached
    prev_free_block: KVCacheBlock | None = None  # links of the free-block queue
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append, prepend and remove from the middle
    (as vLLM's ``FreeKVCacheBlockQueue``). The head is evicted first. Uses the blocks' own link fields and two
    sentinel blocks, so there is no per-node allocation.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block. Raises ValueError when empty."""
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks. Raises ValueError when fewer are free."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} are free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue. Raises RuntimeError if it is not queued."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        self._insert_before(self._tail, block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self._insert_before(self._tail, block)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head in the given order (the first of them is handed out first)."""
        anchor = self._head.next_free_block
        if anchor is None:
            raise RuntimeError("free queue is corrupt")
        for block in blocks:
            self._insert_before(anchor, block)

    def _insert_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        prev_block = anchor.prev_free_block
        if prev_block is None:
            raise RuntimeError("free queue is corrupt")
        prev_block.next_free_block = block
        block.prev_free_block = prev_block
        block.next_free_block = anchor
        anchor.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail (for tests and debugging)."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks


class BlockPool:
    """All KV cache blocks: the free queue, the prefix-cache map from block hash to block, and ref counts.

    Block 0 is the null block: never handed out, used to pad block tables. So ``num_blocks - 1`` blocks are
    usable. Freed blocks without a hash are reused first; freed hashed blocks go to the tail so the least
    recently used cached content is evicted first (vLLM's eviction order).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one null block + one usable), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # block hash -> {block_id: block}; several blocks may hold the same content when two requests computed
        # it at the same time (block tables stay append-only, so duplicates are kept, not merged).
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached content, ref_cnt 1 each.

        Raises:
            ValueError: fewer blocks are free (callers check first; running out is not an error for them).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self.evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes], start: int, end: int) -> None:
        """Record ``blocks[start:end]`` (now full) in the prefix cache under ``block_hashes[start:end]``."""
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end], strict=True):
            if block.block_hash is not None or block.is_null:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction order; blocks reaching 0 become free. Unhashed ones
        go to the head (reused first), hashed ones to the tail (kept for prefix hits as long as possible)."""
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (hashed if block.block_hash is not None else unhashed).append(block)
        self.free_block_queue.prepend_n(unhashed)
        self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash. Fails (returns False) while any usable block is in use."""
        if self.get_num_free_blocks() != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        return True

    def evict_cached_block(self, block: KVCacheBlock) -> None:
        """Remove ``block`` from the prefix cache (no-op when it is not cached)."""
        if block.block_hash is None:
            return
        blocks = self.cached_block_hash_to_block.get(block.block_hash)
        if blocks is not None:
            blocks.pop(block.block_id, None)
            if not blocks:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
