"""Encoder scheduling without a model (vLLM's ``EncoderCacheManager`` and the scheduler's
``_try_schedule_encoder_inputs``): which items each step encodes, the compute budget cutting a chunk before an
item, the cache's references, reuse, eviction and freeing."""

from __future__ import annotations

from core_svc.config import SchedulerConfig
from core_svc.kv_cache_manager import KVCacheManager
from core_svc.request import MultiModalFeature, Request, RequestStatus
from core_svc.scheduler import Scheduler
from tests.factories import fake_model_output, make_request, run_step

IMAGE = 7  # the placeholder token id of these tests


def _scheduler(
    max_num_batched_tokens: int = 64,
    max_num_encoder_input_tokens: int = 0,
    encoder_cache_size: int = 0,
    num_blocks: int = 100,
    block_size: int = 4,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=256,
        max_tokens_per_mm_item=16,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        encoder_cache_size=encoder_cache_size,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, 256))


def _request(request_id: str, items: list[tuple[int, str]], num_tokens: int = 48, base: int = 100) -> Request:
    """A prompt of ``num_tokens`` with a 16-token image at each (offset, identifier)."""
    prompt = [base + i for i in range(num_tokens)]
    for offset, _ in items:
        prompt[offset : offset + 16] = [IMAGE] * 16
    request = make_request(request_id, prompt_token_ids=prompt, max_tokens=2)
    request.mm_features = [MultiModalFeature("image", identifier, offset, 16) for offset, identifier in items]
    return request


def test_the_encoder_budget_cuts_the_chunk_before_an_item() -> None:
    scheduler = _scheduler(max_num_encoder_input_tokens=20)  # one 16-row image per step
    scheduler.add_request(_request("a", [(4, "x"), (24, "y")]))
    first, _ = run_step(scheduler)
    assert first.scheduled_encoder_inputs == {"a": [0]}
    assert first.num_scheduled_tokens == {"a": 24}  # up to the second image's first placeholder
    second, _ = run_step(scheduler)
    assert second.scheduled_encoder_inputs == {"a": [1]}
    assert second.num_scheduled_tokens == {"a": 24}


def test_items_are_freed_once_computed_and_reused_from_the_cache() -> None:
    scheduler = _scheduler(max_num_batched_tokens=12)  # chunks of 12: the image [4, 20) spans two steps
    manager = scheduler.encoder_cache_manager
    scheduler.add_request(_request("a", [(4, "x")], num_tokens=30))
    first, _ = run_step(scheduler)
    assert first.scheduled_encoder_inputs == {"a": [0]}
    assert manager.cached["x"] == {"a"}  # still needed by the next chunk
    second, _ = run_step(scheduler)
    assert second.scheduled_encoder_inputs == {}  # the runner's cached outputs serve the rest of the item
    assert manager.cached["x"] == set() and "x" in manager.freeable  # passed: freeable, still cached
    scheduler.add_request(_request("b", [(4, "x")], num_tokens=30, base=1000))
    while "b" not in (output := scheduler.schedule()).num_scheduled_tokens:
        scheduler.update_from_output(output, fake_model_output(scheduler, output))
    assert output.scheduled_encoder_inputs.get("b") is None  # same image, another prompt: not encoded again
    assert manager.cached["x"] == {"b"} and "x" not in manager.freeable


def test_a_full_cache_evicts_unreferenced_items_and_tells_the_runner() -> None:
    scheduler = _scheduler(encoder_cache_size=16)  # room for one image
    scheduler.add_request(_request("a", [(4, "x")], num_tokens=24))
    run_step(scheduler)
    scheduler.add_request(_request("b", [(4, "y")], num_tokens=24, base=1000))
    output, _ = run_step(scheduler)
    assert output.scheduled_encoder_inputs == {"b": [0]}
    assert output.free_encoder_mm_hashes == ["x"]


def test_an_item_inside_prefix_cache_hits_is_not_encoded() -> None:
    scheduler = _scheduler()
    request = _request("a", [(4, "x")], num_tokens=40)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    scheduler.encoder_cache_manager.evict(["x"])  # even with its outputs gone from the encoder cache
    again = _request("b", [(4, "x")], num_tokens=40)
    scheduler.add_request(again)
    output, _ = run_step(scheduler)
    assert again.num_cached_tokens >= 20  # the image's blocks [4, 20) hit
    assert output.scheduled_encoder_inputs == {}
    other = _request("c", [(4, "z")], num_tokens=40)  # same tokens, another image: hits stop before it
    scheduler.add_request(other)
    output, _ = run_step(scheduler)
    assert other.num_cached_tokens == 4 and output.scheduled_encoder_inputs == {"c": [0]}


def test_a_failed_step_evicts_what_it_was_to_encode() -> None:
    scheduler = _scheduler(max_num_batched_tokens=12)
    scheduler.add_request(_request("a", [(4, "x")], num_tokens=30))
    output = scheduler.schedule()
    assert output.scheduled_encoder_inputs == {"a": [0]}
    scheduler.fail_step(output, RuntimeError("boom"))
    assert "x" not in scheduler.encoder_cache_manager.cached
    manager = scheduler.encoder_cache_manager
    assert manager.num_free_slots == manager.num_freeable_slots == manager.cache_size
    scheduler.add_request(_request("b", [(4, "x")], num_tokens=30, base=1000))
    output = scheduler.schedule()
    assert output.free_encoder_mm_hashes == ["x"]  # the runner drops whatever it computed
    assert output.scheduled_encoder_inputs == {"b": [0]}  # and encodes it again


def test_preemption_reuses_the_cached_item() -> None:
    scheduler = _scheduler(max_num_batched_tokens=12)
    request = _request("a", [(4, "x")], num_tokens=30)
    scheduler.add_request(request)
    run_step(scheduler)
    scheduler._preempt(request)  # as the scheduler does when blocks run out
    scheduler.running.remove(request)
    assert scheduler.encoder_cache_manager.cached["x"] == set()
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"a": 12} and output.scheduled_encoder_inputs == {}


def test_a_waiting_request_without_blocks_keeps_no_encoder_references() -> None:
    scheduler = _scheduler(encoder_cache_size=16, num_blocks=11)  # room for one image; 40 tokens of KV
    manager = scheduler.encoder_cache_manager
    scheduler.add_request(_request("a", [(4, "x")], num_tokens=24))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert manager.cached["x"] == set()  # "x" cached, freeable
    scheduler.add_request(make_request("hog", num_tokens=32, max_tokens=50))
    scheduler.add_request(_request("b", [(4, "x")], num_tokens=24, base=1000))
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"hog": 32}  # "b" found no blocks
    assert manager.cached["x"] == set() and "x" in manager.freeable  # and took no reference to "x"
    assert manager.num_freeable_slots == manager.cache_size


def test_a_failed_step_evicts_the_item_of_a_request_aborted_since() -> None:
    scheduler = _scheduler(max_num_batched_tokens=12)
    manager = scheduler.encoder_cache_manager
    scheduler.add_request(_request("a", [(4, "x")], num_tokens=30))
    output = scheduler.schedule()
    assert output.scheduled_encoder_inputs == {"a": [0]}
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.fail_step(output, RuntimeError("boom"))
    assert "x" not in manager.cached  # the runner never stored it
    assert manager.num_free_slots == manager.num_freeable_slots == manager.cache_size
    scheduler.add_request(_request("b", [(4, "x")], num_tokens=30, base=1000))
    output = scheduler.schedule()
    assert output.scheduled_encoder_inputs == {"b": [0]}  # encoded again, inside the budget
