"""Incremental detokenization with the real tokenizers: streamed text equals an independent full decode, the ids
sent always decode to the text sent, and per-token texts add up to the text."""

from __future__ import annotations

import random

import pytest

from frontend_svc.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer
from frontend_svc.engine_types import FinishReason
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import shared_tokenizer
from tests.frontend_helpers import (
    PythonOnlyTokenizer,
    byte_token_ids,
    bytes_are_valid,
    delta_text,
    reference_output_text,
    reference_text,
    stream,
)

TOKENIZERS = ["llama2", "gpt2", "builtin"]
HAND_PICKED = [
    "Hello, world! How are you?",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji split over bytes: 😀🚀👍🏽 and ❤️ done",
    "Words after punctuation:(a),b;c.d!e?f\"g'h",
    "Mixed 你好 and 😀 then text",
    "  leading spaces and\ttabs\nnewlines  ",
]
DETOKENIZERS = {"fast": FastIncrementalDetokenizer, "slow": SlowIncrementalDetokenizer}


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_tokenizer(request.param))


def load(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_tokenizer(name))


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


def check_stream(tokenizer, ids, prompt_ids, skip_special_tokens=True, slow=False, candidates=()) -> str:
    """Stream ``ids`` in every output kind and check what must hold whatever the ids: DELTA, CUMULATIVE and
    FINAL_ONLY agree; at every streamed step the ids sent so far have, by the independent reference, exactly the
    text sent so far; every id goes out once, with its logprobs; the sampled tokens' logprob texts concatenate to
    the text (less skipped special tokens; a SentencePiece token that begins the text keeps the leading space the
    text drops, as vLLM's logprobs show it); no candidate's text ends in an unfinished character. Returns the
    text."""
    detokenizing = PythonOnlyTokenizer(tokenizer) if slow else tokenizer
    special_ids = set(tokenizer.all_special_ids) if skip_special_tokens else set()
    first = next((i for i in ids if i not in special_ids), None)
    begins_text = first is not None and not tokenizer.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
    first_token = tokenizer.convert_ids_to_tokens(first) if first is not None else ""
    lead = " " if begins_text and first_token.startswith("\u2581") else ""
    texts = {}
    for kind in RequestOutputKind:
        params = SamplingParams(output_kind=kind, skip_special_tokens=skip_special_tokens, logprobs=len(candidates))
        outputs = stream(detokenizing, ids, params, prompt_ids, with_logprobs=True, candidates=candidates).outputs
        sent_text, sent_ids, sent_logprobs = "", [], []
        for output in outputs:
            completion = output.outputs[0]
            if kind == RequestOutputKind.DELTA:
                sent_text, sent_ids = sent_text + completion.text, sent_ids + completion.token_ids
                sent_logprobs += completion.logprobs
            else:
                sent_text, sent_ids, sent_logprobs = completion.text, completion.token_ids, completion.logprobs
            assert len(sent_logprobs) == len(sent_ids)
            expected = reference_output_text(tokenizer, prompt_ids, sent_ids, skip_special_tokens)
            assert sent_text == expected, (kind, ids, sent_ids)
        if kind == RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
        assert sent_ids == ids and outputs[-1].finished
        texts[kind] = sent_text
        sampled = [lp[i].decoded_token for lp, i in zip(sent_logprobs, ids, strict=True) if i not in special_ids]
        assert "".join(sampled) == lead + sent_text, (ids, sampled)
        for lp, token_id in zip(sent_logprobs, ids, strict=True):
            assert all(not v.decoded_token.endswith("\ufffd") for k, v in lp.items() if k != token_id), lp
    assert texts[RequestOutputKind.DELTA] == texts[RequestOutputKind.CUMULATIVE] == texts[RequestOutputKind.FINAL_ONLY]
    return texts[RequestOutputKind.DELTA]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode(tokenizer, skip_special_tokens):
    for ids in random_sequences(tokenizer, count=12) + hand_picked_sequences(tokenizer):
        text = check_stream(tokenizer, ids, [], skip_special_tokens)
        assert text == reference_text(tokenizer, ids, skip_special_tokens)
        if bytes_are_valid(tokenizer, ids, skip_special_tokens):
            assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_stream_after_a_prompt_continues_its_text(tokenizer):
    """With a prompt, the first output token gets its context: the text is what the prompt's decode grows by."""
    prompt_ids = tokenizer("The answer is").input_ids
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    for ids in hand_picked_sequences(tokenizer) + random_sequences(tokenizer, count=6, seed=1):
        full = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        text = check_stream(tokenizer, ids, prompt_ids)
        if bytes_are_valid(tokenizer, prompt_ids + ids):
            assert text == full[len(prompt_text) :]


def test_no_replacement_character_mid_stream_for_split_characters(tokenizer):
    ids = tokenizer("😀🚀 東京", add_special_tokens=False).input_ids
    assert len(ids) > 3  # the characters really are split over several tokens
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    outputs = stream(tokenizer, ids, params).outputs
    deltas = [o.outputs[0].text for o in outputs]
    assert "".join(deltas) == "😀🚀 東京"
    assert all("\ufffd" not in d for d in deltas)
    # Tokens that complete no character add no text, and their ids wait for the one that does.
    assert ("", []) in [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]
    assert [i for o in outputs for i in o.outputs[0].token_ids] == ids


def test_invalid_bytes_at_the_end_are_flushed_once(tokenizer):
    ids = tokenizer("ok 🦜", add_special_tokens=False).input_ids  # a rare emoji: split over byte tokens
    truncated = ids[:-1]  # its last byte is missing
    # The parrot's first bytes but not all four: one maximal subpart, so one U+FFFD (llama2's own decode,
    # ByteFallback, gives one per byte token).
    expected = "ok \ufffd"
    assert reference_text(tokenizer, truncated) == expected
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    outputs = stream(tokenizer, truncated, params).outputs
    assert delta_text(outputs) == expected
    assert "\ufffd" not in delta_text(outputs[:-1])  # held back until the end, then flushed in the last delta


@pytest.mark.parametrize("cls", DETOKENIZERS.values(), ids=DETOKENIZERS)
def test_per_token_texts_add_up_to_the_text(tokenizer, cls):
    for ids in hand_picked_sequences(tokenizer)[:-1] + random_sequences(tokenizer, count=6, seed=2):
        detokenizer = cls(tokenizer, SamplingParams(), [])
        detokenizer.update(ids, stop_terminated=False)
        detokenizer.finish()
        assert detokenizer.output_text == reference_text(tokenizer, ids), ids
        assert "".join(detokenizer.token_texts) == detokenizer.output_text


def test_prompt_ending_in_split_characters_primes_cleanly(tokenizer):
    """Priming starts at a clean character boundary, so a prompt ending in emoji runs adds no U+FFFD."""
    for prompt in ("Hi 😀😀", "Thanks 👍👍", "Party 🎉🎉🎉", "表情😂😂", "flag: 🇫🇷"):
        prompt_ids = tokenizer(prompt).input_ids
        ids = tokenizer(" and then some text", add_special_tokens=False).input_ids
        full = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
        prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
        params = SamplingParams(output_kind=RequestOutputKind.DELTA)
        deltas = [o.outputs[0].text for o in stream(tokenizer, ids, params, prompt_ids).outputs]
        assert "".join(deltas) == full[len(prompt_text) :], prompt
        assert not any("\ufffd" in d for d in deltas)


def test_flush_does_not_repeat_text_already_sent(tokenizer):
    """An emoji, then the first bytes of another, then the end: the emoji was sent when complete; the dangling
    bytes are flushed on their own, not as a re-decoded run that would repeat it."""
    prefix = tokenizer(" ok", add_special_tokens=False).input_ids
    emoji = tokenizer("😀", add_special_tokens=False).input_ids
    rocket = [i for i in tokenizer("🚀", add_special_tokens=False).input_ids if tokenizer.decode([i]).strip()]
    dangling = rocket[:-1]  # its bytes but the last (llama2's leading "▁" piece left out)
    assert dangling and "\ufffd" in tokenizer.decode(dangling)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    text = delta_text(stream(tokenizer, prefix + emoji + dangling, params).outputs)
    # The missing last byte leaves one maximal subpart: one U+FFFD.
    assert text == tokenizer.decode(prefix + emoji) + "\ufffd"
    assert text.count("😀") == 1


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_text_goes_on_after_an_invalid_byte(slow):
    """Llama 2, prompt "Hi": a newline byte, a lead byte that nothing continues (invalid), "a", EOS. The bad byte
    shows once as U+FFFD and the text after it is kept; the next word keeps its leading space (the decoder
    restarts after the settled text, not from nothing)."""
    llama = load("llama2")
    assert llama.convert_ids_to_tokens([13, 243, 29874, 2]) == ["<0x0A>", "<0xF0>", "a", "</s>"]
    there = llama.convert_tokens_to_ids("▁there")
    hen = llama.convert_tokens_to_ids(["<0xE5>", "<0xBE>", "<0x88>"])  # "很" in byte tokens
    detokenizing = PythonOnlyTokenizer(llama) if slow else llama
    cases = [
        ([13, 243, 29874, 2], "\n\ufffda"),
        ([13, 243, 29874, there, 2], "\n\ufffda there"),
        ([*hen, 243, there, 2], "很\ufffd there"),  # the bad byte after a character of byte tokens
        ([243, *hen, 29874, 2], "\ufffd很a"),  # a good character after it, in the same run of byte tokens
        ([*hen[:2], there, 2], "\ufffd there"),  # a character cut short: one maximal subpart, one U+FFFD
    ]
    for ids, expected in cases:
        for kind in RequestOutputKind:
            outputs = stream(
                detokenizing, ids, SamplingParams(output_kind=kind), [1, 6324], final_reason=FinishReason.STOP
            ).outputs
            text = delta_text(outputs) if kind == RequestOutputKind.DELTA else outputs[-1].outputs[0].text
            assert text == expected, kind


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_word_after_an_invalid_byte_keeps_its_space_with_no_text_before(slow):
    """Llama 2 with no prompt text before the output (no prompt, BOS alone): the bad bytes show as U+FFFD and the
    next word keeps its leading space. SentencePiece strips only the space of the text's first token (the "▁" in
    the second case); the decoder restarting after the bad bytes had no text to start from."""
    llama = load("llama2")
    f0, e5, be, space, there = llama.convert_tokens_to_ids(["<0xF0>", "<0xE5>", "<0xBE>", "▁", "▁there"])
    detokenizing = PythonOnlyTokenizer(llama) if slow else llama
    cases = [([f0, there], "\ufffd there"), ([space, f0, there], "\ufffd there"), ([e5, be, there], "\ufffd there")]
    for prompt_ids in ([], [llama.bos_token_id]):
        for ids, expected in cases:
            assert llama.decode(prompt_ids + ids, skip_special_tokens=True).endswith(" there")
            for kind in RequestOutputKind:
                outputs = stream(detokenizing, ids, SamplingParams(output_kind=kind), prompt_ids).outputs
                text = delta_text(outputs) if kind == RequestOutputKind.DELTA else outputs[-1].outputs[0].text
                assert text == expected, (prompt_ids, ids, kind)
    # The same when the prompt's last text is its own unfinished character led by "▁" (a pepper cut short): the
    # character stays the prompt's; the bytes that break it and the word after are the output's.
    prompt_ids = llama("Say 很 🌶").input_ids[:-1]
    assert llama.convert_ids_to_tokens(prompt_ids[-4:]) == ["▁", "<0xF0>", "<0x9F>", "<0x8C>"]
    letter_a = llama.convert_tokens_to_ids("<0x41>")
    for ids, expected in [([letter_a, there], "A there"), ([there], " there")]:
        outputs = stream(detokenizing, ids, SamplingParams(output_kind=RequestOutputKind.DELTA), prompt_ids).outputs
        assert delta_text(outputs) == expected


@pytest.mark.parametrize("name", ["llama2", "gpt2"])
def test_characters_after_an_invalid_byte_stream_as_they_complete(name):
    """A stray lead byte, then characters spelled in byte tokens: each character goes out, with its ids, on the
    byte that completes it (the stray byte's U+FFFD with the first). Llama 2's ByteFallback decodes the whole run
    as U+FFFD per byte while it holds an invalid byte, so its stream used to wait for a token that is no byte."""
    tokenizer = load(name)
    ok = tokenizer(" ok", add_special_tokens=False).input_ids[-1:]
    ids = byte_token_ids(tokenizer, b"\xe2" + "很好".encode()) + ok
    outputs = stream(
        tokenizer, ids, SamplingParams(output_kind=RequestOutputKind.DELTA), tokenizer("Hi").input_ids
    ).outputs
    deltas = [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs]
    nothing = ("", [])
    assert deltas == [nothing] * 3 + [("\ufffd很", ids[:4])] + [nothing] * 2 + [("好", ids[4:7]), (" ok", ok)]


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_space_byte_at_the_start_before_invalid_bytes(slow):
    """Llama 2: a space spelled as a byte token, a bad byte, "a". At the start of the text SentencePiece drops the
    space (the text of the bad bytes is decoded in its context, not on its own); after "Hi" it stays."""
    llama = load("llama2")
    ids = llama.convert_tokens_to_ids(["<0x20>", "<0xF0>", "a"])
    detokenizing = PythonOnlyTokenizer(llama) if slow else llama
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    for prompt_ids, expected in [
        ([], "\ufffda"),
        ([llama.bos_token_id], "\ufffda"),
        (llama("Hi").input_ids, " \ufffda"),
    ]:
        assert delta_text(stream(detokenizing, ids, params, prompt_ids).outputs) == expected, prompt_ids


# vLLM's tests/tokenizers_/test_detokenize.py texts: CJK and Burmese split over byte tokens.
VLLM_TRUTH = ["Hello here, this is a simple test", "我很感谢你的热情", "ပုံပြင်လေးပြောပြပါ်"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_prompt_cut_anywhere_in_the_text(tokenizer, skip_special_tokens):
    """vLLM's test_decode_streaming, at every cut instead of half the text (BOS before and EOS after when special
    tokens are skipped), fast and slow: the output is what the full decode adds to the prompt's. A cut inside a
    character leaves it to the prompt, whose text has it as U+FFFD per maximal subpart (vLLM's test takes the
    prompt's length from its own decode: with ByteFallback, one U+FFFD per byte)."""
    paths = [tokenizer, PythonOnlyTokenizer(tokenizer)] if skip_special_tokens else [tokenizer]
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, skip_special_tokens=skip_special_tokens)
    for truth in VLLM_TRUTH:
        truth_ids = tokenizer(truth, add_special_tokens=False).input_ids
        for cut in range(len(truth_ids) + 1):
            prompt_ids, ids = truth_ids[:cut], truth_ids[cut:]
            if skip_special_tokens:
                prompt_ids, ids = [tokenizer.bos_token_id, *prompt_ids], [*ids, tokenizer.eos_token_id]
            full = reference_text(tokenizer, prompt_ids + ids, skip_special_tokens)
            expected = full[len(reference_text(tokenizer, prompt_ids, skip_special_tokens)) :]
            assert full == truth  # the reference agrees with the text itself
            for detokenizing in paths:
                assert delta_text(stream(detokenizing, ids, params, prompt_ids).outputs) == expected, (truth, cut)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_a_character_goes_on_across_ids_without_text(slow):
    """Llama 2: "很" in byte tokens with a skipped EOS, or an id outside the vocabulary, between its bytes. The
    tokenizer's decode reads nothing from those, so the character is whole (its own decode says so); with special
    tokens kept, EOS breaks it."""
    llama = load("llama2")
    e5, be, x88 = llama.convert_tokens_to_ids(["<0xE5>", "<0xBE>", "<0x88>"])
    eos, oov = llama.eos_token_id, len(llama) + 3
    assert llama.decode([e5, eos, be, x88], skip_special_tokens=True) == "很"
    detokenizing = PythonOnlyTokenizer(llama) if slow else llama
    cases = [([e5, eos, be, x88], True, "很"), ([e5, be, eos, x88], True, "很"), ([e5, oov, be, x88], True, "很")]
    if not slow:  # the slow path spaces special tokens apart
        cases.append(([e5, eos, be, x88], False, "\ufffd</s>\ufffd\ufffd"))
    for ids, skip, expected in cases:
        params = SamplingParams(output_kind=RequestOutputKind.DELTA, skip_special_tokens=skip)
        assert delta_text(stream(detokenizing, ids, params, [1, 6324]).outputs) == expected, (ids, skip)


def test_prompt_ending_inside_a_character_keeps_it():
    """gpt2, the ids of "Hello world 🌶 is spicy" cut inside the pepper's bytes: the prompt began the character,
    so it is the prompt's; the output is the text after it (vLLM's slow path; its fast path gives the output the
    completed pepper)."""
    gpt2 = load("gpt2")
    ids = gpt2("Hello world 🌶 is spicy").input_ids
    cuts = [k for k in range(1, len(ids)) if gpt2.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # the pepper is split over tokens
    for cut in cuts:
        for slow in (False, True):
            detokenizing = PythonOnlyTokenizer(gpt2) if slow else gpt2
            for kind in RequestOutputKind:
                params = SamplingParams(output_kind=kind, logprobs=0)
                outputs = stream(detokenizing, ids[cut:], params, ids[:cut], with_logprobs=True).outputs
                completion = outputs[-1].outputs[0]
                text = delta_text(outputs) if kind == RequestOutputKind.DELTA else completion.text
                assert text == " is spicy", (cut, slow, kind)
                if kind != RequestOutputKind.DELTA:
                    sampled = [lp[i].decoded_token for lp, i in zip(completion.logprobs, ids[cut:], strict=True)]
                    assert sampled == [""] * (len(ids) - cut - 2) + [" is", " spicy"]


def test_prompt_ending_inside_a_byte_fallback_character_keeps_it():
    """The same with Llama 2's byte fallback: "很" is three byte tokens; the prompt ends after the first two."""
    llama = load("llama2")
    ids = llama("Say 很 there").input_ids
    first = ids.index(llama.convert_tokens_to_ids("<0xE5>"))
    for slow in (False, True):
        detokenizing = PythonOnlyTokenizer(llama) if slow else llama
        params = SamplingParams(output_kind=RequestOutputKind.DELTA)
        assert delta_text(stream(detokenizing, ids[first + 2 :], params, ids[: first + 2]).outputs) == " there"
        # Cut before the character: the output has all of it.
        assert delta_text(stream(detokenizing, ids[first:], params, ids[:first]).outputs) == "很 there"


CHARACTERS = ["é", "很", "🌶", "€", "\n", "a", " ", "👍🏽"]


def fuzz_sequence(rng: random.Random, tokenizer, words: list[int]) -> list[int]:
    """Ordinary tokens mixed with valid characters spelled in byte tokens, characters cut short, stray bytes
    (invalid UTF-8), any token at all (with byte-level BPE, often part of a character) and EOS anywhere, inside a
    character's bytes too."""
    ids: list[int] = []
    for _ in range(rng.randint(2, 9)):
        roll = rng.random()
        if roll < 0.3:
            ids.append(rng.choice(words))
        elif roll < 0.55:
            ids += byte_token_ids(tokenizer, rng.choice(CHARACTERS).encode())
        elif roll < 0.8:
            data = rng.choice(CHARACTERS[:4]).encode()
            invalid = data[: rng.randrange(1, len(data))] if rng.random() < 0.6 else bytes([rng.randrange(0x80, 256)])
            ids += byte_token_ids(tokenizer, invalid)
        elif roll < 0.95:
            ids.append(rng.randrange(len(tokenizer)))
        else:
            ids.insert(rng.randint(0, len(ids)), tokenizer.eos_token_id)
    return ids


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_fuzz_byte_tokens_against_the_reference(tokenizer, slow):
    """Random byte-fallback / byte-level sequences, valid and invalid UTF-8, after clean prompts (none, a short
    text, BOS alone). The reference is ``reference_text``: all bytes decoded with U+FFFD per maximal subpart, the one
    behaviour a stream can have (it never takes back a character it sent) and the one byte-level decoders have.
    Where the bytes are valid UTF-8 it is also the tokenizer's own decode."""
    rng = random.Random(12)
    words = tokenizer(" hello world, there: new text", add_special_tokens=False).input_ids
    candidates = (
        *byte_token_ids(tokenizer, "é".encode()[:1]),  # begins a character: no text on its own
        *byte_token_ids(tokenizer, "很".encode()[-1:]),  # ends one: its text when the pending bytes fit
        words[1],
        tokenizer.eos_token_id,
    )
    prompts = [[], tokenizer("The answer is").input_ids, [tokenizer.bos_token_id]]
    for n in range(30):
        ids = fuzz_sequence(rng, tokenizer, words)
        prompt_ids = prompts[n % 3]
        skip = slow or n % 4 != 0  # the slow path spaces special tokens apart (spaces_between_special_tokens)
        text = check_stream(tokenizer, ids, prompt_ids, skip, slow, candidates)
        assert text == reference_output_text(tokenizer, prompt_ids, ids, skip)
        if bytes_are_valid(tokenizer, prompt_ids + ids, skip):
            full = tokenizer.decode(prompt_ids + ids, skip_special_tokens=skip)
            assert text == full[len(tokenizer.decode(prompt_ids, skip_special_tokens=skip)) :]


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_out_of_vocabulary_id_adds_no_text(tokenizer, slow):
    """An id past the tokenizer's vocabulary (a model's padded vocabulary) adds no text but stays in the ids
    (vLLM), and does not hold back the ids after it."""
    a, b = tokenizer(" a b", add_special_tokens=False).input_ids
    ids = [a, len(tokenizer) + 7, b]
    detokenizing = PythonOnlyTokenizer(tokenizer) if slow else tokenizer
    params = SamplingParams(output_kind=RequestOutputKind.DELTA)
    outputs = stream(detokenizing, ids, params, tokenizer("Hi").input_ids).outputs
    assert [(o.outputs[0].text, o.outputs[0].token_ids) for o in outputs] == [(" a", [a]), ("", [ids[1]]), (" b", [b])]


def wordpiece_tokenizer():
    """A tiny WordPiece tokenizer (BERT's decoder: tokens joined by spaces, "##" pieces glued on), built in
    memory: its decode puts a space before every added token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "##s": 5}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]")


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_spaces_between_special_tokens(slow):
    """Special tokens kept: by default each path spaces them as it does (the fast path as the tokenizer's decode,
    the slow path with a space around each added token). With ``spaces_between_special_tokens=False`` the slow
    path joins added tokens to the text, and the fast path drops the space between two added tokens in a row
    (vLLM's FastIncrementalDetokenizer); the logprob texts follow the text."""
    tokenizer = wordpiece_tokenizer()
    ids = [3, 1, 2, 4, 5]  # hello [CLS] [SEP] world ##s, after the prompt "hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hello [CLS] [SEP] worlds"
    expected = {
        (False, True): " hello [CLS] [SEP] worlds",
        (False, False): " hello [CLS][SEP] worlds",
        (True, True): " hello [CLS] [SEP] worlds",
        (True, False): " hello[CLS][SEP]worlds",
    }
    detokenizing = PythonOnlyTokenizer(tokenizer) if slow else tokenizer
    for spaces in (True, False):
        for kind in RequestOutputKind:
            params = SamplingParams(
                output_kind=kind, skip_special_tokens=False, spaces_between_special_tokens=spaces, logprobs=0
            )
            outputs = stream(detokenizing, ids, params, [3], with_logprobs=True).outputs
            completion = outputs[-1].outputs[0]
            text = delta_text(outputs) if kind == RequestOutputKind.DELTA else completion.text
            assert text == expected[slow, spaces], (spaces, kind)
            if kind == RequestOutputKind.FINAL_ONLY:
                sampled = [lp[i].decoded_token for lp, i in zip(completion.logprobs, ids, strict=True)]
                assert "".join(sampled) == text
