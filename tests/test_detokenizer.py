"""Incremental detokenization with the real tokenizers: streamed text equals the tokenizer's own full decode."""

from __future__ import annotations

import random

import pytest

from frontend_svc.detokenizer import SlowIncrementalDetokenizer
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import shared_tokenizer
from tests.frontend_helpers import delta_text, stream

TOKENIZERS = ["llama2", "gpt2", "builtin"]
HAND_PICKED = [
    "Hello, world! How are you?",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji split over bytes: 😀🚀👍🏽 and ❤️ done",
    "Words after punctuation:(a),b;c.d!e?f\"g'h",
    "Mixed 你好 and 😀 then text",
    "  leading spaces and\ttabs\nnewlines  ",
]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_tokenizer(request.param))


def random_sequences(tokenizer, count: int = 25, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def hand_picked_sequences(tokenizer) -> list[list[int]]:
    sequences = [tokenizer(text, add_special_tokens=False).input_ids for text in HAND_PICKED]
    # Added (special) tokens right next to text.
    eos = tokenizer.eos_token_id
    sequences.append(
        tokenizer("before", add_special_tokens=False).input_ids
        + [eos]
        + tokenizer("after", add_special_tokens=False).input_ids
    )
    return sequences


def run_kinds(tokenizer, ids, skip_special_tokens, prompt_ids=None):
    texts = {}
    for kind in RequestOutputKind:
        params = SamplingParams(output_kind=kind, skip_special_tokens=skip_special_tokens)
        outputs = stream(tokenizer, ids, params, prompt_ids).outputs
        texts[kind] = delta_text(outputs) if kind == RequestOutputKind.DELTA else outputs[-1].outputs[0].text
        if kind == RequestOutputKind.DELTA:
            deltas = [o.outputs[0].text for o in outputs]
            assert [o.outputs[0].token_ids for o in outputs] == [[i] for i in ids]
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
    return texts, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode(tokenizer, skip_special_tokens):
    for ids in random_sequences(tokenizer) + hand_picked_sequences(tokenizer):
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        texts, deltas = run_kinds(tokenizer, ids, skip_special_tokens)
        assert texts[RequestOutputKind.DELTA] == expected, ids
        assert texts[RequestOutputKind.CUMULATIVE] == expected
        assert texts[RequestOutputKind.FINAL_ONLY] == expected
        if "\ufffd" not in expected:
            assert not any("\ufffd" in d for d in deltas), deltas


def test_stream_after_a_prompt_continues_its_text(tokenizer):
    """With a prompt, the first output token gets its context: the text is what the prompt's decode grows by."""
    prompt_ids = tokenizer("The answer is").input_ids
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    for ids in hand_picked_sequences(tokenizer) + random_sequences(tokenizer, count=10, seed=1):
        full = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        texts, _ = run_kinds(tokenizer, ids, True, prompt_ids)
        assert texts[RequestOutputKind.DELTA] == full[len(prompt_text) :]


def test_no_replacement_character_mid_stream_for_split_characters(tokenizer):
    ids = tokenizer("😀🚀 東京", add_special_tokens=False).input_ids
    assert len(ids) > 3  # the characters really are split over several tokens
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    deltas = [o.outputs[0].text for o in stream(tokenizer, ids, params).outputs]
    assert "".join(deltas) == "😀🚀 東京"
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some tokens completed no character and so added no text


def test_invalid_bytes_at_the_end_are_flushed_once(tokenizer):
    ids = tokenizer("ok 🦜", add_special_tokens=False).input_ids  # a rare emoji: split over byte tokens
    truncated = ids[:-1]  # its last byte is missing
    expected = tokenizer.decode(truncated)
    assert expected.endswith("\ufffd")
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    outputs = stream(tokenizer, truncated, params).outputs
    assert delta_text(outputs) == expected
    assert "\ufffd" not in delta_text(outputs[:-1])  # held back until the end, then flushed in the last delta


def test_slow_algorithm_matches_full_decode(tokenizer):
    params = SamplingParams()
    for ids in hand_picked_sequences(tokenizer)[:-1] + random_sequences(tokenizer, count=10, seed=2):
        detokenizer = SlowIncrementalDetokenizer(tokenizer, params, [])
        detokenizer.update(ids, stop_terminated=False)
        detokenizer.finish()
        assert detokenizer.output_text == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_prompt_ending_in_split_characters_primes_cleanly(tokenizer):
    """Priming starts at a clean character boundary, so a prompt ending in emoji runs adds no U+FFFD."""
    for prompt in ("Hi 😀😀", "Thanks 👍👍", "Party 🎉🎉🎉", "表情😂😂", "flag: 🇫🇷"):
        prompt_ids = tokenizer(prompt).input_ids
        ids = tokenizer(" and then some text", add_special_tokens=False).input_ids
        full = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        texts, deltas = run_kinds(tokenizer, ids, True, prompt_ids)
        assert texts[RequestOutputKind.DELTA] == full[len(prompt_text) :], prompt
        assert not any("\ufffd" in d for d in deltas)


def test_flush_does_not_repeat_text_already_sent(tokenizer):
    """An emoji, then the first bytes of another, then the end: the emoji was sent when complete; the dangling
    bytes are flushed on their own (U+FFFD each), not as a re-decoded run that would repeat it."""
    prefix = tokenizer(" ok", add_special_tokens=False).input_ids
    emoji = tokenizer("😀", add_special_tokens=False).input_ids
    rocket = [i for i in tokenizer("🚀", add_special_tokens=False).input_ids if tokenizer.decode([i]).strip()]
    dangling = rocket[:-1]  # its bytes but the last (llama2's leading "▁" piece left out)
    assert dangling and "\ufffd" in tokenizer.decode(dangling)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    text = delta_text(stream(tokenizer, prefix + emoji + dangling, params).outputs)
    assert text == tokenizer.decode(prefix + emoji) + tokenizer.decode(dangling)
    assert text.count("😀") == 1
