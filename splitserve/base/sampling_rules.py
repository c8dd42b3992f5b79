"""The sampling-parameter checks both services make, one definition each (vLLM ``SamplingParams._verify_args``
and ``verify``): the frontend's ``SamplingParams`` on construction and the core's ``SamplingParams.validate`` call
the same functions, so a bad value is refused with the same message by either. Each returns the first
``Violation`` (field, and what is wrong without the field's name) or None; the caller raises its own
``FieldError``. Also vLLM's ``update_from_generation_config`` (``eos_and_stop_ids``), which both sides apply.

Checks only one side can make stay there: the frontend's types, ``n``, stop strings and vLLM fields splitserve
does not implement (``frontend_svc/sampling_params.py``).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from splitserve.base.request_rules import token_id_outside_vocabulary, token_ids_violation
from splitserve.base.status import Violation

# Smaller positive temperatures are raised to this, for numerical stability (vLLM's _MAX_TEMP, in
# SamplingParams.__post_init__): the frontend on construction, the core for what arrives on its wire.
MIN_TEMPERATURE = 1e-2
INT32_MAX = 2**31 - 1  # the wire carries counts and ids as int32, the seed as int64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class SamplingValues(Protocol):
    """The fields the shared checks read: both services' ``SamplingParams`` have them (read-only here)."""

    @property
    def presence_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def min_p(self) -> float: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def max_tokens(self) -> int | None: ...  # None: not resolved yet (the frontend's "up to max_model_len")
    @property
    def min_tokens(self) -> int: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...
    @property
    def stop_token_ids(self) -> list[int] | None: ...
    @property
    def allowed_token_ids(self) -> list[int] | None: ...
    @property
    def bad_words_token_ids(self) -> list[list[int]] | None: ...
    @property
    def logit_bias(self) -> Mapping[int, float] | None: ...
    @property
    def eos_token_id(self) -> int | None: ...


def range_violation(params: SamplingValues) -> Violation | None:
    """The first value outside its range, whatever the model (vLLM ``_verify_args``; the upper bounds of
    integers are the wire's). Numbers must be numbers already (the frontend checks types first)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            return Violation(name, f"must be in [-2, 2], got {value}")
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0.0):
        return Violation("repetition_penalty", f"must be a finite number > 0, got {params.repetition_penalty}")
    if not (math.isfinite(params.temperature) and 0.0 <= params.temperature <= 2.0):
        return Violation("temperature", f"must be a finite number in [0, 2], got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        return Violation("top_p", f"must be in (0, 1], got {params.top_p}")
    if struct.unpack("f", struct.pack("f", params.top_p))[0] == 0.0:
        # Below about 7e-46 (half the smallest float32 subnormal, 2**-149): 0 on the wire.
        return Violation("top_p", f"rounds to 0 as a float32, got {params.top_p}")
    if not (_is_int(params.top_k) and -1 <= params.top_k <= INT32_MAX):
        return Violation("top_k", f"must be an integer: -1 or 0 (off), or in [1, {INT32_MAX}], got {params.top_k!r}")
    if not 0.0 <= params.min_p <= 1.0:
        return Violation("min_p", f"must be in [0, 1], got {params.min_p}")
    seed = params.seed
    if seed is not None and not (_is_int(seed) and INT64_MIN <= seed <= INT64_MAX):
        return Violation("seed", f"must be a 64-bit integer, got {seed!r}")
    max_tokens = params.max_tokens
    if max_tokens is not None and not (_is_int(max_tokens) and 1 <= max_tokens <= INT32_MAX):
        return Violation("max_tokens", f"must be an integer in [1, {INT32_MAX}], got {max_tokens!r}")
    min_tokens = params.min_tokens
    if not (_is_int(min_tokens) and 0 <= min_tokens <= INT32_MAX):
        return Violation("min_tokens", f"must be an integer in [0, {INT32_MAX}], got {min_tokens!r}")
    if max_tokens is not None and min_tokens > max_tokens:
        return Violation("min_tokens", f"must be <= max_tokens={max_tokens}, got {min_tokens}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not (_is_int(value) and -1 <= value <= INT32_MAX):
            return Violation(name, f"must be -1 (the whole vocabulary) or an integer >= 0, got {value!r}")
    if params.allowed_token_ids is not None and len(params.allowed_token_ids) == 0:
        return Violation("allowed_token_ids", "must not be empty when given")
    for token_id, bias in (params.logit_bias or {}).items():
        # Any finite bias, or -inf (the token banned), as vLLM adds them; +inf and NaN would make NaN logits.
        if math.isnan(bias) or bias == math.inf:
            return Violation("logit_bias", f"bias for token {token_id} must be finite or -inf, got {bias}")
    return None


def model_violation(params: SamplingValues, vocab_size: int, max_logprobs: int) -> Violation | None:
    """The first value wrong for the model (vLLM ``SamplingParams.verify``): more logprobs than the engine's
    ``max_logprobs`` (-1: no cap; a request's -1 asks for the whole vocabulary, which counts as vocab_size) or the
    vocabulary, a token id outside
    [0, vocab_size) (``stop_token_ids[i]``, ``allowed_token_ids[i]``, ``logit_bias``, ``eos_token_id``,
    ``bad_words_token_ids[i][j]``), an empty bad-word sequence."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        count = vocab_size if value == -1 else value  # vLLM's: -1 is the vocabulary, held to the cap as such
        if max_logprobs != -1 and count > max_logprobs:
            asked = f"the whole vocabulary (-1: {vocab_size})" if value == -1 else value
            return Violation(name, f"asked for {asked}; the engine core allows at most {max_logprobs} (max_logprobs)")
        if value > vocab_size:
            return Violation(name, f"asked for {value}, more than the vocabulary ({vocab_size}); -1 asks for all")
    for name in ("stop_token_ids", "allowed_token_ids"):
        violation = token_ids_violation(name, getattr(params, name) or [], vocab_size)
        if violation is not None:
            return violation
    for token_id in params.logit_bias or {}:
        if not 0 <= token_id < vocab_size:
            return Violation("logit_bias", token_id_outside_vocabulary(token_id, vocab_size))
    for i, sequence in enumerate(params.bad_words_token_ids or []):
        if not sequence:
            return Violation(f"bad_words_token_ids[{i}]", "cannot be empty")
        violation = token_ids_violation(f"bad_words_token_ids[{i}]", sequence, vocab_size)
        if violation is not None:
            return violation
    eos_token_id = params.eos_token_id
    if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
        return Violation("eos_token_id", token_id_outside_vocabulary(eos_token_id, vocab_size))
    return None


def eos_and_stop_ids(
    eos_token_ids: Sequence[int], stop_token_ids: Sequence[int], ignore_eos: bool
) -> tuple[int | None, list[int]]:
    """(eos_token_id, stop_token_ids) of a request, from the model's EOS ids (its generation config's, first the
    tokenizer's EOS) and the request's own stop ids, as vLLM's ``update_from_generation_config``: the first EOS id
    stops the request (unless ignore_eos); further EOS ids become stop ids, reported with stop_reason = the id.
    No EOS ids: (None, the stop ids unchanged)."""
    stop_ids = list(stop_token_ids)
    if not eos_token_ids:
        return None, stop_ids
    if not ignore_eos:
        stop_ids += [i for i in eos_token_ids[1:] if i not in stop_ids]
    return eos_token_ids[0], stop_ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
