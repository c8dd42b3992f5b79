"""``SamplingParams``: vLLM's field names, defaults, normalization and validation rules
(``vllm/sampling_params.py``). Every refused value raises ``ValidationError`` naming the field and its range.
The ranges and the checks against the model are the core's too (``splitserve.base.sampling_rules``); the types,
``n``, stop strings and the vLLM fields splitserve does not implement are checked here only.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.errors import ValidationError
from frontend_svc.structured_outputs import check_structured_outputs, structured_outputs_from_value
from splitserve.base.sampling_rules import INT32_MAX, INT64_MIN, MIN_TEMPERATURE, model_violation, range_violation
from splitserve.base.sampling_rules import INT64_MAX as INT64_MAX  # the seed's range, for callers
from splitserve.base.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES
SAMPLING_EPS = 1e-5  # temperatures below this are greedy
# Stop strings are matched on every new piece of text, each one in turn, on the frontend's event loop: a request
# with a million of them held every other request of its frontend about 0.14 s per token. TGI allows 4 by default
# (--max-stop-sequences) and OpenAI's API 4; vLLM sets no limit.
MAX_STOP_STRINGS = 1024
FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
BOOL_FIELDS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


# Fields a model's generation config may give defaults for, in vLLM's names (vLLM
# ``ModelConfig.get_diff_sampling_param``; its ``max_new_tokens`` is our ``max_tokens``).
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_tokens")

# vLLM SamplingParams fields that splitserve accepts by name but does not implement: any value but the neutral
# one (None, False, empty) is refused naming the field, as vLLM V1 refuses best_of and per-request logits
# processors. field -> why.
UNSUPPORTED_FIELDS: dict[str, str] = {
    "logits_processors": "per-request logits processors are not supported (as vLLM V1): a Python callable "
    "cannot be sent to the engine core; use logit_bias, allowed_token_ids or min_tokens",
    "truncate_prompt_tokens": "is not supported: truncate the prompt before sending it (vLLM moved this "
    "option out of SamplingParams, to tokenization_kwargs)",
    "guided_decoding": "was renamed structured_outputs (vLLM): pass a StructuredOutputsParams there",
    "extra_args": "would have no effect: it carries arguments for custom logits processors, and splitserve runs none",
    "flat_logprobs": "is not supported: logprobs come as one dict per position",
    "logprob_token_ids": "is not supported yet: logprobs gives the top-k of each position",
    "prompt_logprob_token_ids": "is not supported yet: prompt_logprobs gives the top-k of each position",
    "prompt_logprob_start": "is not supported yet: prompt_logprobs covers the whole prompt",
    "thinking_token_budget": "needs a reasoning parser, and splitserve has none",
    "repetition_detection": "is not supported yet",
    "watermarking": "is not supported",
    "skip_reading_prefix_cache": "is not supported: the engine core decides when the prefix cache is read",
    "routed_experts_prompt_start": "is not supported: splitserve serves no mixture-of-experts model",
    "trace_decode_token_ids": "is not supported",
}


# Neutral values of UNSUPPORTED_FIELDS besides None, False and empty: vLLM's defaults or "off" spellings
# (thinking_token_budget -1 is unlimited; routed_experts_prompt_start defaults to 0).
NEUTRAL_VALUES: dict[str, object] = {"thinking_token_budget": -1, "routed_experts_prompt_start": 0}


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything so far
    DELTA = 1  # every output holds what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample and when to stop. Defaults are vLLM's, and so is every field name: fields splitserve does
    not implement (``UNSUPPORTED_FIELDS``, ``best_of`` > 1) are accepted at their neutral value and refused at
    any other, as vLLM V1 does for ``best_of`` and ``logits_processors``.

    ``max_tokens`` is checked against the room left within max_model_len once the prompt is known
    (``InputProcessor``): a value that does not fit is refused. ``max_tokens=None`` means "up to max_model_len",
    or up to ``default_max_tokens`` when that is set (a model's ``max_new_tokens``, which is a cap, never
    refused: vLLM's servers' ``get_max_tokens``).

    Raises:
        ValidationError: from ``__post_init__`` for any value vLLM refuses or splitserve does not support; from
            ``verify`` for values that are wrong for the model (token ids outside the vocabulary, more logprobs
            than the engine core allows).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None  # -1 means None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # True means 1; -1: the whole vocabulary
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated, at a word's start or inside text (``bad_words_token_ids``)
    bad_words: list[str] | None = None
    # The output's constraint: a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar
    # (a dict of its fields is taken too); checked here, compiled by the engine core.
    structured_outputs: StructuredOutputsParams | None = None
    # The model's default max_tokens (generation config max_new_tokens), used when max_tokens is None and
    # capped to the room left within max_model_len.
    default_max_tokens: int | None = None
    # bad_words as token-id sequences, set by the InputProcessor with the model's tokenizer (vLLM's
    # update_from_tokenizer); what the core bans
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # vLLM's fields splitserve accepts only at their neutral value (best_of also at n; see UNSUPPORTED_FIELDS).
    best_of: int | None = field(default=None, repr=False)
    logits_processors: Any = field(default=None, repr=False)
    truncate_prompt_tokens: int | None = field(default=None, repr=False)
    guided_decoding: Any = field(default=None, repr=False)
    extra_args: dict[str, Any] | None = field(default=None, repr=False)
    flat_logprobs: bool = field(default=False, repr=False)
    logprob_token_ids: list[int] | None = field(default=None, repr=False)
    prompt_logprob_token_ids: list[int] | None = field(default=None, repr=False)
    prompt_logprob_start: int | None = field(default=None, repr=False)
    # vLLM's: while streaming, an output for the first token, then every this many tokens at least, and the last;
    # the engine's stream_interval (--stream-interval) is the least (None: the engine's)
    stream_interval: int | None = field(default=None, repr=False)
    thinking_token_budget: int | None = field(default=None, repr=False)
    repetition_detection: Any = field(default=None, repr=False)
    watermarking: Any = field(default=None, repr=False)
    skip_clone: bool = field(default=False, repr=False)  # a copying hint only: accepted, nothing to do
    skip_reading_prefix_cache: bool | None = field(default=None, repr=False)
    routed_experts_prompt_start: int | None = field(default=None, repr=False)
    trace_decode_token_ids: Any = field(default=None, repr=False)
    # Filled by the InputProcessor from the model: the EOS id the core stops on (unless ignore_eos).
    eos_token_id: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._check_unsupported()
        self._check_types()
        self._normalize()
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the truncation knobs mean nothing, and n > 1 would give n identical completions.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValidationError("n", f"must be 1 when using greedy sampling (temperature 0), got {self.n}")

    # --- derived ---

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back while streaming, so no partial stop string is ever sent."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of n children: n = 1 and, when seeded, seed + index (vLLM), wrapped
        into the wire's 64-bit range (``child_seed``). A shallow copy, as vLLM's: the lists are shared, and
        nothing changes them after validation (a deep copy per child cost an n = 16384 request 2.7 s)."""
        child = copy.copy(self)
        child.n = 1
        if self.seed is not None:
            child.seed = child_seed(self.seed, index)
        return child

    # --- checks ---

    def verify(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model (vLLM ``SamplingParams.verify``), the core's too
        (``splitserve.base.sampling_rules.model_violation``).

        Raises:
            ValidationError: logprobs above the engine's max_logprobs or the vocabulary, token ids outside
                [0, vocab_size).
        """
        violation = model_violation(self, vocab_size, max_logprobs)
        if violation is not None:
            raise ValidationError.from_violation(violation)

    def _check_unsupported(self) -> None:
        for name, why in UNSUPPORTED_FIELDS.items():
            value = getattr(self, name)
            neutral = value is None or value is False or value == [] or value == {}
            if not neutral and not (name in NEUTRAL_VALUES and value == NEUTRAL_VALUES[name]):
                raise ValidationError(name, why)
        if self.stream_interval is not None and (not _is_int(self.stream_interval) or self.stream_interval < 1):
            raise ValidationError("stream_interval", f"must be an integer >= 1, got {self.stream_interval!r}")

    def _check_types(self) -> None:
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            _require(
                isinstance(value, int | float) and not isinstance(value, bool), name, f"must be a number, got {value!r}"
            )
        for name in BOOL_FIELDS:
            value = getattr(self, name)
            _require(isinstance(value, bool), name, f"must be true or false, got {value!r}")

    def _normalize(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = _as_list(self.stop, "stop", "a string or a list of strings")
        self.stop_token_ids = _unique_token_ids(self.stop_token_ids, "stop_token_ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _unique_token_ids(self.allowed_token_ids, "allowed_token_ids")
        if self.bad_words is not None:
            self.bad_words = _as_list(self.bad_words, "bad_words", "a list of strings")
            for i, word in enumerate(self.bad_words):
                _require(isinstance(word, str) and word.strip() != "", f"bad_words[{i}]", "must be a non-empty word")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):  # True asks for the sampled token and 1 more; False for none
                setattr(self, name, 1 if value else None)
        self.output_kind = _output_kind(self.output_kind)
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.structured_outputs is not None:
            self.structured_outputs = structured_outputs_from_value(self.structured_outputs)
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s; using %s", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE

    def _verify_args(self) -> None:
        _require(_is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        violation = range_violation(self)  # the ranges the core checks too, in the same words
        if violation is not None:
            raise ValidationError.from_violation(violation)
        _require(
            self.default_max_tokens is None
            or (_is_int(self.default_max_tokens) and 1 <= self.default_max_tokens <= INT32_MAX),
            "default_max_tokens",
            f"must be an integer in [1, {INT32_MAX}], got {self.default_max_tokens!r}",
        )
        if self.best_of is not None:
            # best_of below n was always an error; vLLM V1 refuses best_of > 1 outright.
            _require(
                _is_int(self.best_of) and self.best_of >= self.n,
                "best_of",
                f"must be an integer >= n={self.n}, got {self.best_of!r}",
            )
            _require(
                self.best_of == 1,
                "best_of",
                f"best_of > 1 is not supported (as vLLM V1), got {self.best_of}; ask for n completions and pick "
                "by cumulative_logprob",
            )
        _require(
            len(self.stop or []) <= MAX_STOP_STRINGS,
            "stop",
            f"has {len(self.stop or [])} strings, more than the {MAX_STOP_STRINGS} allowed",
        )
        for i, stop in enumerate(self.stop or []):
            _require(isinstance(stop, str), f"stop[{i}]", f"must be a string, got {stop!r}")
            _require(stop != "", f"stop[{i}]", "must not be an empty string")
        if self.structured_outputs is not None:
            check_structured_outputs(self.structured_outputs)
        _require(
            not (self.stop and not self.detokenize),
            "stop",
            "stop strings need detokenize=True (they are matched on the text)",
        )


def child_seed(seed: int, index: int) -> int:
    """The seed of child ``index`` of a request seeded ``seed``: seed + index as vLLM, wrapped to a signed 64-bit
    integer (two's complement), the wire's type. torch seeds a generator with a negative seed's two's complement
    (``manual_seed(-2**63)`` is ``manual_seed(2**63)``), so the core's generator is the one vLLM's seed + index
    gives, also past 2**63 - 1 where vLLM's seed + index leaves the int64 range vLLM's API takes the seed in."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def sampling_params_with_defaults(explicit: Mapping[str, Any], defaults: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams`` from the fields a caller set (``explicit``), the model's defaults (``defaults``, from
    its generation config: keys of ``GENERATION_CONFIG_FIELDS``) filling the fields the caller left unset, and
    vLLM's defaults the rest (vLLM's servers' ``to_sampling_params(default_sampling_params)``). A default
    max_tokens becomes ``default_max_tokens``: a cap, so a long prompt shortens it rather than being refused.

    Raises:
        ValidationError: a refused value, naming its field.
    """
    kwargs = {name: value for name, value in defaults.items() if name not in explicit and name != "max_tokens"}
    if "max_tokens" not in explicit and defaults.get("max_tokens") is not None:
        kwargs["max_tokens"] = None
        kwargs["default_max_tokens"] = defaults["max_tokens"]
    kwargs.update(explicit)
    return SamplingParams(**kwargs)


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ValidationError(field_name, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_list(value: Any, field_name: str, what: str) -> list[Any]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ValidationError(field_name, f"must be {what}, got {type(value).__name__}")
    return list(value)


def _unique_token_ids(value: Any, field_name: str) -> list[int]:
    """Integer token ids, each once, in first-seen order (None: none). A list of a million copies of one id cost
    every engine step of the request most of a second; deduplicated it is at most the vocabulary.

    Raises:
        ValidationError: not a list, or an entry that is not an integer (named by its index).
    """
    if value is None:
        return []
    token_ids = _as_list(value, field_name, "a list of integer token ids")
    if not set(map(type, token_ids)) <= {int}:  # the usual case checked at C speed; else find the culprit
        for i, token_id in enumerate(token_ids):
            _require(_is_int(token_id), f"{field_name}[{i}]", f"must be an integer token id, got {token_id!r}")
    return list(dict.fromkeys(token_ids))


def _output_kind(value: Any) -> RequestOutputKind:
    """An enum member, its int value, or its name in any case."""
    try:
        if isinstance(value, str):
            return RequestOutputKind[value.upper()]
        if _is_int(value):
            return RequestOutputKind(value)
    except (KeyError, ValueError):
        pass
    raise ValidationError("output_kind", f"must be CUMULATIVE (0), DELTA (1) or FINAL_ONLY (2), got {value!r}")


def _normalize_logit_bias(logit_bias: Any) -> dict[int, float]:
    """Keys are ints or integer strings (JSON); values any number but NaN and +inf (-inf bans the token), added as
    they are, as vLLM's ``SamplingParams`` takes them (its OpenAI server alone clamps to [-100, 100]; ours refuses
    values outside that range there, ``openai_protocol``)."""
    if not isinstance(logit_bias, dict):
        raise ValidationError("logit_bias", f"must map token ids to biases, got {type(logit_bias).__name__}")
    normalized: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            if not (_is_int(key) or isinstance(key, str)) or isinstance(value, bool):
                raise TypeError(key)
            token_id = int(key)
            bias = float(value)
        except (TypeError, ValueError):
            raise ValidationError(
                "logit_bias", f"needs integer token ids and numeric biases, got {key!r}: {value!r}"
            ) from None
        if math.isnan(bias) or bias == math.inf:
            raise ValidationError("logit_bias", f"bias for token {token_id} must be finite or -inf, got {value!r}")
        normalized[token_id] = bias
    return normalized


def bad_words_token_ids(tokenizer: Any, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as the token sequences it can appear as (vLLM's ``SamplingParams.update_from_tokenizer``):
    the word tokenized alone (leading spaces stripped), and with a leading space where that gives another first
    token in as many tokens (the word inside text, for tokenizers that mark word starts)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        alone = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        inside = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if inside and alone and inside[0] != alone[0] and len(inside) == len(alone):
            sequences.append(inside)
    return [sequence for sequence in sequences if sequence]
