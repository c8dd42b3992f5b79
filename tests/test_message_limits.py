"""Messages on the shared frontend <-> core stream stay within the receiver's limit, whatever the step or the
abort holds: one message over it would end the stream, and every request on it (a core's step outputs for 24
requests with 14 MiB ids did, 279 MB against the 256 MiB limit). Pure functions; the split stack runs them in
``tests/test_grpc_faults.py``."""

from __future__ import annotations

import grpc
import pytest

from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, SchedulerStats
from core_svc.request import FinishReason
from core_svc.wire import outputs_to_pb, outputs_to_pb_messages
from frontend_svc.wire import abort_messages
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb


def step_outputs(num_requests: int, id_length: int, prompt_logprobs_of: int | None = None) -> EngineCoreOutputs:
    """A step: one new token for each request, the last one finished; ``prompt_logprobs_of`` also gets the prompt
    logprobs of 100 positions with 20 candidates each; two more requests finished by aborts."""
    outputs = []
    for i in range(num_requests):
        prompt_logprobs = None
        if i == prompt_logprobs_of:
            prompt_logprobs = LogprobsLists([list(range(21))] * 100, [[-1.5] * 21] * 100, [3] * 100)
        outputs.append(
            EngineCoreOutput(
                f"{i:04d}" + "r" * id_length,
                [1000 + i],
                new_prompt_logprobs=prompt_logprobs,
                finish_reason=FinishReason.LENGTH if i == num_requests - 1 else None,
            )
        )
    return EngineCoreOutputs(
        outputs=outputs,
        scheduler_stats=SchedulerStats(num_running_reqs=num_requests, num_waiting_reqs=0, kv_cache_usage=0.5),
        timestamp=123.25,
        finished_requests={"aborted-a" + "x" * id_length, "aborted-b" + "x" * id_length},
    )


def test_a_step_within_the_limit_is_one_message_as_before():
    outputs = step_outputs(5, 10)
    messages, too_large = outputs_to_pb_messages(outputs, 2**20)
    assert messages == [outputs_to_pb(outputs)] and too_large == []
    assert outputs_to_pb_messages(outputs, 0) == ([outputs_to_pb(outputs)], [])  # 0: no limit


@pytest.mark.parametrize("max_bytes", [1100, 4096, 10_000])
def test_a_larger_step_is_split_between_its_outputs(max_bytes):
    outputs = step_outputs(30, 1000)
    whole = outputs_to_pb(outputs)
    assert whole.ByteSize() > 30 * 1000  # far over every limit here
    messages, too_large = outputs_to_pb_messages(outputs, max_bytes)
    assert too_large == []
    assert all(m.ByteSize() <= max_bytes for m in messages)
    assert len(messages) >= whole.ByteSize() // max_bytes
    # Together they hold what the one message held, in its order; the stats once, in the first.
    assert [o for m in messages for o in m.outputs] == list(whole.outputs)
    assert [r for m in messages for r in m.finished_requests] == list(whole.finished_requests)
    assert messages[0].scheduler_stats == whole.scheduler_stats
    assert not any(m.HasField("scheduler_stats") for m in messages[1:])
    assert {m.timestamp for m in messages} == {123.25}


def test_an_output_too_large_alone_ends_its_request_with_resource_exhausted():
    outputs = step_outputs(4, 10, prompt_logprobs_of=2)
    alone = outputs_to_pb(EngineCoreOutputs(outputs=[outputs.outputs[2]])).ByteSize()
    assert alone > 10_000  # 100 positions x 21 candidates
    messages, too_large = outputs_to_pb_messages(outputs, 4096)
    assert too_large == [outputs.outputs[2].request_id]
    assert all(m.ByteSize() <= 4096 for m in messages)
    sent = [o for m in messages for o in m.outputs]
    assert [o.request_id for o in sent] == [o.request_id for o in outputs.outputs]  # each request still hears
    refused = sent[2]
    assert refused.finish_reason == pb.FINISH_REASON_ERROR and not refused.new_prompt_logprobs
    assert refused.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert refused.error.message.startswith("the output of this request in one step is ")
    assert "more than the 4096 bytes the engine core sends in one message" in refused.error.message
    # The others go out as they were.
    whole = outputs_to_pb(outputs)
    assert [sent[i] for i in (0, 1, 3)] == [whole.outputs[i] for i in (0, 1, 3)]


@pytest.mark.parametrize("max_bytes", [1100, 5000, 16 * 2**20])
def test_abort_messages_stay_within_the_cores_receive_limit(max_bytes):
    ids = [f"{i}_" + "p" * 1000 + "-0a1b2c3d" for i in range(40)]  # the n children of one request
    messages = abort_messages(ids, max_bytes)
    assert all(m.ByteSize() <= max_bytes for m in messages)
    assert [i for m in messages for i in m.abort.request_ids] == ids
    assert (len(messages) == 1) == (max_bytes > 41 * 1020)  # split only when the 40 ids do not fit
    assert abort_messages(ids, 0) == [pb.EngineCoreClientMessage(abort=pb.AbortRequests(request_ids=ids))]
