"""Scheduler with fake model output (vLLM test_scheduler cases, re-expressed)."""

import pytest

from core_svc.request import EngineCoreEventType, FinishReason, RequestStatus
from tests.factories import EOS_TOKEN_ID, fake_model_output, make_request, make_scheduler, run_step


def test_all_requests_scheduled_in_one_step_in_order():
    scheduler = make_scheduler()
    requests = [make_request(str(i), num_tokens=10 + i) for i in range(10)]
    for r in requests:
        scheduler.add_request(r)
    output = scheduler.schedule()
    assert [d.request_id for d in output.scheduled_new_reqs] == [str(i) for i in range(10)]
    assert output.num_scheduled_tokens == {str(i): 10 + i for i in range(10)}
    assert output.total_num_scheduled_tokens == sum(10 + i for i in range(10))
    assert scheduler.running == requests and len(scheduler.waiting) == 0
    assert all(r.status == RequestStatus.RUNNING for r in requests)
    # The runner gets each request's blocks: ceil(tokens / 16).
    assert [len(d.block_ids) for d in output.scheduled_new_reqs] == [1] * 7 + [2] * 3


def test_long_prefill_threshold_chunks_and_interleaves_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for i in range(3):
        scheduler.add_request(make_request(str(i), num_tokens=800))
    steps = []
    for _ in range(3):
        output, _ = run_step(scheduler)
        steps.append([output.num_scheduled_tokens[str(i)] for i in range(3)])
    assert steps == [[400, 400, 224], [400, 400, 224], [1, 1, 352]]


def test_chunked_prefill_off_does_not_skip_ahead():
    scheduler = make_scheduler(max_num_batched_tokens=1024, max_model_len=1024, enable_chunked_prefill=False)
    for i, n in enumerate([800, 800, 10, 10]):
        scheduler.add_request(make_request(str(i), num_tokens=n))
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"0": 800}


def test_chunked_prefill_off_checks_the_budget_after_the_long_prefill_threshold():
    # vLLM caps a prompt at long_prefill_token_threshold first, then refuses what exceeds the budget: two 80-token
    # prompts under a 100-token budget and a threshold of 50 both take 50 (the second fits the 50 left).
    scheduler = make_scheduler(
        max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False, long_prefill_token_threshold=50
    )
    for i in range(2):
        scheduler.add_request(make_request(str(i), num_tokens=80))
    assert scheduler.schedule().num_scheduled_tokens == {"0": 50, "1": 50}


def test_chunked_prefill_samples_only_after_the_last_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("0", num_tokens=150))
    chunks = []
    while True:
        output, engine_outputs = run_step(scheduler)
        chunks.append(output.num_scheduled_tokens["0"])
        if engine_outputs.outputs:
            break
    assert chunks == [64, 64, 22]
    assert engine_outputs.outputs[0].new_token_ids == [100]


@pytest.mark.parametrize(
    ("params", "sampled", "status", "num_outputs", "stop_reason"),
    [
        ({}, [5, EOS_TOKEN_ID], RequestStatus.FINISHED_STOPPED, 2, None),
        ({"stop_token_ids": [42]}, [5, 42], RequestStatus.FINISHED_STOPPED, 2, 42),
        ({"max_tokens": 2}, [5, 6, 7], RequestStatus.FINISHED_LENGTH_CAPPED, 2, None),
        (
            {"ignore_eos": True, "max_tokens": 3},
            [EOS_TOKEN_ID, EOS_TOKEN_ID, 9],
            RequestStatus.FINISHED_LENGTH_CAPPED,
            3,
            None,
        ),
        # min_tokens: EOS and stop ids before the fifth output are not honoured
        (
            {"min_tokens": 5, "stop_token_ids": [42]},
            [EOS_TOKEN_ID, 42, 7, 8, EOS_TOKEN_ID],
            RequestStatus.FINISHED_STOPPED,
            5,
            None,
        ),
        ({"min_tokens": 3, "stop_token_ids": [42]}, [42, 1, 42], RequestStatus.FINISHED_STOPPED, 3, 42),
    ],
)
def test_stop_checks(params, sampled, status, num_outputs, stop_reason):
    scheduler = make_scheduler()
    request = make_request("0", num_tokens=8, **params)
    scheduler.add_request(request)
    finish_reason = None
    for token in sampled:
        _, outputs = run_step(scheduler, {"0": token})
        if outputs.outputs and outputs.outputs[0].finished:
            finish_reason = outputs.outputs[0].finish_reason
            break
    assert request.status == status
    assert request.num_output_tokens == num_outputs
    assert request.output_token_ids == sampled[:num_outputs]
    assert request.stop_reason == stop_reason
    assert finish_reason == status.finish_reason
    assert "0" not in scheduler.requests and scheduler.kv_cache_manager.num_free_blocks == 9999


def test_max_model_len_caps_generation():
    scheduler = make_scheduler(max_model_len=12)
    request = make_request("0", num_tokens=10, max_tokens=100)
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert request.num_tokens == 12 and request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_preemption_picks_the_last_running_request():
    # 10 usable blocks; two 80-token prompts take 5 blocks each. The first decode needs a sixth block.
    scheduler = make_scheduler(num_blocks=11, enable_caching=False)
    first, second = make_request("0", num_tokens=80), make_request("1", num_tokens=80)
    scheduler.add_request(first)
    scheduler.add_request(second)
    output, _ = run_step(scheduler)
    assert output.num_scheduled_tokens == {"0": 80, "1": 80}
    assert scheduler.kv_cache_manager.num_free_blocks == 0

    output = scheduler.schedule()
    assert output.preempted_req_ids == {"1"}
    assert output.num_scheduled_tokens == {"0": 1}
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert second.output_token_ids == [100]  # kept: recompute covers prompt + outputs
    assert second.num_preemptions == 1 and second.events[-1].type == EngineCoreEventType.PREEMPTED
    assert scheduler.waiting.peek_request() is second and scheduler.running == [first]
    outputs = scheduler.update_from_output(output, fake_model_output(scheduler, output))
    assert outputs.scheduler_stats.num_preemptions == 1

    # When the first finishes, the second is resumed with its whole block table and all its tokens.
    scheduler.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    output = scheduler.schedule()
    resumed = output.scheduled_cached_reqs
    assert [(r.request_id, r.resumed_from_preemption) for r in resumed] == [("1", True)]
    assert output.num_scheduled_tokens == {"1": 81} and len(resumed[0].new_block_ids) == 6


def test_priority_order_and_tie_break_by_arrival():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    for i, priority in enumerate([3, 2, 0]):
        scheduler.add_request(make_request(str(i), priority=priority))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["2"]
    assert [r.priority for r in scheduler.waiting] == [2, 3]

    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("late", priority=1, arrival_time=20.0))
    scheduler.add_request(make_request("early", priority=1, arrival_time=10.0))
    assert list(scheduler.schedule().num_scheduled_tokens) == ["early"]


def test_priority_preemption_evicts_lowest_priority_latest_arrival():
    # 6 usable blocks; three 32-token requests take 2 blocks each. Decoding needs more blocks.
    scheduler = make_scheduler(num_blocks=7, policy="priority", enable_caching=False)
    scheduler.add_request(make_request("urgent", num_tokens=32, priority=0, arrival_time=3.0))
    scheduler.add_request(make_request("old-low", num_tokens=32, priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("new-low", num_tokens=32, priority=5, arrival_time=2.0))
    output, _ = run_step(scheduler)
    assert set(output.num_scheduled_tokens) == {"urgent", "old-low", "new-low"}
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"new-low"}
    assert output.num_scheduled_tokens == {"urgent": 1, "old-low": 1}


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=11, enable_caching=False)
    scheduler.add_request(make_request("0", num_tokens=80))
    scheduler.add_request(make_request("1", num_tokens=80))
    run_step(scheduler)
    scheduler.add_request(make_request("small", num_tokens=4))
    output = scheduler.schedule()
    assert output.preempted_req_ids == {"1"}
    assert "small" not in output.num_scheduled_tokens


def test_finish_requests_is_idempotent_and_frees_blocks():
    scheduler = make_scheduler(num_blocks=101)
    running, waiting = make_request("run", num_tokens=40), make_request("wait", num_tokens=40)
    scheduler.add_request(running)
    run_step(scheduler)
    scheduler.add_request(waiting)
    assert scheduler.kv_cache_manager.num_free_blocks < 100
    finished = scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"run", "wait"}
    assert running.status.finish_reason == FinishReason.ABORT
    assert scheduler.finish_requests(["run"], RequestStatus.FINISHED_ABORTED) == []
    assert scheduler.kv_cache_manager.num_free_blocks == 100
    assert not scheduler.has_unfinished_requests()
    output = scheduler.schedule()
    assert output.finished_req_ids == {"run", "wait"} and output.total_num_scheduled_tokens == 0
    assert scheduler.take_finished_requests() == {"run", "wait"}


def test_prefix_hit_is_reported_as_cached_tokens():
    scheduler = make_scheduler()
    shared = list(range(1, 65))
    scheduler.add_request(make_request("a", prompt_token_ids=shared + [7, 8]))
    run_step(scheduler)
    scheduler.add_request(make_request("b", prompt_token_ids=shared + [9]))
    output, outputs = run_step(scheduler)
    assert output.num_scheduled_tokens["b"] == 1
    b_out = next(o for o in outputs.outputs if o.request_id == "b")
    assert b_out.num_cached_tokens == 64
    assert outputs.scheduler_stats.prefix_cache_stats.hits == 64


def test_priority_preemption_of_a_request_scheduled_this_step_leaves_no_uncomputed_block_cached():
    """Blocks are cached when allocated, before the forward computes them. A victim preempted in the same step
    that scheduled it never gets that forward, so its newly full blocks must not be found by a later lookup."""
    scheduler = make_scheduler(
        policy="priority",
        block_size=4,
        num_blocks=6,
        max_num_batched_tokens=12,
        long_prefill_token_threshold=5,
        max_model_len=64,
    )
    low = make_request("low", prompt_token_ids=list(range(10, 26)), priority=1, max_tokens=4, ignore_eos=True)
    scheduler.add_request(low)
    run_step(scheduler)  # low: positions 0-4 computed
    high = make_request("high", prompt_token_ids=[3, 4, 5, 6], priority=0, max_tokens=3, ignore_eos=True)
    scheduler.add_request(high)
    run_step(scheduler)  # low: 5-9; high: its prompt
    output = scheduler.schedule()  # low is given 10-14 (filling its third block), then high's decode preempts it
    assert output.preempted_req_ids == {"low"} and "low" not in output.num_scheduled_tokens
    assert low.num_computed_tokens == 0
    computed, num_computed = scheduler.kv_cache_manager.get_computed_blocks(low)
    assert num_computed == 8  # blocks 0-1 (positions 0-7) really computed; block 2 (8-11) never was
    scheduler.update_from_output(output, fake_model_output(scheduler, output))


def test_abort_with_repeated_ids():
    scheduler = make_scheduler(num_blocks=11)
    for request_id in ("a", "b"):
        scheduler.add_request(make_request(request_id, num_tokens=20))
    scheduler.schedule()
    finished = scheduler.finish_requests(["a", "a", "b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in finished] == ["a", "b"]
    assert not scheduler.requests and scheduler.kv_cache_manager.num_free_blocks == 10


def test_prefix_cache_stats_count_each_admission_once():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", num_tokens=40, max_tokens=5))
    scheduler.add_request(make_request("second", prompt_token_ids=list(range(1, 41)), max_tokens=5))
    totals = [0, 0, 0]
    while scheduler.has_unfinished_requests():
        _, outputs = run_step(scheduler)  # "second" waits (max_num_seqs=1) while "first" decodes
        stats = outputs.scheduler_stats.prefix_cache_stats
        totals = [totals[0] + stats.requests, totals[1] + stats.queries, totals[2] + stats.hits]
    assert totals == [2, 80, 0]


def test_prefix_cache_stats_count_readmissions_after_preemption_apart():
    """4 unrelated 40-token prompts, max_tokens 40, block_size 16, 13 blocks (12 usable), worked by hand.

    Step 1 admits all four: 40 tokens = 3 blocks each, 12 in all; blocks 0-1 (tokens 0-31) of each are full and
    cached. Step k >= 2 decodes position 38 + k, which needs a fourth block at k = 10 (position 48): A's
    allocation finds no free block, so D (last running) is preempted with 48 computed tokens and 9 outputs;
    its three cached blocks go to the free queue's tail, and A, B, C take one each, evicting all three. At
    k = 26 (position 64) A needs a fifth block: C is preempted with 64 computed tokens and 25 outputs; A and B
    take C's blocks 3 and 2, and C's blocks 0-1 stay cached. C, first in the queue, cannot come back (5
    blocks needed, 2 free) until A and B finish after step 40 (40 outputs need 79 slots: 5 blocks, no more).
    Then C is admitted with 40 + 25 = 65 tokens, finding its own blocks 0-1 (32 tokens), and D with
    40 + 9 = 49 tokens, finding nothing. vLLM counts the first admissions only in queries / hits: 4 x 40 = 160
    and 0; the re-admissions apart: 2 requests, 65 + 49 = 114 tokens, 32 hits.
    """
    scheduler = make_scheduler(num_blocks=13, block_size=16, max_model_len=1024)
    for request_id in "ABCD":
        scheduler.add_request(make_request(request_id, num_tokens=40, max_tokens=40, ignore_eos=True))
    totals = dict.fromkeys(
        ["requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits"], 0
    )
    preempted_at: list[tuple[int, str, int]] = []  # (step, request, its outputs)
    step = 0
    while scheduler.has_unfinished_requests():
        step += 1
        output, outputs = run_step(scheduler)
        for request_id in sorted(output.preempted_req_ids):
            preempted_at.append((step, request_id, scheduler.requests[request_id].num_output_tokens))
        for name in totals:
            totals[name] += getattr(outputs.scheduler_stats.prefix_cache_stats, name)
    assert preempted_at == [(10, "D", 9), (26, "C", 25)]
    assert totals == {
        "requests": 4,
        "queries": 160,
        "hits": 0,
        "preempted_requests": 2,
        "preempted_queries": 65 + 49,
        "preempted_hits": 32,
    }


def test_fail_step_ends_only_its_requests_and_uncaches_what_its_forward_was_to_write():
    """Blocks are cached at allocation, for tokens the coming forward computes. When that forward raises, the
    step's requests fail, every block comes back, and only blocks an earlier, finished forward wrote stay cached.
    By hand, block_size 16: "dec" (31-token prompt) is prefilled in step 1, which caches its block 0 (tokens
    0-15). Step 2 schedules its decode of position 31, which fills block 1 (cached at allocation), and admits
    "new" (40 tokens: blocks 0-1 cached at allocation); "wait" stays queued (max_num_seqs=2). Step 2 fails."""
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=11)
    kv = scheduler.kv_cache_manager
    dec = make_request("dec", num_tokens=31, max_tokens=5, ignore_eos=True)
    scheduler.add_request(dec)
    run_step(scheduler)
    new = make_request("new", num_tokens=40, max_tokens=5, ignore_eos=True)
    waiting = make_request("wait", num_tokens=20, max_tokens=2, ignore_eos=True)
    scheduler.add_request(new)
    scheduler.add_request(waiting)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"dec": 1, "new": 40}
    assert len(kv.block_pool.cached_block_hash_to_block) == 1 + 1 + 2  # dec's 0 and 1, new's 0 and 1
    error = RuntimeError("boom")
    failed = scheduler.fail_step(output, error)
    assert [(o.request_id, o.finish_reason, o.new_token_ids, o.error) for o in failed] == [
        ("dec", FinishReason.ERROR, [], error),
        ("new", FinishReason.ERROR, [], error),
    ]
    assert dec.status == new.status == RequestStatus.FINISHED_ERROR
    assert kv.num_free_blocks == 10 and list(scheduler.waiting) == [waiting] and scheduler.running == []
    cached = {b.block_id for blocks in kv.block_pool.cached_block_hash_to_block.values() for b in blocks.values()}
    assert cached == {1}  # dec's block 0: block id 1, the first handed out (0 is the null block)
    probe_dec = make_request("probe-dec", prompt_token_ids=[*dec.all_token_ids, 0])  # 33 tokens: 2 full blocks
    assert kv.get_computed_blocks(probe_dec)[1] == 16
    assert kv.get_computed_blocks(make_request("probe-new", prompt_token_ids=[*new.prompt_token_ids, 0]))[1] == 0
    outputs = scheduler.make_outputs(failed)
    assert outputs.finished_requests == {"dec", "new"} and outputs.scheduler_stats.num_running_reqs == 0
    # The next step tells the runner to drop them, and the waiting request runs.
    output, outputs = run_step(scheduler)
    assert output.finished_req_ids == {"dec", "new"} and output.num_scheduled_tokens == {"wait": 20}
    assert [o.new_token_ids for o in outputs.outputs] == [[100]]


def test_a_request_the_runner_failed_ends_alone_and_uncaches_its_step():
    scheduler = make_scheduler(num_blocks=11)  # block_size 16
    kv = scheduler.kv_cache_manager
    scheduler.add_request(make_request("ok", num_tokens=20, max_tokens=5, ignore_eos=True))
    scheduler.add_request(bad := make_request("bad", num_tokens=40, max_tokens=5, ignore_eos=True))
    output = scheduler.schedule()
    model_output = fake_model_output(scheduler, output)
    error = RuntimeError("rows")
    model_output.failed_requests = {"bad": error}
    outputs = scheduler.update_from_output(output, model_output)
    assert [(o.request_id, o.finish_reason, o.new_token_ids, o.error) for o in outputs.outputs] == [
        ("ok", None, [100], None),
        ("bad", FinishReason.ERROR, [], error),
    ]
    assert bad.status == RequestStatus.FINISHED_ERROR and outputs.finished_requests == {"bad"}
    assert [r.request_id for r in scheduler.running] == ["ok"]
    # Its blocks, cached at allocation for the tokens this step failed to compute, are not found again.
    assert kv.get_computed_blocks(make_request("probe", prompt_token_ids=[*bad.prompt_token_ids, 0]))[1] == 0


def test_requests_that_stop_in_one_step_free_their_blocks_in_the_steps_order():
    """Block ids are the same from run to run: stopped requests are freed in the step's order (they were kept in
    a set of requests, whose order followed memory addresses). Without prefix caching each freed block goes to the
    head of the free queue, so the next requests get the blocks of the last-freed requests first."""
    scheduler = make_scheduler(enable_caching=False)
    first = [make_request(f"a{i}", num_tokens=10, max_tokens=1) for i in range(8)]
    for request in first:
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert [d.block_ids for d in output.scheduled_new_reqs] == [[i + 1] for i in range(8)]  # block 0 is null
    assert all(r.is_finished for r in first)
    for i in range(8):
        scheduler.add_request(make_request(f"b{i}", num_tokens=10, max_tokens=1))
    output = scheduler.schedule()
    assert [d.block_ids for d in output.scheduled_new_reqs] == [[8 - i] for i in range(8)]
