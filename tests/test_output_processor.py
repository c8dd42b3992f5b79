"""OutputProcessor, ParentRequest and RequestOutputCollector with fake engine-core outputs (vLLM's cases)."""

from __future__ import annotations

import asyncio

import pytest

from frontend_svc.engine_types import EngineCoreOutput, FinishReason, PositionLogprobs
from frontend_svc.output_processor import OutputProcessor, RequestOutputCollector
from frontend_svc.outputs import CompletionOutput, RequestOutput
from frontend_svc.parallel_sampling import ParentRequest
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from frontend_svc.stats import IterationStats
from tests.conftest import real_or_builtin, shared_tokenizer
from tests.frontend_helpers import reference_output_text, stream


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_or_builtin("gpt2"))


def core_output(request_id, token_id, finish=None, logprob=-0.25):
    return EngineCoreOutput(
        request_id, [token_id], new_logprobs=[PositionLogprobs([token_id, 7], [logprob, -0.1], 2)], finish_reason=finish
    )


def test_delta_outputs_one_token_each_and_processor_empties(tokenizer):
    ids = tokenizer(" one two three four", add_special_tokens=False).input_ids
    processor = OutputProcessor(tokenizer)
    processor.add_request("r-1", "r", SamplingParams(output_kind=RequestOutputKind.DELTA, logprobs=1), None, [1])
    outputs = []
    for i, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        outputs += processor.process_outputs([core_output("r-1", token_id, finish)]).request_outputs
    assert [o.outputs[0].token_ids for o in outputs] == [[i] for i in ids]
    assert "".join(o.outputs[0].text for o in outputs) == " one two three four"
    assert [len(o.outputs[0].logprobs) for o in outputs] == [1] * len(ids)
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]
    assert outputs[-1].outputs[0].cumulative_logprob == pytest.approx(-0.25 * len(ids))
    assert outputs[0].outputs[0].logprobs[0][7].rank == 1 and outputs[0].outputs[0].logprobs[0][ids[0]].rank == 2
    assert not processor.has_unfinished_requests() and not processor.external_req_ids


@pytest.mark.parametrize(
    ("engine_interval", "request_interval", "interval"),
    [
        (3, None, 3),  # the engine's
        (3, 2, 3),  # a request's below the engine's is raised to it
        (2, 4, 4),  # above it, kept
        (1, None, 1),
    ],
)
def test_stream_interval_sends_the_first_token_then_every_interval_and_the_rest_at_the_end(
    tokenizer, engine_interval, request_interval, interval
):
    """vLLM's stream_interval: DELTA outputs of 1 token, then of the interval (the larger of the engine's and the
    request's), then what is left at the end (10 tokens at interval 4: 1, 4, 4, 1); their texts and ids add up to
    the whole; CUMULATIVE at the same moments."""
    ids = tokenizer(" one two three four five six seven eight nine ten", add_special_tokens=False).input_ids
    chunks = [1]
    while sum(chunks) < len(ids):
        chunks.append(min(interval, len(ids) - sum(chunks)))
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        processor = OutputProcessor(tokenizer, stream_interval=engine_interval)
        params = SamplingParams(output_kind=kind, logprobs=1, stream_interval=request_interval)
        processor.add_request("r-1", "r", params, None, [1])
        outputs = []
        for i, token_id in enumerate(ids):
            finish = FinishReason.LENGTH if i == len(ids) - 1 else None
            outputs += processor.process_outputs([core_output("r-1", token_id, finish)]).request_outputs
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        if kind == RequestOutputKind.DELTA:
            assert lengths == chunks
            assert sum((o.outputs[0].token_ids for o in outputs), []) == ids
            assert "".join(o.outputs[0].text for o in outputs) == tokenizer.decode(ids)
            assert [len(o.outputs[0].logprobs) for o in outputs] == chunks
        else:
            assert lengths == [sum(chunks[: k + 1]) for k in range(len(chunks))]
        assert [o.finished for o in outputs] == [False] * (len(chunks) - 1) + [True]
        assert not processor.has_unfinished_requests()
    with pytest.raises(ValueError, match="stream_interval: must be an integer >= 1, got 0"):
        SamplingParams(stream_interval=0)


def test_logprob_token_text_keeps_leading_space():
    from transformers import AutoTokenizer

    llama = AutoTokenizer.from_pretrained(shared_tokenizer("llama2"))
    true_id = llama.convert_tokens_to_ids("▁true")
    processor = OutputProcessor(llama)
    prompt = llama("It is").input_ids
    processor.add_request("r-1", "r", SamplingParams(logprobs=1), None, prompt)
    out = processor.process_outputs([core_output("r-1", true_id, FinishReason.LENGTH)]).request_outputs[0]
    assert out.outputs[0].logprobs[0][true_id].decoded_token == " true"
    assert out.outputs[0].text == " true"


def test_abort_by_external_id_reaches_every_child_and_the_queue(tokenizer):
    processor = OutputProcessor(tokenizer)
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    params = SamplingParams(n=3, seed=1)
    parent = ParentRequest("p-1", "p", params)
    for i in range(3):
        child_id, child_params = parent.get_child_info(i)
        processor.add_request(child_id, "p", child_params, None, [1], parent, i, queue)
    processor.add_request("other-1", "other", SamplingParams(), None, [1])
    assert sorted(processor.abort_requests(["p"])) == ["0_p-1", "1_p-1", "2_p-1"]
    final = queue.get_nowait()
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert list(processor.request_states) == ["other-1"]
    assert processor.abort_requests(["other-1"], internal=True) == ["other-1"]
    assert processor.abort_requests(["unknown"]) == []


def test_parent_final_only_releases_all_n_together(tokenizer):
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    parent = ParentRequest("p-1", "p", params)
    for i in range(2):
        child_id, child_params = parent.get_child_info(i)
        processor.add_request(child_id, "p", child_params, None, [1], parent, i)
    first = processor.process_outputs([core_output("0_p-1", 10, FinishReason.LENGTH), core_output("1_p-1", 11)])
    assert first.request_outputs == []
    second = processor.process_outputs([core_output("1_p-1", 12, FinishReason.LENGTH)]).request_outputs
    assert len(second) == 1 and second[0].finished and second[0].request_id == "p"
    assert sorted((c.index, c.token_ids) for c in second[0].outputs) == [(0, [10]), (1, [11, 12])]


def test_parent_streaming_forwards_each_child_and_finishes_last(tokenizer):
    processor = OutputProcessor(tokenizer)
    parent = ParentRequest("p-1", "p", SamplingParams(n=2, output_kind=RequestOutputKind.DELTA))
    for i in range(2):
        child_id, child_params = parent.get_child_info(i)
        processor.add_request(child_id, "p", child_params, None, [1], parent, i)
    out = processor.process_outputs([core_output("0_p-1", 10, FinishReason.LENGTH), core_output("1_p-1", 11)])
    assert [(o.outputs[0].index, o.finished) for o in out.request_outputs] == [(0, False), (1, False)]
    out = processor.process_outputs([core_output("1_p-1", 12, FinishReason.LENGTH)])
    assert [(o.outputs[0].index, o.finished) for o in out.request_outputs] == [(1, True)]


def make_output(index, text, ids, finished=False, logprobs=None):
    completion = CompletionOutput(index, text, ids, None, logprobs, "length" if finished else None)
    return RequestOutput("r", None, [1], None, [completion], finished)


def test_collector_merges_deltas_and_replaces_cumulative():
    async def scenario():
        delta = RequestOutputCollector(RequestOutputKind.DELTA)
        delta.put(make_output(0, "a", [1], logprobs=[{}]))
        delta.put(make_output(0, "a", [2], finished=True, logprobs=[{}]))
        merged = await delta.get()
        assert (merged.outputs[0].text, merged.outputs[0].token_ids, merged.finished) == ("aa", [1, 2], True)
        assert len(merged.outputs[0].logprobs) == 2

        cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        cumulative.put(make_output(0, "x", [1]))
        cumulative.put(make_output(1, "y", [2]))
        cumulative.put(make_output(0, "xz", [1, 3]))
        merged = await cumulative.get()
        assert sorted((c.index, c.text) for c in merged.outputs) == [(0, "xz"), (1, "y")]
        assert cumulative.get_nowait() is None

        failing = RequestOutputCollector(RequestOutputKind.DELTA)
        failing.put(RuntimeError("engine died"))
        failing.put(make_output(0, "late", [9]))
        with pytest.raises(RuntimeError, match="engine died"):
            await failing.get()

    asyncio.run(scenario())


def test_delta_without_new_ids_has_empty_logprobs(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add_request(
        "r-1", "r", SamplingParams(output_kind=RequestOutputKind.DELTA, logprobs=1, prompt_logprobs=1), None, [1, 2]
    )
    first = EngineCoreOutput("r-1", [], new_prompt_logprobs=[PositionLogprobs([2, 5], [-1.0, -0.5], 3)])
    out = processor.process_outputs([first]).request_outputs[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].logprobs == []
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1][2].logprob == -1.0
    out = processor.process_outputs([core_output("r-1", 10, FinishReason.LENGTH)]).request_outputs[0]
    assert out.prompt_logprobs == []  # DELTA sends prompt logprobs once (vLLM: [] after, None when not asked for)


def test_abort_ends_every_child_through_the_parent(tokenizer):
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        processor = OutputProcessor(tokenizer)
        queue = RequestOutputCollector(kind)
        parent = ParentRequest("p-1", "p", SamplingParams(n=3, output_kind=kind))
        for i in range(3):
            child_id, child_params = parent.get_child_info(i)
            processor.add_request(child_id, "p", child_params, None, [1], parent, i, queue)
        processor.process_outputs([core_output("0_p-1", 10, FinishReason.LENGTH)])
        processor.process_outputs([core_output("1_p-1", 11), core_output("2_p-1", 12)])
        queue.get_nowait()  # drain what streamed so far
        # The parent's internal id covers the children still running.
        assert sorted(processor.abort_requests(["p-1"], internal=True)) == ["1_p-1", "2_p-1"]
        final = queue.get_nowait()
        assert final.finished
        reasons = {c.index: c.finish_reason for c in final.outputs}
        if kind == RequestOutputKind.FINAL_ONLY:
            assert reasons == {0: "length", 1: "abort", 2: "abort"}
        else:
            assert reasons == {1: "abort", 2: "abort"}
        assert not processor.request_states and not processor.parent_requests and not processor.external_req_ids


def test_a_child_failed_by_the_core_fails_the_parent_with_internal(tokenizer):
    """n = 3: the core ends one child with INTERNAL (a failed step). The stream gets InternalError with the
    core's message, which the public API sends as INTERNAL; the two siblings are handed back for the core to
    abort, and nothing of the parent stays."""
    from frontend_svc.errors import InternalError
    from splitserve.base.grpc_status import grpc_status_code as status_code

    processor = OutputProcessor(tokenizer)
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    parent = ParentRequest("p-1", "p", SamplingParams(n=3, output_kind=RequestOutputKind.DELTA))
    for i in range(3):
        child_id, child_params = parent.get_child_info(i)
        processor.add_request(child_id, "p", child_params, None, [1], parent, i, queue)
    message = "the engine core failed while running this request: RuntimeError: boom"
    failed = EngineCoreOutput("1_p-1", [], finish_reason=FinishReason.ERROR, error=InternalError(message))
    result = processor.process_outputs([failed])
    assert sorted(result.reqs_to_abort) == ["0_p-1", "2_p-1"]
    with pytest.raises(InternalError) as info:
        queue.get_nowait()
    assert str(info.value) == message and status_code(info.value).name == "INTERNAL"
    assert not processor.request_states and not processor.parent_requests and not processor.external_req_ids


def load(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_tokenizer(name))


def sampled_texts(completion: CompletionOutput) -> list[str]:
    return [lp[token_id].decoded_token for lp, token_id in zip(completion.logprobs, completion.token_ids, strict=True)]


def test_sampled_logprob_texts_add_up_to_the_text():
    """Llama 2, prompt "Say", output "▁ <0xE5> <0xBE> <0x88> ▁there": a byte that leaves "很" unfinished has
    text "", the byte that completes it the whole character (vLLM), so the texts concatenate to the output."""
    llama = load("llama2")
    ids = llama.convert_tokens_to_ids(["▁", "<0xE5>", "<0xBE>", "<0x88>", "▁there"])
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=0)
    completion = stream(llama, ids, params, llama("Say").input_ids, with_logprobs=True).outputs[-1].outputs[0]
    assert sampled_texts(completion) == [" ", "", "", "很", " there"]
    assert completion.text == " 很 there" == "".join(sampled_texts(completion))


def test_candidate_texts_in_the_sampled_context():
    """Each top-k candidate is decoded on its own after the sampled tokens, the bytes of an unfinished character
    included: one that completes it gets the whole character, one that leaves it unfinished "" (never U+FFFD),
    one that breaks it shows the broken bytes as one U+FFFD then its text, as the stream would."""
    llama = load("llama2")
    e5, be, bf, there, here = llama.convert_tokens_to_ids(["<0xE5>", "<0xBE>", "<0xBF>", "▁there", "▁here"])
    processor = OutputProcessor(llama)
    processor.add_request("r-1", "r", SamplingParams(logprobs=3), None, llama("Say").input_ids)
    processor.process_outputs([EngineCoreOutput("r-1", [e5], new_logprobs=[PositionLogprobs([e5], [-1.0], 1)])])
    processor.process_outputs([EngineCoreOutput("r-1", [be], new_logprobs=[PositionLogprobs([be], [-1.0], 1)])])
    # Sampled so far: E5 BE, an unfinished character. Candidates for the next position:
    position = PositionLogprobs([there, bf, e5, here], [-1.0, -2.0, -3.0, -4.0], 1)
    last = EngineCoreOutput("r-1", [there], new_logprobs=[position], finish_reason=FinishReason.LENGTH)
    completion = processor.process_outputs([last]).request_outputs[0].outputs[0]
    texts = {token_id: entry.decoded_token for token_id, entry in completion.logprobs[2].items()}
    assert texts == {there: "\ufffd there", bf: bytes([0xE5, 0xBE, 0xBF]).decode(), e5: "", here: "\ufffd here"}
    assert completion.text == "\ufffd there"  # the sampled token's text is what it did to the text

    gpt2 = load("gpt2")
    comma, world = gpt2(", world", add_special_tokens=False).input_ids
    assert gpt2.convert_ids_to_tokens(6552) == "âĶ"  # the first two bytes of a three-byte character (E2 94)
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=2)
    outputs = stream(gpt2, [comma, world], params, gpt2("Hello").input_ids, with_logprobs=True, candidates=(6552,))
    outputs = outputs.outputs
    after_comma = outputs[-1].outputs[0].logprobs[1]
    assert after_comma[6552].decoded_token == "" and after_comma[world].decoded_token == " world"


def test_prompt_logprob_texts_in_the_context_of_the_prompt():
    llama = load("llama2")
    prompt = llama("Say 很 there").input_ids
    assert llama.convert_ids_to_tokens(prompt[3:6]) == ["<0xE5>", "<0xBE>", "<0x88>"]
    processor = OutputProcessor(llama)
    processor.add_request("r-1", "r", SamplingParams(prompt_logprobs=1), None, prompt)
    e5 = prompt[3]
    positions = [PositionLogprobs([token_id, e5], [-1.0, -2.0], 1) for token_id in prompt[1:]]
    first = EngineCoreOutput("r-1", [], new_prompt_logprobs=positions)
    out = processor.process_outputs([first, core_output("r-1", 13, FinishReason.LENGTH)]).request_outputs[0]
    texts = [d[token_id].decoded_token for d, token_id in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)]
    # "▁Say" begins the text, which drops its leading space; its logprob keeps it (vLLM's " Say").
    assert texts == [" Say", " ", "", "", "很", " there"]
    assert "".join(texts) == " " + llama.decode(prompt, skip_special_tokens=True)
    # The lead byte as a candidate after "很"'s first byte(s) leaves a character unfinished.
    assert out.prompt_logprobs[4][e5].decoded_token == ""


def test_logprob_texts_after_an_invalid_byte_with_no_text_before():
    """Llama 2, prompt BOS alone: a bad lead byte then "▁there". The word keeps its leading space, sampled and as a
    candidate (at the start of the text too, as vLLM's logprobs show it), and in the prompt logprobs of the same
    ids."""
    llama = load("llama2")
    f0, there = llama.convert_tokens_to_ids(["<0xF0>", "▁there"])
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=1)
    outputs = stream(llama, [f0, there], params, [llama.bos_token_id], with_logprobs=True, candidates=(there,))
    completion = outputs.outputs[-1].outputs[0]
    assert completion.text == "\ufffd there" == "".join(sampled_texts(completion))
    assert completion.logprobs[1][there].decoded_token == "\ufffd there"  # sampled
    assert completion.logprobs[0][there].decoded_token == " there"  # as a candidate for the first token: the start

    prompt = [llama.bos_token_id, f0, there]
    processor = OutputProcessor(llama)
    processor.add_request("r-1", "r", SamplingParams(prompt_logprobs=1), None, prompt)
    positions = [PositionLogprobs([token_id, there], [-1.0, -2.0], 1) for token_id in prompt[1:]]
    first = EngineCoreOutput("r-1", [], new_prompt_logprobs=positions)
    out = processor.process_outputs([first, core_output("r-1", 13, FinishReason.LENGTH)]).request_outputs[0]
    texts = [{token_id: lp.decoded_token for token_id, lp in position.items()} for position in out.prompt_logprobs[1:]]
    assert texts == [{f0: "", there: " there"}, {there: "\ufffd there"}]


def test_logprob_texts_at_the_start_of_the_text_keep_sentencepieces_leading_space():
    """Llama 2 after BOS alone: each candidate shows its own spaces, as vLLM's logprobs do (its tokenizer tests'
    leading-space and whitespace-run cases), so "▁Hello" and "Hello" stay two entries; the text itself drops the
    first leading space, as the tokenizer's decode does."""
    llama = load("llama2")
    tokens = ["\u2581Hello", "Hello", "\u2581", "\u2581\u2581", "\u2581\u2581\u2581"]
    ids = llama.convert_tokens_to_ids(tokens)
    assert llama.unk_token_id not in ids
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=len(ids))
    outputs = stream(llama, ids[:1], params, [llama.bos_token_id], with_logprobs=True, candidates=tuple(ids))
    completion = outputs.outputs[-1].outputs[0]
    assert completion.text == llama.decode(ids[:1]) == "Hello"
    texts = [completion.logprobs[0][token_id].decoded_token for token_id in ids]
    assert texts == [" Hello", "Hello", " ", "  ", "   "]
    assert len(set(texts)) == len(ids)


def test_logprob_texts_after_a_prompt_that_ends_inside_a_character():
    """The pepper begun in the prompt is the prompt's: the token that completes it, sampled or as a candidate,
    adds no text; a candidate that breaks it adds its own."""
    gpt2 = load("gpt2")
    ids = gpt2("Hello world 🌶 is spicy").input_ids
    cut = 4
    assert gpt2.decode(ids[:cut]).endswith("\ufffd") and not gpt2.decode(ids[: cut + 1]).endswith("\ufffd")
    is_id = ids[cut + 1]
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=1)
    outputs = stream(gpt2, ids[cut:], params, ids[:cut], with_logprobs=True, candidates=(is_id,)).outputs
    first = outputs[-1].outputs[0].logprobs[0]
    assert first[ids[cut]].decoded_token == ""
    assert first[is_id].decoded_token == " is"


def test_stop_token_logprob_text_is_its_own():
    """A stop token the text leaves out still has its text as a logprob; the other sampled texts make the text."""
    gpt2 = load("gpt2")
    ids = gpt2(" Hi there", add_special_tokens=False).input_ids + [gpt2.eos_token_id]
    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=0)
    completion = stream(gpt2, ids, params, [], final_reason=FinishReason.STOP, with_logprobs=True).outputs[0]
    completion = completion.outputs[0]
    assert completion.text == " Hi there" and completion.token_ids == ids
    assert sampled_texts(completion) == [" Hi", " there", "<|endoftext|>"]


def assert_ids_match_text(tokenizer, prompt_ids, outputs, delta):
    """At every output, the ids sent so far have exactly the text sent so far, and a logprob each."""
    sent_text, sent_ids, num_logprobs = "", [], 0
    for output in outputs:
        completion = output.outputs[0]
        if delta:
            sent_text, sent_ids = sent_text + completion.text, sent_ids + completion.token_ids
            num_logprobs += len(completion.logprobs)
        else:
            sent_text, sent_ids, num_logprobs = completion.text, completion.token_ids, len(completion.logprobs)
        if not output.finished:
            assert sent_text == reference_output_text(tokenizer, prompt_ids, sent_ids)
        assert num_logprobs == len(sent_ids)
    return sent_text, sent_ids


def test_ids_are_held_back_with_their_text():
    """gpt2, stop ["stop"]: " Hello" alone is held back (3 characters of it could begin "stop"), and its id with
    it, so the first delta is empty; later each output's ids decode to its text. The same for ids of an
    unfinished character. At the end everything goes out."""
    gpt2 = load("gpt2")
    hello = gpt2(" Hello", add_special_tokens=False).input_ids
    assert hello == [18435]
    ids = hello + gpt2(" world 🌶 stays", add_special_tokens=False).input_ids
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE):
        params = SamplingParams(output_kind=kind, stop=["stop"], logprobs=0)
        outputs = stream(gpt2, ids, params, [], with_logprobs=True).outputs
        assert (outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids) == ("", [])
        text, sent_ids = assert_ids_match_text(gpt2, [], outputs, kind == RequestOutputKind.DELTA)
        assert (text, sent_ids) == (" Hello world 🌶 stays", ids)
    # Stopped by a stop string: the held ids and text go out at the end, text cut before "stop".
    ids = gpt2(" Hello, stop here", add_special_tokens=False).input_ids
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, stop=["stop"], logprobs=0)
    result = stream(gpt2, ids, params, [], with_logprobs=True)
    text, sent_ids = assert_ids_match_text(gpt2, [], result.outputs, delta=True)
    assert text == " Hello, " and sent_ids == ids[: result.steps] and result.outputs[-1].finished


def test_held_ids_through_n_children_and_the_collector():
    """n = 2 with a stop-string hold-back: each child's deltas, merged in the collector as a slow consumer sees
    them, still pair ids with their text; every id is counted once (what usage.completion_tokens sums)."""
    gpt2 = load("gpt2")
    ids = [gpt2(text, add_special_tokens=False).input_ids for text in (" one two three", " four 🌶 five")]

    async def scenario():
        processor = OutputProcessor(gpt2)
        queue = RequestOutputCollector(RequestOutputKind.DELTA)
        params = SamplingParams(n=2, output_kind=RequestOutputKind.DELTA, stop=["xyz"], logprobs=0)
        parent = ParentRequest("p-1", "p", params)
        for i in range(2):
            child_id, child_params = parent.get_child_info(i)
            processor.add_request(child_id, "p", child_params, None, [], parent, i, queue)
        merged: dict[int, CompletionOutput] = {}
        for step in range(max(map(len, ids))):
            outputs = []
            for i, child_ids in enumerate(ids):
                if step < len(child_ids):
                    finish = FinishReason.LENGTH if step == len(child_ids) - 1 else None
                    outputs.append(core_output(f"{i}_p-1", child_ids[step], finish))
            processor.process_outputs(outputs)
            if step % 2:  # the consumer takes every other step: outputs in between are merged
                for completion in (await queue.get()).outputs:
                    if completion.index in merged:
                        merged[completion.index].text += completion.text
                        merged[completion.index].token_ids += completion.token_ids
                    else:
                        merged[completion.index] = completion
        final = queue.get_nowait()
        assert final is not None and final.finished
        for completion in final.outputs:
            merged[completion.index].text += completion.text
            merged[completion.index].token_ids += completion.token_ids
        for i, child_ids in enumerate(ids):
            assert merged[i].token_ids == child_ids
            assert merged[i].text == gpt2.decode(child_ids)

    asyncio.run(scenario())


def test_abort_releases_held_ids_and_their_text():
    llama = load("llama2")
    e5, be = llama.convert_tokens_to_ids(["<0xE5>", "<0xBE>"])
    processor = OutputProcessor(llama)
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, logprobs=0)
    processor.add_request("r-1", "r", params, None, llama("Say").input_ids, queue=queue)
    processor.process_outputs([core_output("r-1", e5), core_output("r-1", be)])
    held = queue.get_nowait()
    assert (held.outputs[0].text, held.outputs[0].token_ids) == ("", [])  # an unfinished character
    processor.abort_requests(["r"])
    final = queue.get_nowait()
    # The character never finished: its bytes are one maximal subpart, one U+FFFD.
    assert final.finished and (final.outputs[0].text, final.outputs[0].token_ids) == ("\ufffd", [e5, be])
    assert len(final.outputs[0].logprobs) == 2


def test_detokenize_false_streams_ids_without_text(tokenizer):
    """detokenize=False (vLLM): every id goes out on its step, even one of an unfinished character; the text stays
    empty and every logprob's decoded_token, sampled, top-k or prompt, is None."""
    ids = tokenizer(" a 🌶 b", add_special_tokens=False).input_ids
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, detokenize=False, logprobs=1, prompt_logprobs=1)
    processor.add_request("r-1", "r", params, None, [1, 2])
    prompt_positions = [PositionLogprobs([2, 5], [-1.0, -0.5], 3)]
    outputs = []
    for i, token_id in enumerate(ids):
        output = core_output("r-1", token_id, FinishReason.LENGTH if i == len(ids) - 1 else None)
        output.new_prompt_logprobs = prompt_positions if i == 0 else None
        outputs += processor.process_outputs([output]).request_outputs
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs] == [("", [i]) for i in ids]
    entries = [lp for o in outputs for position in o.outputs[0].logprobs for lp in position.values()]
    entries += list(outputs[0].prompt_logprobs[1].values())
    assert len(entries) == 2 * len(ids) + 2 and all(lp.decoded_token is None for lp in entries)


def test_a_final_output_without_ids_releases_what_was_held():
    """The core ends the request with no new id (as after a preemption or an engine-side end): the text and ids
    the stop-string hold-back and an unfinished character kept go out in that last output, in every kind."""
    gpt2 = load("gpt2")
    ids = gpt2(" Hello world 🌶", add_special_tokens=False).input_ids[:-1]  # the pepper's last byte never comes
    for kind in RequestOutputKind:
        processor = OutputProcessor(gpt2)
        processor.add_request("r-1", "r", SamplingParams(output_kind=kind, stop=["xyzzy"], logprobs=0), None, [])
        outputs = []
        for token_id in ids:
            outputs += processor.process_outputs([core_output("r-1", token_id)]).request_outputs
        last = EngineCoreOutput("r-1", [], finish_reason=FinishReason.LENGTH)
        outputs += processor.process_outputs([last]).request_outputs
        final = outputs[-1].outputs[0]
        assert outputs[-1].finished and final.finish_reason == "length"
        if kind == RequestOutputKind.DELTA:
            assert "".join(o.outputs[0].text for o in outputs) == " Hello world \ufffd"
            assert [i for o in outputs for i in o.outputs[0].token_ids] == ids and final.token_ids
        else:
            assert (final.text, final.token_ids, len(final.logprobs)) == (" Hello world \ufffd", ids, len(ids))


def test_without_a_queue_a_failed_request_comes_back_as_its_error(tokenizer):
    """LLMEngine's path (no queue): the error is returned with the request it names, not an output with finish
    reason "error" and no message. n = 2, the core fails child 0 with INTERNAL: one InternalError naming "p", the
    sibling handed back for the core to abort, nothing left. A request refused as sent (INVALID_ARGUMENT, from a
    remote core) gives the ValidationError naming the field."""
    from frontend_svc.errors import InternalError, ValidationError

    processor = OutputProcessor(tokenizer)
    parent = ParentRequest("p-1", "p", SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY))
    for i in range(2):
        child_id, child_params = parent.get_child_info(i)
        processor.add_request(child_id, "p", child_params, None, [1], parent, i)
    processor.add_request("q-1", "q", SamplingParams(), None, [1])
    message = "the engine core failed while running this request: RuntimeError: boom"
    refusal = ValidationError("top_p", "must be in (0, 1]")
    iteration_stats = IterationStats()
    result = processor.process_outputs(
        [
            EngineCoreOutput("0_p-1", [], finish_reason=FinishReason.ERROR, error=InternalError(message)),
            # aborted already
            EngineCoreOutput("1_p-1", [], finish_reason=FinishReason.ERROR, error=InternalError(message)),
            EngineCoreOutput("q-1", [], finish_reason=FinishReason.ERROR, error=refusal),
        ],
        iteration_stats=iteration_stats,
    )
    # The failed children count as finished with error; the refused request (a client's error, as vLLM's input
    # checks refuse it) does not count.
    assert [stats.finish_reason for stats in iteration_stats.finished_requests] == ["error", "error"]
    assert result.request_outputs == [] and result.reqs_to_abort == ["1_p-1"]
    internal, refused = result.errors
    assert isinstance(internal, InternalError) and (str(internal), internal.request_id) == (message, "p")
    assert isinstance(refused, ValidationError) and (refused.field, refused.request_id) == ("top_p", "q")
    assert not processor.request_states and not processor.parent_requests and not processor.external_req_ids


def test_a_sampled_token_among_the_top_k_gets_its_place_as_rank(tokenizer):
    """Three tokens tie; the core counts the sampled one's vocabulary rank at the worst tie (3), and it is also
    the top-k's first: vLLM's dict (ranks [vocabulary rank, 1..k], a repeated id's later entry winning) gives it
    rank 1, the next tie rank 2. Outside the top-k the vocabulary rank stays."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("r-1", "r", SamplingParams(logprobs=2), None, [1, 2])
    tied = PositionLogprobs([5, 5, 9], [-1.1, -1.1, -1.1], 3)
    outside = PositionLogprobs([6, 5, 9], [-4.0, -1.1, -1.1], 7)
    processor.process_outputs([EngineCoreOutput("r-1", [5], new_logprobs=[tied])])
    out = processor.process_outputs(
        [EngineCoreOutput("r-1", [6], new_logprobs=[outside], finish_reason=FinishReason.LENGTH)]
    )
    first, second = out.request_outputs[0].outputs[0].logprobs
    assert {token_id: lp.rank for token_id, lp in first.items()} == {5: 1, 9: 2}
    assert {token_id: lp.rank for token_id, lp in second.items()} == {6: 7, 5: 1, 9: 2}
