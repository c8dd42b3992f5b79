"""SamplingParams: vLLM's defaults, normalization, and every validation rule (notes §2), each refused with the
field named."""

from __future__ import annotations

import math

import pytest

from frontend_svc import RequestOutputKind, SamplingParams, ValidationError


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 0.0, 16, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.output_kind == RequestOutputKind.CUMULATIVE


def test_normalization():
    p = SamplingParams(
        seed=-1,
        stop="###",
        stop_token_ids=[5, 7, 5],
        logprobs=True,
        prompt_logprobs=True,
        logit_bias={"12": 250, 3: -1000.0},
        output_kind=1,
    )
    assert p.seed is None and p.stop == ["###"] and p.stop_token_ids == [5, 7]
    assert SamplingParams(allowed_token_ids=(9, 4, 9, 4, 1)).allowed_token_ids == [9, 4, 1]  # each once, in order
    assert p.logprobs == 1 and p.prompt_logprobs == 1
    assert p.logit_bias == {12: 250.0, 3: -1000.0}  # as given, as vLLM's SamplingParams (only its server clamps)
    assert SamplingParams(logit_bias={4: -math.inf}).logit_bias == {4: -math.inf}  # a ban
    assert p.output_kind == RequestOutputKind.DELTA
    assert SamplingParams(temperature=0.001).temperature == 0.01  # raised to the minimum, as vLLM
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.3)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["ab"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_children_get_n_1_and_offset_seeds():
    parent = SamplingParams(n=3, seed=10)
    assert [(c.n, c.seed) for c in (parent.child(i) for i in range(3))] == [(1, 10), (1, 11), (1, 12)]
    assert SamplingParams(n=2).child(1).seed is None
    assert parent.n == 3  # untouched


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 16385}, "n"),
        ({"n": 2.0}, "n"),
        ({"n": 2, "temperature": 0.0}, "n"),  # greedy with n > 1
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": "7"}, "seed"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -5}, "prompt_logprobs"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"stop": [3]}, "stop[0]"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
        ({"stop": [f"s{i}" for i in range(1025)]}, "stop"),  # each is matched on every new text
        # Wrong types are refused naming the field (they raised TypeError).
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop_token_ids": [[1]]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [1, True]}, "stop_token_ids[1]"),
        ({"allowed_token_ids": 5}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, 3, "a"]}, "allowed_token_ids[2]"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, None]}, "allowed_token_ids[1]"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"output_kind": 7}, "output_kind"),
    ],
)
def test_refused_values_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"logprobs": 21}, "logprobs", "at most 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "the whole vocabulary"),
        ({"stop_token_ids": [1, 1000]}, "stop_token_ids[1]", r"out of vocabulary \[0, 1000\)"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids[0]", "out of vocabulary"),
        ({"logit_bias": {1000: 1.0}}, "logit_bias", "token id 1000 is out of vocabulary"),
    ],
)
def test_model_dependent_checks(kwargs, field, message):
    with pytest.raises(ValidationError, match=message) as info:
        SamplingParams(**kwargs).verify(vocab_size=1000, max_logprobs=20)
    assert info.value.field == field


def test_whole_vocabulary_logprobs_allowed_when_uncapped():
    SamplingParams(logprobs=-1, prompt_logprobs=-1).verify(vocab_size=1000, max_logprobs=-1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 2**63}, "seed"),
        ({"top_k": 2**40}, "top_k"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logit_bias": {1.7: 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"output_kind": "STREAMING"}, "output_kind"),
        ({"top_p": 1e-46}, "top_p"),  # 0 as a float32 (1e-40 is a float32 subnormal: carried)
    ],
)
def test_values_the_wire_cannot_carry_are_refused(kwargs, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_lenient_spellings():
    assert SamplingParams(output_kind="delta").output_kind == RequestOutputKind.DELTA
    assert SamplingParams(logprobs=False).logprobs is None
    with pytest.raises(ValidationError, match="more than the vocabulary"):
        SamplingParams(logprobs=5000).verify(vocab_size=1000, max_logprobs=-1)


# Every field of vLLM's SamplingParams (0.33, plus the names older releases had), notes §2.
VLLM_FIELD_NAMES = [
    "n",
    "best_of",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logprob_token_ids",
    "flat_logprobs",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logits_processors",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "output_kind",
    "stream_interval",
    "structured_outputs",
    "guided_decoding",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "extra_args",
    "thinking_token_budget",
    "repetition_detection",
    "watermarking",
    "skip_clone",
    "skip_reading_prefix_cache",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "routed_experts_prompt_start",
    "trace_decode_token_ids",
]


def test_every_vllm_field_name_is_accepted_at_its_neutral_value():
    import dataclasses

    assert set(VLLM_FIELD_NAMES) <= {f.name for f in dataclasses.fields(SamplingParams)}
    p = SamplingParams(
        best_of=1,
        logits_processors=[],
        bad_words=[],
        truncate_prompt_tokens=None,
        structured_outputs=None,
        guided_decoding=None,
        extra_args={},
        flat_logprobs=False,
        stream_interval=1,
        skip_clone=True,
        skip_reading_prefix_cache=False,
        thinking_token_budget=-1,  # vLLM's spelling of unlimited
        routed_experts_prompt_start=0,  # vLLM's default
    )
    assert (p.n, p.temperature, p.max_tokens, p.stop) == (1, 1.0, 16, [])


@pytest.mark.parametrize(
    ("kwargs", "field", "reason"),
    [
        ({"n": 2, "best_of": 3}, "best_of", "best_of > 1 is not supported"),
        ({"best_of": 2}, "best_of", "best_of > 1 is not supported"),
        ({"n": 3, "best_of": 2}, "best_of", "must be an integer >= n=3"),
        ({"best_of": 1.0}, "best_of", "must be an integer"),
        ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors", "per-request logits processors"),
        ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens", "truncate the prompt before"),
        ({"guided_decoding": {"regex": "a+"}}, "guided_decoding", "renamed structured_outputs"),
        ({"extra_args": {"my_processor": 1}}, "extra_args", "no effect"),
        ({"flat_logprobs": True}, "flat_logprobs", "not supported"),
        ({"logprob_token_ids": [5]}, "logprob_token_ids", "not supported"),
        ({"stream_interval": 0}, "stream_interval", "must be an integer >= 1"),
        ({"thinking_token_budget": 100}, "thinking_token_budget", "reasoning parser"),
        ({"skip_reading_prefix_cache": True}, "skip_reading_prefix_cache", "not supported"),
        ({"routed_experts_prompt_start": 3}, "routed_experts_prompt_start", "mixture-of-experts"),
    ],
)
def test_unsupported_vllm_fields_are_refused_as_value_errors_naming_the_field(kwargs, field, reason):
    with pytest.raises(ValueError, match=reason) as info:  # ValidationError is a ValueError, as vLLM's
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValidationError) and info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


def test_model_defaults_fill_unset_fields_and_explicit_ones_win():
    from frontend_svc.sampling_params import sampling_params_with_defaults

    defaults = {"temperature": 0.7, "top_p": 0.9, "top_k": 1, "max_tokens": 64}
    p = sampling_params_with_defaults({}, defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.9, 1, 0.0, 1.0)
    # The model's max_tokens is a cap applied once the prompt is known, not a requested length.
    assert (p.max_tokens, p.default_max_tokens) == (None, 64)
    q = sampling_params_with_defaults({"top_k": 0, "seed": 3, "max_tokens": 5}, defaults)
    assert (q.temperature, q.top_p, q.top_k, q.seed, q.max_tokens, q.default_max_tokens) == (0.7, 0.9, 0, 3, 5, None)
    unlimited = sampling_params_with_defaults({"max_tokens": None}, defaults)
    assert (unlimited.max_tokens, unlimited.default_max_tokens) == (None, None)
    assert sampling_params_with_defaults({}, {}) == SamplingParams()


def test_at_most_1024_stop_strings():
    assert len(SamplingParams(stop=[f"s{i}" for i in range(1024)]).stop) == 1024
    with pytest.raises(ValidationError, match="stop: has 1025 strings, more than the 1024 allowed"):
        SamplingParams(stop=[f"s{i}" for i in range(1025)])


def test_the_public_apis_float32_fields_are_the_decimals_the_client_wrote():
    """A float32 field on the wire widens 0.1 to 0.10000000149011612: the frontend reads back the decimal the
    client wrote, so messages quote it and a bound meets it (0.01 is not raised to the 0.01 minimum)."""
    from frontend_svc.wire import sampling_params_from_api
    from splitserve.stubs.frontend.v1 import generation_pb2 as api

    with pytest.raises(ValidationError) as info:
        sampling_params_from_api(api.SamplingParams(temperature=-0.1))
    assert info.value.field == "temperature" and "-0.1" in str(info.value) and "0.1000000" not in str(info.value)
    params = sampling_params_from_api(
        api.SamplingParams(temperature=0.01, top_p=0.9, min_p=0.05, repetition_penalty=1.1, logit_bias={5: -0.3})
    )
    assert (params.temperature, params.top_p, params.min_p, params.repetition_penalty) == (0.01, 0.9, 0.05, 1.1)
    assert params.logit_bias == {5: -0.3}
