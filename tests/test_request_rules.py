"""The request checks both services make, defined once (``splitserve.base.sampling_rules``,
``splitserve.base.request_rules``): the frontend's ``ValidationError`` and the core's ``InvalidRequestError`` for the
same bad value carry the same field and the same message; error classes state their gRPC status codes."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from core_svc.errors import (
    EngineStepError,
    EngineUnavailableError,
    InvalidRequestError,
    LoRANotFoundError,
    ModelLoadError,
    ProfileStateError,
)
from core_svc.errors import RequestTooLargeError as CoreRequestTooLargeError
from core_svc.sampling_params import SamplingParams as CoreSamplingParams
from frontend_svc.errors import (
    AlreadyExistsError,
    EngineDeadError,
    FailedPreconditionError,
    InternalError,
    NotFoundError,
    NotSupportedError,
    RequestTooLargeError,
    ValidationError,
    error_from_core,
)
from frontend_svc.sampling_params import SamplingParams
from splitserve.base.grpc_errors import UndecodableRequestError
from splitserve.base.grpc_status import bad_request_status, grpc_status_code
from splitserve.base.request_rules import max_tokens_violation, prompt_violation
from splitserve.base.sampling_rules import eos_and_stop_ids
from splitserve.base.status import StatusCode, Violation

VOCAB_SIZE, MAX_LOGPROBS = 1000, 20

# (fields, max_logprobs, the field refused, its message): every rule both sides check, each value refused by one.
SHARED_RULES: list[tuple[dict[str, Any], int, str, str]] = [
    ({"presence_penalty": 3.0}, MAX_LOGPROBS, "presence_penalty", "must be in [-2, 2], got 3.0"),
    ({"frequency_penalty": -2.5}, MAX_LOGPROBS, "frequency_penalty", "must be in [-2, 2], got -2.5"),
    ({"repetition_penalty": 0.0}, MAX_LOGPROBS, "repetition_penalty", "must be a finite number > 0, got 0.0"),
    ({"repetition_penalty": float("inf")}, MAX_LOGPROBS, "repetition_penalty", "must be a finite number > 0, got inf"),
    ({"temperature": -1.0}, MAX_LOGPROBS, "temperature", "must be a finite number in [0, 2], got -1.0"),
    ({"temperature": float("nan")}, MAX_LOGPROBS, "temperature", "must be a finite number in [0, 2], got nan"),
    ({"top_p": 0.0}, MAX_LOGPROBS, "top_p", "must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, MAX_LOGPROBS, "top_p", "must be in (0, 1], got 1.5"),
    ({"top_p": 5e-46}, MAX_LOGPROBS, "top_p", "rounds to 0 as a float32, got 5e-46"),
    ({"top_k": -2}, MAX_LOGPROBS, "top_k", "must be an integer: -1 or 0 (off), or in [1, 2147483647], got -2"),
    ({"min_p": 1.5}, MAX_LOGPROBS, "min_p", "must be in [0, 1], got 1.5"),
    ({"seed": 2**63}, MAX_LOGPROBS, "seed", f"must be a 64-bit integer, got {2**63}"),
    ({"max_tokens": 0}, MAX_LOGPROBS, "max_tokens", "must be an integer in [1, 2147483647], got 0"),
    ({"min_tokens": -1}, MAX_LOGPROBS, "min_tokens", "must be an integer in [0, 2147483647], got -1"),
    ({"min_tokens": 5, "max_tokens": 2}, MAX_LOGPROBS, "min_tokens", "must be <= max_tokens=2, got 5"),
    ({"logprobs": -2}, MAX_LOGPROBS, "logprobs", "must be -1 (the whole vocabulary) or an integer >= 0, got -2"),
    ({"prompt_logprobs": -3}, -1, "prompt_logprobs", "must be -1 (the whole vocabulary) or an integer >= 0, got -3"),
    ({"allowed_token_ids": []}, MAX_LOGPROBS, "allowed_token_ids", "must not be empty when given"),
    # Checks against the model.
    ({"logprobs": 21}, MAX_LOGPROBS, "logprobs", "asked for 21; the engine core allows at most 20 (max_logprobs)"),
    (
        {"prompt_logprobs": -1},
        MAX_LOGPROBS,
        "prompt_logprobs",
        "asked for the whole vocabulary (-1: 1000); the engine core allows at most 20 (max_logprobs)",
    ),
    (
        {"logprobs": -1},
        999,
        "logprobs",
        "asked for the whole vocabulary (-1: 1000); the engine core allows at most 999 (max_logprobs)",
    ),
    ({"logprobs": 1001}, -1, "logprobs", "asked for 1001, more than the vocabulary (1000); -1 asks for all"),
    (
        {"stop_token_ids": [1, 1000]},
        MAX_LOGPROBS,
        "stop_token_ids[1]",
        "token id 1000 is out of vocabulary [0, 1000)",
    ),
    (
        {"allowed_token_ids": [-1]},
        MAX_LOGPROBS,
        "allowed_token_ids[0]",
        "token id -1 is out of vocabulary [0, 1000)",
    ),
    ({"logit_bias": {1000: 1.0}}, MAX_LOGPROBS, "logit_bias", "token id 1000 is out of vocabulary [0, 1000)"),
    ({"eos_token_id": 1000}, MAX_LOGPROBS, "eos_token_id", "token id 1000 is out of vocabulary [0, 1000)"),
]


@pytest.mark.parametrize(("fields", "max_logprobs", "field", "description"), SHARED_RULES)
def test_both_services_refuse_a_bad_value_with_the_same_field_and_message(fields, max_logprobs, field, description):
    with pytest.raises(ValidationError) as frontend:
        SamplingParams(**fields).verify(VOCAB_SIZE, max_logprobs)
    with pytest.raises(InvalidRequestError) as core:
        CoreSamplingParams(**fields).validate(VOCAB_SIZE, max_logprobs)
    assert (frontend.value.field, frontend.value.description) == (field, description)
    assert (core.value.field, core.value.description) == (field, description)
    assert str(frontend.value) == str(core.value) == f"{field}: {description}"


def test_the_whole_vocabulary_is_allowed_where_max_logprobs_covers_it():
    """vLLM's rule: -1 counts as the vocabulary's size against max_logprobs."""
    for fields in ({"logprobs": -1}, {"prompt_logprobs": -1}):
        SamplingParams(**fields).verify(VOCAB_SIZE, VOCAB_SIZE)
        CoreSamplingParams(**fields).validate(VOCAB_SIZE, VOCAB_SIZE)


@pytest.mark.parametrize(
    ("prompt", "max_model_len", "violation"),
    [
        ([], 8, Violation("prompt", "cannot be empty")),
        (
            [5] * 8,
            8,
            Violation(
                "prompt",
                "has 8 tokens, which leaves no room for an output token within max_model_len=8 (this model's "
                "maximum context length is 8 tokens)",
            ),
        ),
        ([5, 1000, 6], 8, Violation("prompt_token_ids[1]", "token id 1000 is out of vocabulary [0, 1000)")),
        ([5, -1], 8, Violation("prompt_token_ids[1]", "token id -1 is out of vocabulary [0, 1000)")),
        ([5] * 7, 8, None),
    ],
)
def test_prompt_violation(prompt, max_model_len, violation):
    assert prompt_violation(prompt, max_model_len, VOCAB_SIZE, "prompt") == violation


def test_max_tokens_violation():
    assert max_tokens_violation(4, 4, 8) is None
    assert max_tokens_violation(5, 4, 8) == Violation(
        "max_tokens",
        "5 is too large: this model's maximum context length is 8 tokens, and 9 were requested (4 in the prompt, "
        "5 in the completion); at most 4 fit after this prompt",
    )


@pytest.mark.parametrize(
    ("eos_token_ids", "stop_token_ids", "ignore_eos", "expected"),
    [
        ([2], [], False, (2, [])),
        ([2, 7, 9], [9], False, (2, [9, 7])),  # further EOS ids become stop ids, each once
        ([2, 7], [], True, (2, [])),  # ignore_eos: the EOS is known but no further id stops
        ([], [4], False, (None, [4])),
    ],
)
def test_eos_and_stop_ids_as_vllms_update_from_generation_config(eos_token_ids, stop_token_ids, ignore_eos, expected):
    assert eos_and_stop_ids(eos_token_ids, stop_token_ids, ignore_eos) == expected


def test_error_classes_state_their_status_codes():
    expected = {
        ValidationError("top_p", "x"): "INVALID_ARGUMENT",
        InvalidRequestError("top_p", "x"): "INVALID_ARGUMENT",
        UndecodableRequestError("x"): "INVALID_ARGUMENT",
        NotFoundError("x"): "NOT_FOUND",
        LoRANotFoundError("x"): "NOT_FOUND",
        RequestTooLargeError("x"): "RESOURCE_EXHAUSTED",
        CoreRequestTooLargeError("x"): "RESOURCE_EXHAUSTED",
        ProfileStateError("x"): "FAILED_PRECONDITION",
        NotSupportedError("x"): "UNIMPLEMENTED",
        InternalError("x"): "INTERNAL",
        EngineStepError("x"): "INTERNAL",
        RuntimeError("CUDA error"): "INTERNAL",
        EngineDeadError("x"): "UNAVAILABLE",
        EngineUnavailableError("x"): "UNAVAILABLE",
        ModelLoadError("x"): "UNAVAILABLE",
    }
    assert {type(e).__name__: grpc_status_code(e).name for e in expected} == {
        type(e).__name__: name for e, name in expected.items()
    }
    assert all(code.value == grpc.StatusCode[code.name].value[0] for code in StatusCode)


def test_each_code_the_core_sends_becomes_the_frontends_error_with_the_field_as_data():
    refused = error_from_core(StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 0.0", "top_p")
    assert isinstance(refused, ValidationError)
    assert (refused.field, refused.description) == ("top_p", "must be in (0, 1], got 0.0")
    assert str(refused) == "top_p: must be in (0, 1], got 0.0"
    assert error_from_core(StatusCode.INVALID_ARGUMENT, "no field", "").field == "request"
    kinds = {code: type(error_from_core(code, "m")) for code in StatusCode if code != StatusCode.INVALID_ARGUMENT}
    assert kinds == {
        StatusCode.NOT_FOUND: NotFoundError,
        StatusCode.ALREADY_EXISTS: AlreadyExistsError,  # a LoRA adapter's name loaded from another folder
        StatusCode.RESOURCE_EXHAUSTED: RequestTooLargeError,
        StatusCode.FAILED_PRECONDITION: FailedPreconditionError,  # LoRA off on the core, a cancelled drain
        StatusCode.UNIMPLEMENTED: NotSupportedError,
        StatusCode.INTERNAL: InternalError,
        StatusCode.UNAVAILABLE: EngineDeadError,
    }


def test_a_field_error_status_carries_a_bad_request_field_violation():
    from google.rpc import error_details_pb2, status_pb2
    from grpc_status import rpc_status

    status = bad_request_status(ValidationError("top_p", "must be in (0, 1], got 0.0"))
    assert (status.code, status.details) == (grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 0.0")
    [(key, value)] = status.trailing_metadata
    assert key == rpc_status.GRPC_DETAILS_METADATA_KEY
    bad_request = error_details_pb2.BadRequest()
    assert status_pb2.Status.FromString(value).details[0].Unpack(bad_request)
    assert [(v.field, v.description) for v in bad_request.field_violations] == [("top_p", "must be in (0, 1], got 0.0")]
