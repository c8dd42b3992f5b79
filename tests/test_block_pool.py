"""FreeKVCacheBlockQueue and BlockPool: pointer invariants and eviction order."""

import pytest

from core_svc.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def check_links(queue: FreeKVCacheBlockQueue) -> None:
    """Walk forward and backward: both directions agree and the count matches."""
    forward = queue.get_all_free_blocks()
    backward = []
    block = queue._tail.prev_free_block
    while block is not queue._head:
        backward.append(block)
        block = block.prev_free_block
    assert ids(forward) == ids(reversed(backward))
    assert queue.num_free_blocks == len(forward)


def test_free_queue_operations_keep_links_consistent():
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    check_links(queue)

    assert queue.popleft().block_id == 0
    queue.remove(blocks[3])  # from the middle
    assert blocks[3].prev_free_block is None and blocks[3].next_free_block is None
    assert ids(queue.get_all_free_blocks()) == [1, 2, 4, 5]
    check_links(queue)

    queue.append(blocks[3])
    queue.prepend_n([blocks[0]])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 4, 5, 3]
    check_links(queue)

    assert ids(queue.popleft_n(4)) == [0, 1, 2, 4]
    queue.append_n([blocks[1], blocks[2]])
    assert ids(queue.get_all_free_blocks()) == [5, 3, 1, 2]
    check_links(queue)

    with pytest.raises(ValueError):
        queue.popleft_n(5)
    assert ids(queue.popleft_n(4)) == [5, 3, 1, 2]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])  # not queued


def test_pool_reserves_the_null_block_and_orders_freed_blocks():
    pool = BlockPool(num_blocks=6)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 5
    blocks = pool.get_new_blocks(4)
    assert ids(blocks) == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in blocks)
    pool.cache_full_blocks(blocks, [b"h1", b"h2"], 0, 2)  # blocks 1 and 2 are full and cached
    pool.free_blocks(reversed(blocks))
    # unhashed 4, 3 go to the head (reused first), hashed 2, 1 to the tail (evicted last)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 2, 1]
    assert pool.get_usage() == 0.0

    # Reusing a cached block's memory evicts its hash.
    taken = pool.get_new_blocks(5)
    assert ids(taken) == [4, 3, 5, 2, 1]
    assert pool.get_cached_block(b"h1") is None and pool.get_cached_block(b"h2") is None
    assert pool.get_usage() == 1.0


def test_touch_takes_cached_blocks_out_of_the_free_queue():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(b"a")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    assert hit not in pool.free_block_queue.get_all_free_blocks()
