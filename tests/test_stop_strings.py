"""Stop strings: the pure matcher (vLLM's table), then streamed through the OutputProcessor with a real tokenizer."""

from __future__ import annotations

import pytest

from frontend_svc.engine_types import FinishReason
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from frontend_svc.stop_strings import check_stop_strings
from tests.conftest import shared_tokenizer
from tests.frontend_helpers import delta_text, stream


@pytest.mark.parametrize(
    ("text", "new_chars", "stop", "include", "expected"),
    [
        (" The user is a", 5, ["a", "is"], False, ("is", 10)),
        (" The user is a", 5, ["is", "a"], False, ("is", 10)),
        (" The user is a", 5, ["a", "is"], True, ("is", 12)),
        ("abc", 3, ["abc", "b"], False, ("b", 1)),  # earliest completion wins
        ("ab", 2, ["ab", "b"], False, ("ab", 0)),  # same completion: list order
        ("ab", 2, ["b", "ab"], False, ("b", 1)),
        ("hello world.", 1, ["."], False, (".", 11)),
        ("hello world.", 1, ["."], True, (".", -1)),  # already ends there
        ("hello world.", 1, ["x"], False, None),
        ("hello world.", 0, ["."], False, None),
        ("hello world.", 1, [], False, None),
        ("a stop here", 1, ["stop"], False, None),  # completed before the new characters
    ],
)
def test_check_stop_strings(text, new_chars, stop, include, expected):
    assert check_stop_strings(text, new_chars, stop, include) == expected


@pytest.fixture(scope="module", params=["llama2", "gpt2", "builtin"])
def tokenizer(request):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_tokenizer(request.param))


TEXT = "The volunteer organization helped a group of people find homes. Then they rested."


@pytest.mark.parametrize(
    ("stop", "include", "expected_text"),
    [
        (["group of peo"], False, "The volunteer organization helped a "),  # spans several tokens
        (["group of peo"], True, "The volunteer organization helped a group of peo"),
        (["gani"], False, "The volunteer or"),  # inside a single token
        (["."], False, "The volunteer organization helped a group of people find homes"),
        (["."], True, "The volunteer organization helped a group of people find homes."),
        (["zzz", "helped"], False, "The volunteer organization "),
    ],
)
def test_stop_string_ends_the_request(tokenizer, stop, include, expected_text):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    for kind in RequestOutputKind:
        params = SamplingParams(stop=stop, include_stop_str_in_output=include, output_kind=kind, logprobs=0)
        result = stream(tokenizer, ids, params, with_logprobs=True)
        final = result.outputs[-1]
        completion = final.outputs[0]
        text = delta_text(result.outputs) if kind == RequestOutputKind.DELTA else completion.text
        assert text == expected_text
        assert final.finished and completion.finish_reason == "stop" and completion.stop_reason in stop
        assert result.reqs_to_abort == ["req-internal"]  # the core must be told
        # Tokens after the one that completed the stop string never arrive; the ids stop there.
        assert result.steps < len(ids)
        if kind != RequestOutputKind.DELTA:
            assert completion.token_ids == ids[: result.steps]
            assert len(completion.logprobs) == len(completion.token_ids)


def test_streamed_text_never_holds_a_stop_prefix(tokenizer):
    """Every streamed cumulative text is a prefix of the final text: nothing sent is ever taken back, so no delta
    carried the beginning of the stop string that completed later."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    for stop in (["group of people find"], ["homes. Then"], ["volunteer organization"]):
        params = SamplingParams(stop=stop, output_kind=RequestOutputKind.DELTA)
        outputs = stream(tokenizer, ids, params).outputs
        final = delta_text(outputs)
        assert stop[0] not in final and TEXT.startswith(final)
        sent = ""
        for output in outputs:
            sent += output.outputs[0].text
            assert final.startswith(sent)
            assert not any(sent.endswith(stop[0][:k]) and len(sent) > len(final) - k for k in range(1, len(stop[0])))


def test_stop_token_text_is_excluded_unless_included(tokenizer):
    """The core stopped on EOS (sent twice, as in vLLM's test): its text stays out unless asked for; ids keep it."""
    eos = tokenizer.eos_token_id
    ids = tokenizer("Hello there", add_special_tokens=False).input_ids + [eos, eos]
    eos_text = tokenizer.decode([eos], skip_special_tokens=False)
    text_only = tokenizer.decode(ids[:-2])
    for include, expected in ((False, text_only + eos_text), (True, text_only + eos_text + eos_text)):
        params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=False, logprobs=0)
        result = stream(tokenizer, ids, params, final_reason=FinishReason.STOP, with_logprobs=True)
        completion = result.outputs[-1].outputs[0]
        assert completion.text == expected
        assert completion.finish_reason == "stop" and completion.token_ids == ids
        assert len(completion.logprobs) == len(ids)
        assert result.reqs_to_abort == []  # the core stopped by itself
    params = SamplingParams(ignore_eos=True, skip_special_tokens=False)
    result = stream(tokenizer, ids, params, final_reason=FinishReason.LENGTH)
    assert result.outputs[-1].outputs[0].text == text_only + eos_text + eos_text
    assert result.outputs[-1].outputs[0].finish_reason == "length"


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = tokenizer("a. b. c. d. e.", add_special_tokens=False).input_ids
    early = stream(tokenizer, ids, SamplingParams(stop=["."])).outputs[-1].outputs[0]
    late = stream(tokenizer, ids, SamplingParams(stop=["."], min_tokens=4)).outputs[-1].outputs[0]
    assert early.text == "a"
    assert len(late.token_ids) > 4 and late.text.endswith(("b", " b", "c", " c")) and late.finish_reason == "stop"


def test_cumulative_outputs_only_grow_while_holding_back(tokenizer):
    """With a long stop string, the hold-back is longer than the text at first: outputs stay empty, then only
    grow; none is ever shorter than an earlier one or holds text the final output lacks."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    params = SamplingParams(stop=["find homes. Then they"], output_kind=RequestOutputKind.CUMULATIVE)
    outputs = stream(tokenizer, ids, params).outputs
    final = outputs[-1].outputs[0].text
    assert final == "The volunteer organization helped a group of people "
    texts = [o.outputs[0].text for o in outputs]
    assert texts[0] == ""
    assert all(final.startswith(t) for t in texts)
    assert all(len(a) <= len(b) for a, b in zip(texts, texts[1:], strict=False))


def test_stop_token_id_text_is_excluded_unless_included(tokenizer):
    """The core stopped on a stop_token_ids id that has text (" there"): the text leaves it out unless
    include_stop_str_in_output; either way the id is the last one sent and its logprob text is its own."""
    prompt = tokenizer("Say").input_ids
    hello = tokenizer(" Hello", add_special_tokens=False).input_ids
    there = tokenizer(" there", add_special_tokens=False).input_ids[-1:]
    ids = hello + there
    prompt_text, hello_text, full = (
        tokenizer.decode(i, skip_special_tokens=True) for i in (prompt, prompt + hello, prompt + ids)
    )
    hello_part, there_part = hello_text[len(prompt_text) :], full[len(hello_text) :]
    assert there_part == " there"
    for include, expected in ((False, hello_part), (True, hello_part + there_part)):
        for kind in RequestOutputKind:
            params = SamplingParams(
                stop_token_ids=there, include_stop_str_in_output=include, output_kind=kind, logprobs=0
            )
            result = stream(tokenizer, ids, params, prompt, final_reason=FinishReason.STOP, with_logprobs=True)
            completion = result.outputs[-1].outputs[0]
            text = delta_text(result.outputs) if kind == RequestOutputKind.DELTA else completion.text
            assert text == expected and result.reqs_to_abort == []
            if kind != RequestOutputKind.DELTA:
                assert completion.token_ids == ids
                assert completion.logprobs[-1][there[0]].decoded_token == there_part
