"""n > 1 without a model: ParentRequest, RequestOutputCollector and OutputProcessor with fake core outputs, hand-worked
n = 5 cases with aborts; child seeds; the all-or-nothing add of a client; what the wire refuses, by field."""

from __future__ import annotations

import pytest

from frontend_svc.core_client import EngineCoreClient
from frontend_svc.engine_types import EngineCoreOutput, EngineCoreRequest, FinishReason, LoRARequest
from frontend_svc.errors import ValidationError
from frontend_svc.input_processor import RequestOptions, check_options
from frontend_svc.output_processor import OutputProcessor, RequestOutputCollector
from frontend_svc.outputs import CompletionOutput, RequestOutput
from frontend_svc.parallel_sampling import ParentRequest
from frontend_svc.sampling_params import INT64_MAX, INT64_MIN, RequestOutputKind, SamplingParams, child_seed
from frontend_svc.wire import request_to_pb
from tests.conftest import real_or_builtin

WORDS = (" a", " b", " c", " d", " e")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_or_builtin("gpt2"))


@pytest.fixture(scope="module")
def word_ids(tokenizer):
    """The id of each of WORDS, which the tokenizer must have as single tokens."""
    ids = {word: tokenizer(word, add_special_tokens=False).input_ids for word in WORDS}
    if any(len(i) != 1 for i in ids.values()):
        pytest.skip("this tokenizer splits the one-letter words")
    return {word: i[0] for word, i in ids.items()}


def fan_out(processor: OutputProcessor, n: int, kind: RequestOutputKind) -> RequestOutputCollector:
    """Parent "p-1" (the caller's id "p") with n children "{i}_p-1" on one collector, as AsyncLLM registers them."""
    queue = RequestOutputCollector(kind, "p-1")
    parent = ParentRequest("p-1", "p", SamplingParams(n=n, temperature=1.0, seed=3, output_kind=kind))
    for index in range(n):
        child_id, params = parent.get_child_info(index)
        processor.add_request(child_id, "p", params, None, [1], parent, index, queue)
    return queue


def out(child: int, token_id: int, finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(f"{child}_p-1", [token_id], finish_reason=finish)


def completions(output: RequestOutput) -> list[tuple[int, str, int, str | None]]:
    """(index, text, number of ids, finish reason) per completion, in the output's order."""
    return [(c.index, c.text, len(c.token_ids), c.finish_reason) for c in output.outputs]


def assert_empty(processor: OutputProcessor) -> None:
    assert not processor.request_states and not processor.parent_requests and not processor.external_req_ids


def test_delta_n5_with_an_abort_merges_what_piled_up(tokenizer, word_ids):
    """Two steps stream into the collector while its consumer waits, then the caller aborts: one take holds
    each completion's whole text in the order the indices first came, the aborted ones ending "abort", the
    two that never produced a token empty."""
    a, b, c, d, e = (word_ids[w] for w in WORDS)
    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 5, RequestOutputKind.DELTA)
    processor.process_outputs([out(0, a), out(1, b), out(2, c)])
    processor.process_outputs([out(0, d, FinishReason.LENGTH), out(1, e)])
    assert sorted(processor.abort_requests(["p"])) == ["1_p-1", "2_p-1", "3_p-1", "4_p-1"]
    merged = queue.get_nowait()
    assert merged.finished and merged.request_id == "p"
    assert completions(merged) == [
        (0, " a d", 2, "length"),
        (1, " b e", 2, "abort"),
        (2, " c", 1, "abort"),
        (3, "", 0, "abort"),
        (4, "", 0, "abort"),
    ]
    assert merged.outputs[0].token_ids == [a, d] and merged.outputs[1].token_ids == [b, e]
    assert queue.get_nowait() is None
    assert_empty(processor)


def test_delta_n5_taken_between_steps_sends_each_piece_once(tokenizer, word_ids):
    a, b, c, d, e = (word_ids[w] for w in WORDS)
    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 5, RequestOutputKind.DELTA)
    processor.process_outputs([out(0, a), out(1, b), out(2, c)])
    first = queue.get_nowait()
    assert completions(first) == [(0, " a", 1, None), (1, " b", 1, None), (2, " c", 1, None)]
    assert not first.finished
    processor.process_outputs([out(0, d, FinishReason.LENGTH), out(1, e)])
    processor.abort_requests(["p-1"], internal=True)  # the parent's internal id covers the children left
    second = queue.get_nowait()
    assert second.finished
    assert completions(second) == [
        (0, " d", 1, "length"),
        (1, " e", 1, "abort"),
        (2, "", 0, "abort"),
        (3, "", 0, "abort"),
        (4, "", 0, "abort"),
    ]
    assert_empty(processor)


def test_final_only_n5_with_an_abort_releases_all_five_once_in_index_order(tokenizer, word_ids):
    a, b, c, d, _ = (word_ids[w] for w in WORDS)
    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 5, RequestOutputKind.FINAL_ONLY)
    processor.process_outputs([out(2, d), out(0, a, FinishReason.LENGTH), out(1, b)])
    processor.process_outputs([out(1, c, FinishReason.LENGTH)])
    assert queue.get_nowait() is None  # nothing before every child has finished
    processor.abort_requests(["p"])
    final = queue.get_nowait()
    assert final.finished
    assert completions(final) == [
        (0, " a", 1, "length"),
        (1, " b c", 2, "length"),
        (2, " d", 1, "abort"),
        (3, "", 0, "abort"),
        (4, "", 0, "abort"),
    ]
    assert queue.get_nowait() is None
    assert_empty(processor)


def test_cumulative_keeps_the_latest_of_each_completion(tokenizer, word_ids):
    a, b, c, _, _ = (word_ids[w] for w in WORDS)
    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 3, RequestOutputKind.CUMULATIVE)
    processor.process_outputs([out(0, a), out(1, b)])
    processor.process_outputs([out(0, c)])
    merged = queue.get_nowait()
    assert completions(merged) == [(0, " a c", 2, None), (1, " b", 1, None)]
    processor.abort_requests(["p"])
    assert completions(queue.get_nowait()) == [(0, " a c", 2, "abort"), (1, " b", 1, "abort"), (2, "", 0, "abort")]


def test_a_closed_collector_takes_nothing_and_its_abort_builds_no_outputs(tokenizer, word_ids):
    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 5, RequestOutputKind.DELTA)
    processor.process_outputs([out(0, word_ids[" a"])])
    queue.close()
    assert len(processor.abort_requests(["p"])) == 5
    assert queue.get_nowait() is None
    assert_empty(processor)


def test_an_error_replaces_what_piled_up_and_the_first_one_stays():
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    queue.put(RequestOutput("r", None, [1], None, [CompletionOutput(0, "x", [5], None, None)], False))
    queue.put(RuntimeError("first"))
    queue.put(RuntimeError("second"))
    with pytest.raises(RuntimeError, match="first"):
        queue.get_nowait()
    assert queue.get_nowait() is None


def test_merge_keeps_logprobs_prompt_logprobs_and_the_last_finish():
    def piece(text, ids, logprobs, finish=None, prompt_logprobs=None, cached=0):
        completion = CompletionOutput(0, text, ids, -float(len(ids)), logprobs, finish)
        return RequestOutput("r", "p", [1], prompt_logprobs, [completion], finish is not None, cached)

    prompt_logprobs = [None, {1: None}]
    merged = RequestOutput.merge(
        [
            piece("a", [1], None, prompt_logprobs=prompt_logprobs),
            piece("b", [2], [{2: None}], prompt_logprobs=[]),  # DELTA's outputs after the first carry []
            piece("", [], []),
        ],
        aggregate=True,
    )
    assert merged.outputs[0].text == "ab" and merged.outputs[0].token_ids == [1, 2]
    assert merged.outputs[0].logprobs == [{2: None}] and merged.prompt_logprobs is prompt_logprobs
    assert merged.outputs[0].cumulative_logprob == 0.0 and not merged.finished
    final = piece("c", [3], None, finish="stop", cached=7)
    merged.add(final, aggregate=True)
    assert (merged.outputs[0].text, merged.outputs[0].finish_reason) == ("abc", "stop")
    assert merged.finished and merged.num_cached_tokens == 7
    with pytest.raises(ValueError):
        RequestOutput.merge([], aggregate=True)


def test_aborting_16384_children_leaves_nothing_and_names_them_all(tokenizer):
    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 16384, RequestOutputKind.DELTA)
    aborted = processor.abort_requests(["p"])
    assert sorted(aborted) == sorted(f"{i}_p-1" for i in range(16384))
    final = queue.get_nowait()
    assert final.finished and [c.index for c in final.outputs] == list(range(16384))
    assert {c.finish_reason for c in final.outputs} == {"abort"}
    assert_empty(processor)


def test_a_failed_child_fails_its_16384_siblings_once(tokenizer):
    from frontend_svc.errors import InternalError

    processor = OutputProcessor(tokenizer)
    queue = fan_out(processor, 16384, RequestOutputKind.DELTA)
    lost = [
        EngineCoreOutput(f"{i}_p-1", [], finish_reason=FinishReason.ERROR, error=InternalError("boom"))
        for i in range(16384)
    ]
    result = processor.process_outputs(lost)
    assert sorted(result.reqs_to_abort) == sorted(f"{i}_p-1" for i in range(1, 16384))
    with pytest.raises(InternalError, match="boom"):
        queue.get_nowait()
    assert_empty(processor)


# --- seeds ---


def test_child_seeds_wrap_into_int64():
    assert child_seed(INT64_MAX, 0) == INT64_MAX
    assert child_seed(INT64_MAX, 1) == INT64_MIN
    assert child_seed(INT64_MAX - 1, 3) == INT64_MIN + 1
    assert child_seed(-3, 2) == -1 and child_seed(5, 2) == 7
    params = SamplingParams(n=3, temperature=1.0, seed=INT64_MAX - 1)
    assert [params.child(i).seed for i in range(3)] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]
    assert params.child(2).n == 1 and params.n == 3


def test_torch_seeds_a_negative_seed_as_its_twos_complement():
    """What the wrap relies on: the core's generator for seed -2**63 is vLLM's for seed 2**63."""
    import torch

    assert torch.Generator().manual_seed(INT64_MIN).initial_seed() == 2**63
    a = torch.rand(4, generator=torch.Generator().manual_seed(INT64_MIN))
    b = torch.rand(4, generator=torch.Generator().manual_seed(2**63))
    assert torch.equal(a, b)


def test_an_unseeded_parent_shares_one_child_params_and_a_seeded_one_copies():
    unseeded = ParentRequest("p-1", "p", SamplingParams(n=3, temperature=1.0))
    assert unseeded.get_child_info(0)[1] is unseeded.get_child_info(2)[1]
    seeded = ParentRequest("q-1", "q", SamplingParams(n=3, temperature=1.0, seed=0))
    assert [seeded.get_child_info(i)[1].seed for i in range(3)] == [0, 1, 2]


# --- what the wire cannot carry, by field ---


def core_request(**changes: object) -> EngineCoreRequest:
    fields: dict[str, object] = {
        "request_id": "r",
        "prompt_token_ids": [1, 2],
        "sampling_params": SamplingParams(max_tokens=4),
        "arrival_time": 1.0,
        "priority": 0,
        "cache_salt": None,
        "trace_headers": {},
    }
    fields.update(changes)
    return EngineCoreRequest(**fields)  # type: ignore[arg-type]  # fields as keywords


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"priority": 2**40}, "priority"),
        ({"arrival_time": "now"}, "arrival_time"),
        ({"cache_salt": "\ud800"}, "cache_salt"),
        ({"trace_headers": {"traceparent": 1}}, "trace_headers"),
        ({"request_id": "r\udc00"}, "request_id"),
        ({"prompt_token_ids": [1, 2**40]}, "prompt_token_ids"),
    ],
)
def test_request_to_pb_names_the_field_it_cannot_convert(changes, field):
    with pytest.raises(ValidationError) as info:
        request_to_pb(core_request(**changes))
    assert info.value.field == field


@pytest.mark.parametrize(("name", "value"), [("seed", 2**63), ("top_k", 2**31), ("stop_token_ids", [2**40])])
def test_request_to_pb_names_a_sampling_field_it_cannot_convert(name, value):
    params = SamplingParams(max_tokens=4)
    setattr(params, name, value)  # past validation, as a bug would
    with pytest.raises(ValidationError) as info:
        request_to_pb(core_request(sampling_params=params))
    assert info.value.field == name


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (RequestOptions(priority=2**31), "priority"),
        (RequestOptions(arrival_time=float("nan")), "arrival_time"),
        (RequestOptions(arrival_time="0"), "arrival_time"),  # type: ignore[arg-type]  # wrong on purpose
        (RequestOptions(cache_salt=b"salt"), "cache_salt"),  # type: ignore[arg-type]  # wrong on purpose
        (RequestOptions(cache_salt="\udfff"), "cache_salt"),
        (RequestOptions(cache_salt=""), "cache_salt"),  # vLLM's OpenAI layer refuses an empty salt
        (RequestOptions(trace_headers=[("a", "b")]), "trace_headers"),  # type: ignore[arg-type]  # wrong on purpose
        (RequestOptions(trace_headers={"a": "\ud800"}), "trace_headers['a']"),
        (RequestOptions(lora_request="sql"), "lora_request"),  # type: ignore[arg-type]  # wrong on purpose
        (RequestOptions(lora_request=LoRARequest("")), "lora_request.lora_name"),
        (RequestOptions(lora_request=LoRARequest("\ud800")), "lora_request.lora_name"),
    ],
)
def test_options_the_wire_cannot_carry_are_refused_naming_the_field(options, field):
    with pytest.raises(ValidationError) as info:
        check_options(options)
    assert info.value.field == field
    check_options(RequestOptions(arrival_time=12.5, priority=-(2**31), cache_salt="s", trace_headers={"a": "b"}))
    check_options(RequestOptions(lora_request=LoRARequest("sql")))


def test_a_requests_adapter_goes_to_the_core_by_name():
    assert not request_to_pb(core_request()).HasField("lora_request")
    msg = request_to_pb(core_request(lora_request=LoRARequest("sql")))
    assert (msg.lora_request.lora_name, msg.lora_request.lora_int_id, msg.lora_request.lora_path) == ("sql", 0, "")


# --- the all-or-nothing add of a client ---


class FailingClient(EngineCoreClient):
    """Takes adds until ``fail_at`` (the index of the add that fails); records what was added and aborted."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.added, self.aborted = fail_at, [], []

    def get_engine_info(self):  # pragma: no cover - unused
        raise NotImplementedError

    def add_request(self, request):
        if len(self.added) == self.fail_at:
            raise ValidationError("seed", "refused")
        self.added.append(request.request_id)

    def abort_requests(self, request_ids):
        self.aborted += request_ids

    def get_output(self):  # pragma: no cover - unused
        raise NotImplementedError

    def reset_prefix_cache(self):  # pragma: no cover - unused
        raise NotImplementedError

    def shutdown(self):
        pass


def test_add_requests_aborts_every_request_when_one_fails():
    client = FailingClient(fail_at=2)
    requests = [core_request(request_id=f"{i}_p-1") for i in range(4)]
    with pytest.raises(ValidationError, match="seed: refused"):
        client.add_requests(requests)
    assert client.added == ["0_p-1", "1_p-1"]
    assert client.aborted == [f"{i}_p-1" for i in range(4)]  # the ones sent, and the ones never sent (ignored)
    ok = FailingClient(fail_at=10)
    ok.add_requests(requests)
    assert ok.added == [r.request_id for r in requests] and ok.aborted == []


def test_a_parent_is_observed_once_with_its_n_and_its_longest_completion(tokenizer):
    """vLLM's request_params_n and request_max_num_generation_tokens: one observation per API request, when its
    last child finishes (an abort included), with n and the most tokens one completion generated."""
    from frontend_svc.stats import IterationStats

    processor = OutputProcessor(tokenizer)
    fan_out(processor, 3, RequestOutputKind.DELTA)
    processor.add_request("q-1", "q", SamplingParams(max_tokens=1), None, [1])  # n = 1: observed at its finish
    stats = IterationStats()
    processor.process_outputs([out(0, 5), out(1, 5), out(1, 6), out(2, 5)], iteration_stats=stats)
    processor.process_outputs([out(0, 6, FinishReason.LENGTH), out(1, 7, FinishReason.STOP)], iteration_stats=stats)
    processor.process_outputs([EngineCoreOutput("q-1", [9], finish_reason=FinishReason.LENGTH)], iteration_stats=stats)
    assert (stats.n_params_iter, stats.max_num_generation_tokens_iter) == ([1], [1])  # child 2 still runs
    processor.finish_aborted(["2_p-1"], stats)
    assert (stats.n_params_iter, stats.max_num_generation_tokens_iter) == ([1, 3], [1, 3])  # child 1: 3 tokens
