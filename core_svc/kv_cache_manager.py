"""Which KV blocks each request holds, and prefix-cache lookups (vLLM ``KVCacheManager``).

No torch, no grpc: block ids only. Running out of blocks is a normal ``None`` return, never an exception.
"""

from __future__ import annotations

from core_svc.block_hash import update_block_hashes
from core_svc.block_pool import BlockPool, KVCacheBlock
from core_svc.outputs import PrefixCacheStats
from core_svc.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    """Allocates paged KV blocks to requests and finds prefix-cache hits.

    Args:
        num_blocks: blocks in the KV cache, the null block included (usable = num_blocks - 1).
        block_size: tokens per block.
        max_model_len: longest sequence, in tokens; no request is given slots beyond it.
        enable_caching: automatic prefix caching on or off.
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # request_id -> its blocks, in token order
        self.num_cached_blocks: dict[str, int] = {}  # request_id -> leading blocks already in the hash map
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of leading full blocks already cached for ``request``.

        The hit is capped at ``num_tokens - 1`` tokens so the last token is always recomputed (its logits are
        needed). Returns (blocks, num_computed_tokens); ([], 0) when caching is off or the request must not
        read the cache (prompt logprobs).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        block_hashes = update_block_hashes(request, self.block_size)
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens after its computed ones.

        ``new_computed_blocks`` are prefix-cache hits from ``get_computed_blocks`` (first scheduling only);
        they are taken into the request's block table. Full blocks up to ``request.num_tokens`` are added to the
        prefix cache.

        Returns:
            The newly allocated blocks (possibly empty), or None when too few blocks are free; in that case
            nothing changes, the ref counts of ``new_computed_blocks`` included.
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens, self.max_model_len)
        num_new_blocks = max(
            0, cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks) - len(new_computed_blocks)
        )
        # Cache hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if not req_blocks and self.enable_caching and not request.skip_reading_prefix_cache:
            # First allocation = admission: count the lookup once, however long the request waited; a
            # re-admission after a preemption apart (vLLM), so that refinding its own blocks is no hit.
            self.prefix_cache_stats.record(
                request.num_tokens, len(new_computed_blocks) * self.block_size, preempted=request.num_preemptions > 0
            )
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, min(num_tokens_need_slot, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Return the request's blocks, last block first so that a prefix's tail is evicted before its head.

        Blocks are cached when allocated, for tokens the coming forward computes. A request preempted in the
        step that scheduled it never gets that forward, so its blocks past ``num_computed_tokens`` leave the
        cache before they are freed: nobody may hit KV that was never written.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
            self.block_pool.evict_cached_block(block)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash. Returns False (and changes nothing) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call; resets them."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_full_blocks = num_tokens // self.block_size
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_cached:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full_blocks)
        self.num_cached_blocks[request.request_id] = num_full_blocks
