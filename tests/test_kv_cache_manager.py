"""KVCacheManager: prefix caching, allocation failure, reset, extra keys (vLLM test_prefix_caching cases)."""

import hashlib
import pickle

from core_svc.block_hash import NONE_HASH
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.request import MultiModalFeature
from tests.factories import make_request

BLOCK_SIZE = 16


def make_manager(num_blocks: int = 11, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len=4096, enable_caching=enable_caching)


def ids(blocks):
    return [b.block_id for b in blocks]


def admit(manager: KVCacheManager, request):
    """What the scheduler does for a new request: look up the cache, allocate the rest."""
    computed, num_computed = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_computed, computed)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
    return computed, num_computed, new


def expected_chain(tokens: list[int], extra_keys_per_block=None) -> list[bytes]:
    """Block hashes recomputed here from the definition: sha256(pickle((parent, block tokens, extra keys)))."""
    hashes, parent = [], NONE_HASH
    for i in range(len(tokens) // BLOCK_SIZE):
        extra = extra_keys_per_block[i] if extra_keys_per_block else None
        payload = (parent, tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), extra)
        parent = hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()
        hashes.append(parent)
    return hashes


def test_prefix_hit_ref_counts_and_free_order():
    manager = make_manager()
    tokens = list(range(55))
    first = make_request("0", prompt_token_ids=tokens)
    computed, num_computed, new = admit(manager, first)
    assert (computed, num_computed) == ([], 0)
    assert ids(new) == [1, 2, 3, 4]
    # Three full blocks cached under the chained hashes; the partial fourth is not.
    assert first.block_hashes == expected_chain(tokens)
    assert [b.block_hash for b in new] == expected_chain(tokens) + [None]

    second = make_request("1", prompt_token_ids=tokens[:48] + [900, 901, 902, 903, 904])
    computed, num_computed, new = admit(manager, second)
    assert ids(computed) == [1, 2, 3] and num_computed == 48
    assert [b.ref_cnt for b in computed] == [2, 2, 2]
    assert ids(new) == [5]
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 55 + 53, 48)

    manager.free(first)
    manager.free(second)
    free_order = ids(manager.block_pool.free_block_queue.get_all_free_blocks())
    assert free_order == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # A 160-token miss takes all ten blocks in exactly that order, evicting the cached ones.
    miss = make_request("2", prompt_token_ids=list(range(1000, 1160)))
    _, num_computed, new = admit(manager, miss)
    assert num_computed == 0 and ids(new) == free_order
    assert manager.block_pool.cached_block_hash_to_block.keys() == set(expected_chain(list(range(1000, 1160))))


def test_hit_is_capped_one_token_short_of_the_prompt():
    manager = make_manager()
    tokens = list(range(32))
    admit(manager, make_request("0", prompt_token_ids=tokens))
    _, num_computed, _ = admit(manager, make_request("1", prompt_token_ids=tokens))
    assert num_computed == 16  # the second block holds the last token, which must be recomputed for logits


def test_allocation_failure_changes_nothing():
    manager = make_manager()
    tokens = list(range(48))
    holder = make_request("0", prompt_token_ids=tokens)
    admit(manager, holder)  # blocks 1-3, cached
    manager.free(holder)  # back in the free queue, still cached
    big = make_request("1", prompt_token_ids=tokens + list(range(500, 500 + 16 * 8)))  # 3 hits + 8 new > 10 free
    computed, num_computed, new = admit(manager, big)
    assert ids(computed) == [1, 2, 3] and num_computed == 48
    assert new is None
    assert [b.ref_cnt for b in computed] == [0, 0, 0]
    assert manager.num_free_blocks == 10
    assert manager.get_block_ids("1") == []


def test_reset_prefix_cache_only_when_no_block_is_in_use():
    manager = make_manager()
    request = make_request("0", prompt_token_ids=list(range(40)))
    admit(manager, request)
    assert manager.reset_prefix_cache() is False
    assert manager.block_pool.cached_block_hash_to_block  # untouched
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert not manager.block_pool.cached_block_hash_to_block
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.make_prefix_cache_stats().reset is True
    _, num_computed, _ = admit(manager, make_request("1", prompt_token_ids=list(range(40))))
    assert num_computed == 0


def test_cache_salt_isolates_and_same_salt_hits():
    manager = make_manager(num_blocks=30)
    tokens = list(range(40))
    salted = make_request("0", prompt_token_ids=tokens)
    salted.cache_salt = "tenant-a"
    admit(manager, salted)
    assert salted.block_hashes == expected_chain(tokens, [(("cache_salt", "tenant-a"),), None])
    plain = make_request("1", prompt_token_ids=tokens)
    admit(manager, plain)
    assert plain.block_hashes == expected_chain(tokens)
    assert all(a != b for a, b in zip(salted.block_hashes, plain.block_hashes, strict=True))  # chain differs
    same = make_request("2", prompt_token_ids=tokens)
    same.cache_salt = "tenant-a"
    _, num_computed, _ = admit(manager, same)
    assert num_computed == 32
    other = make_request("3", prompt_token_ids=tokens)
    other.cache_salt = "tenant-b"
    _, num_computed, _ = admit(manager, other)
    assert num_computed == 0
    empty = make_request("4", prompt_token_ids=tokens)
    empty.cache_salt = ""  # no salt, as in vLLM's generate_block_hash_extra_keys: the unsalted prompt's blocks hit
    _, num_computed, _ = admit(manager, empty)
    assert (empty.block_hashes, num_computed) == (expected_chain(tokens), 32)


def test_multimodal_and_lora_extra_keys():
    manager = make_manager(num_blocks=30)
    tokens = list(range(48))
    request = make_request("0", prompt_token_ids=tokens)
    request.lora_name, request.lora_hash = "adapter", "weights-sha256"
    # An image occupying tokens 10..29 overlaps blocks 0 and 1; its start is at +10 in block 0, -6 in block 1.
    request.mm_features = [MultiModalFeature("image", "img-hash", offset=10, length=20)]
    admit(manager, request)
    assert request.block_hashes == expected_chain(
        tokens,
        [
            (("lora", "adapter", "weights-sha256"), ("mm", "img-hash", 10)),
            (("lora", "adapter", "weights-sha256"), ("mm", "img-hash", -6)),
            (("lora", "adapter", "weights-sha256"),),
        ],
    )
    different_image = make_request("1", prompt_token_ids=tokens)
    different_image.lora_name = "adapter"
    different_image.mm_features = [MultiModalFeature("image", "other-hash", offset=10, length=20)]
    _, num_computed, _ = admit(manager, different_image)
    assert num_computed == 0


def test_caching_disabled_never_hits():
    manager = make_manager(enable_caching=False)
    tokens = list(range(40))
    admit(manager, make_request("0", prompt_token_ids=tokens))
    computed, num_computed, _ = admit(manager, make_request("1", prompt_token_ids=tokens))
    assert (computed, num_computed) == ([], 0)
    assert not manager.block_pool.cached_block_hash_to_block


def test_readmission_after_preemption_is_counted_apart():
    """vLLM's PrefixCacheStats.record: a request with num_preemptions > 0 goes to preempted_*, so finding its own
    blocks again is no hit of the hit rate."""
    manager = make_manager()
    tokens = list(range(40))
    request = make_request("0", prompt_token_ids=tokens)
    admit(manager, request)  # 40 looked up, 0 found; blocks 0-1 cached
    manager.free(request)  # preempted: the blocks stay cached
    request.num_computed_tokens, request.num_preemptions = 0, 1
    request.append_output_token_id(7)  # one output before the preemption: 41 tokens to look up
    _, num_computed, _ = admit(manager, request)
    assert num_computed == 32
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 40, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 41, 32)
