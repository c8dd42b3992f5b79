"""The OpenAI-compatible HTTP API's request bodies (pydantic models, as vLLM's
``vllm/entrypoints/openai/protocol.py``) and their sampling parameters.

Fields and defaults are OpenAI's, plus vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``skip_special_tokens``, ``include_stop_str_in_output``, ...). Types are checked
strictly (a string is not a number); the ranges are ``SamplingParams``'s, whose ``ValidationError`` names the
field as the client sent it (``request_field``). Fields OpenAI or vLLM define that splitserve does not implement
are refused by name when set to anything but their neutral value, never ignored (``UNSUPPORTED_REQUEST_FIELDS``);
fields neither defines are ignored, as vLLM ignores them. Where vLLM's field is ``Optional``, JSON ``null`` means
the default.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, Strict

from frontend_svc.beam_search import BeamSearchParams
from frontend_svc.errors import ValidationError
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams, sampling_params_with_defaults
from frontend_svc.tool_calls import AutoToolChoice, ForcedToolChoice, check_tools, forced_tool_choice
from splitserve.base.pooling_params import PoolingParams
from splitserve.base.structured_outputs import FIELD as STRUCTURED_OUTPUTS_FIELD
from splitserve.base.structured_outputs import KINDS as STRUCTURED_OUTPUT_KINDS

# vLLM's (and OpenAI's) default max_tokens of the legacy completions API; chat takes all the room left.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's range of a logit_bias value.
LOGIT_BIAS_LIMIT = 100

# Request fields of vLLM's (or OpenAI's) completions and chat bodies that splitserve does not implement: field ->
# why. ``check_unsupported`` refuses one set to anything but None, False or an empty list.
# vLLM's guided_* request fields -> the structured_outputs key each one is
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}

UNSUPPORTED_REQUEST_FIELDS: dict[str, str] = {
    "guided_whitespace_pattern": "is not supported: structured outputs use the backend's whitespace rules",
    "logits_processors": "per-request logits processors are not supported",
    "prompt_embeds": "prompts as embeddings are not supported",
    "kv_transfer_params": "disaggregated prefill is not supported",
    "vllm_xargs": "would have no effect: it carries arguments for custom logits processors, and splitserve runs none",
    "tools": "tools are a chat request's",
    "functions": "is OpenAI's deprecated form of tools: send tools and tool_choice",
    "suffix": "suffixes are not supported",
    "mm_processor_kwargs": "is not supported",
}
# Their neutral values besides None, False and empty containers.
_NEUTRAL_VALUES: dict[str, object] = {}


def _is_neutral(name: str, value: object) -> bool:
    """Whether ``value`` of an unimplemented field asks for nothing (None, False, empty, or its default)."""
    if value is None or value is False or (isinstance(value, list | dict | str) and not value):
        return True
    return name in _NEUTRAL_VALUES and value == _NEUTRAL_VALUES[name]


# A boolean field also takes JSON's "true" / "false" strings (and 0 / 1), as vLLM's (lax) models take them: clients
# and vLLM's own tests send them so. Numbers and strings stay strict.
LaxBool = Annotated[bool, Strict(False)]


class _Strict(BaseModel):
    # strict: a JSON string is never a number nor a bool; an integer is still a float (pydantic's strict JSON rule).
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: LaxBool = False  # a last chunk with the request's usage (and no choices)
    continuous_usage_stats: LaxBool = False  # vLLM's: every chunk carries the usage so far too


class SamplingRequest(_Strict):
    """The fields completions and chat share: the model, streaming and the sampling parameters."""

    model: str | None = None  # None: the one served
    stream: LaxBool | None = False  # None: false
    stream_options: StreamOptions | None = None
    n: int | None = 1  # None: 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # ignored, as vLLM ignores it
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: LaxBool | None = None
    skip_special_tokens: LaxBool | None = None
    spaces_between_special_tokens: LaxBool | None = None
    include_stop_str_in_output: LaxBool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    prompt_logprobs: int | None = None  # vLLM's: each prompt position's logprob and this many most likely tokens
    cache_salt: str | None = None  # vLLM's: isolates this request's prefix-cache entries
    return_token_ids: LaxBool | None = None  # vLLM's: the prompt's and each choice's token ids in the response
    request_id: str | None = None  # vLLM's: the response's id is cmpl- / chatcmpl- and this (default: a uuid)
    priority: int = 0  # vLLM's: lower is served first under the core's priority policy
    # OpenAI's output format: text, json_object or json_schema (``structured_outputs_params``)
    response_format: dict[str, Any] | None = None
    # vLLM's extra: a StructuredOutputsParams as a dict (json, json_object, regex, choice, grammar,
    # disable_any_whitespace)
    structured_outputs: dict[str, Any] | None = None
    # vLLM's earlier names of its constraints, still sent by clients: each one key of structured_outputs
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # the engine's own backend runs whatever is asked ("auto")
    guided_whitespace_pattern: str | None = None
    # Fields splitserve does not implement: refused when set (``check_unsupported``, UNSUPPORTED_REQUEST_FIELDS)
    best_of: int | None = None  # SamplingParams refuses it above 1 (as vLLM V1)
    use_beam_search: LaxBool | None = None
    length_penalty: float | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt cut to this many tokens (-1: as many as fit)
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end is cut (default: the start)
    return_tokens_as_token_ids: LaxBool | None = None
    logits_processors: list[Any] | None = None
    prompt_embeds: Any = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None

    # The SamplingParams fields taken as they are, when the client sets them.
    _DIRECT = (
        "n",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "stop_token_ids",
        "allowed_token_ids",
        "bad_words",
        "prompt_logprobs",
        "best_of",
    )

    def check_unsupported(self) -> None:
        """Raises ValidationError naming a field this server does not implement (``UNSUPPORTED_REQUEST_FIELDS``),
        when set, or a value OpenAI's or vLLM's request rules refuse: ``logit_bias`` values outside [-100, 100],
        ``stream_options`` without streaming, ``prompt_logprobs`` with streaming or below -1 (vLLM's
        ``check_logprobs``)."""
        for token, bias in (self.logit_bias or {}).items():
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValidationError(
                    "logit_bias",
                    f"values must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}] (OpenAI's range), got {bias} "
                    f"for token {token}",
                )
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            # vLLM's rule, on the value's truthiness: an empty object is allowed without streaming
            raise ValidationError("stream_options", "is only allowed with stream=true")
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < -1:
                raise ValidationError("prompt_logprobs", f"must be a positive value or -1, got {self.prompt_logprobs}")
            if self.stream and self.prompt_logprobs != 0:
                raise ValidationError("prompt_logprobs", "is not available when stream=true")
        if self.use_beam_search and self.stream:
            raise ValidationError("use_beam_search", "is not available with stream=true")
        if self.use_beam_search and _constrains(self.structured_outputs_params()):
            raise ValidationError("use_beam_search", "has no output constraint: it cannot run under structured outputs")
        if self.length_penalty is not None and self.length_penalty != 1.0 and not self.use_beam_search:
            raise ValidationError("length_penalty", "applies to beam search: set use_beam_search")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar", "guidance"):
            raise ValidationError(
                "guided_decoding_backend", f"must be auto, xgrammar or guidance, got {self.guided_decoding_backend!r}"
            )
        for name, why in UNSUPPORTED_REQUEST_FIELDS.items():
            if name == "tools" and self.takes_tools():
                continue
            if not _is_neutral(name, getattr(self, name, None)):
                raise ValidationError(name, why)
        if self.takes_tools():
            self.forced_tool_choice()  # checks the tools and the choice (a forced one beside beam search: above)
        elif self.tool_choice not in (None, "none"):
            raise ValidationError("tool_choice", "tool choices are a chat request's")

    def takes_tools(self) -> bool:
        """Whether ``tools`` and ``tool_choice`` belong to this request's kind (chat's)."""
        return False

    def forced_tool_choice(self) -> ForcedToolChoice | None:
        """The tool call the reply must be (``tool_choice`` "required" or a named function); None where none is."""
        return None

    def explicit_sampling_fields(self) -> dict[str, Any]:
        """The ``SamplingParams`` keyword arguments the client set (others take the model's defaults)."""
        explicit = {name: getattr(self, name) for name in self._DIRECT if getattr(self, name) is not None}
        structured_outputs = self.structured_outputs_params()
        if structured_outputs is not None:
            explicit["structured_outputs"] = structured_outputs
        return explicit

    def structured_outputs_params(self) -> dict[str, Any] | None:
        """The output constraint as ``StructuredOutputsParams`` fields: ``structured_outputs`` as sent, with
        ``response_format``'s constraint added (vLLM's merge: ``{"type": "json_object"}`` is ``json_object``,
        ``{"type": "json_schema", "json_schema": {"schema": ...}}`` is ``json``; ``{"type": "text"}`` none).
        ``SamplingParams`` checks the result (exactly one constraint, compiling), naming ``structured_outputs.*``
        (``request_field`` turns that into ``response_format`` when the constraint came from there).

        Raises:
            ValidationError: a ``response_format`` of another type or without its schema.
        """
        fields = None if self.structured_outputs is None else dict(self.structured_outputs)
        for name, key in GUIDED_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if name == "guided_json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValidationError("guided_json", f"is not JSON: {e}") from e
            fields = fields or {}
            fields[key] = value
        response_format = self.response_format
        if response_format is None:
            return fields
        kind = response_format.get("type")
        if kind == "text":
            return fields
        fields = fields or {}
        if kind == "json_object":
            fields["json_object"] = True
        elif kind == "json_schema":
            json_schema = response_format.get("json_schema")
            schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
            if not isinstance(schema, dict):
                raise ValidationError("response_format.json_schema.schema", "must be a JSON schema object")
            fields["json"] = schema  # OpenAI's name and strict are not part of the constraint
        else:
            raise ValidationError(
                "response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}"
            )
        return fields

    def beam_search_params(self, defaults: Mapping[str, Any], max_model_len: int) -> BeamSearchParams:
        """``use_beam_search``'s parameters, as vLLM's ``to_beam_search_params``: ``n`` beams (default 1),
        ``max_tokens`` (completions: 16 unless set; chat, or null: the context, beams ending at max_model_len),
        ``temperature`` (unset: the model's default, else 1.0), ``ignore_eos``, ``length_penalty``. The other
        sampling fields do not apply to beam search (vLLM's ignores them too).

        Raises:
            ValidationError: n, max_tokens or temperature out of range (``BeamSearchParams``).
        """
        max_tokens = self.requested_max_tokens()
        temperature = self.temperature if self.temperature is not None else defaults.get("temperature", 1.0)
        return BeamSearchParams(
            beam_width=self.n if self.n is not None else 1,
            max_tokens=max_tokens if max_tokens is not None else max_model_len,
            ignore_eos=bool(self.ignore_eos),
            temperature=float(temperature),
            length_penalty=self.length_penalty if self.length_penalty is not None else 1.0,
        )

    def requested_max_tokens(self) -> int | None:
        """The request's max_tokens: None for all the room left."""
        return self.max_tokens

    def truncation(self, max_model_len: int) -> dict[str, Any] | None:
        """``truncate_prompt_tokens`` (and ``truncation_side``) as ``InputProcessor.tokenize_with``'s arguments;
        None when not set.

        Raises:
            ValidationError: a count above max_model_len (vLLM's rule), or below -1 or 0.
        """
        truncate = self.truncate_prompt_tokens
        if truncate is None:
            return None
        if truncate > max_model_len:
            raise ValidationError(
                "truncate_prompt_tokens",
                f"{truncate} cannot be greater than max_model_len={max_model_len} (vLLM's rule); -1 keeps as many "
                "as fit",
            )
        return {"truncate_prompt_tokens": truncate, "truncation_side": self.truncation_side or "left"}

    def template_tools(self) -> list[Any] | None:
        """The tools a chat template renders: a chat request's (``ChatCompletionRequest``)."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: ``continuous_usage_stats`` with ``include_usage`` (vLLM's: alone, no usage)."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: a prompt (text, token ids, or a batch of either) to continue."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the sampled token's logprob and this many most likely ones, per position
    add_special_tokens: LaxBool | None = True  # vLLM's: the tokenizer's BOS and the like on a text prompt (None: true)
    echo: LaxBool | None = False  # the prompt before each choice's text (and its logprobs before the choice's)
    suffix: str | None = None  # not implemented: refused when set

    def prompts(self) -> list[str | list[int]]:
        """The batch: one text or token-id list per prompt.

        Raises:
            ValidationError: an empty batch.
        """
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValidationError("prompt", "must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [[p for p in prompt if isinstance(p, int)]]
        return [p for p in prompt if not isinstance(p, int)]

    def requested_max_tokens(self) -> int | None:
        """max_tokens as sent; 16 when left out (OpenAI's and vLLM's), None (the room left) when sent as null."""
        if self.max_tokens is None and "max_tokens" not in self.model_fields_set:
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return self.max_tokens

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """Raises ValidationError naming the field as sent."""
        explicit = self.explicit_sampling_fields()
        explicit["max_tokens"] = self.requested_max_tokens()  # None: the room left (vLLM's get_max_tokens)
        if self.logprobs is not None:
            explicit["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:  # vLLM's: the echoed prompt's logprobs too
                explicit["prompt_logprobs"] = self.logprobs
        explicit["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return sampling_params_with_defaults(explicit, defaults)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation, rendered with the model's chat template."""

    # Checked by the InputProcessor's render_chat, which names the message and part (``messages[1].content[0]``).
    messages: list[dict[str, Any]]
    logprobs: LaxBool | None = False  # the sampled tokens' logprobs (None: false)
    top_logprobs: int | None = None  # with logprobs: this many most likely tokens per position too
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens; wins over it
    # vLLM's extras
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False  # the last (assistant) message left open for the model to continue
    add_special_tokens: LaxBool = False  # the tokenizer's BOS and the like, besides those the template renders
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template (enable_thinking, ...)
    # vLLM's: the last message's content before the reply, when the reply continues it (same role)
    echo: LaxBool | None = False
    documents: list[Any] | None = None  # for the chat template (RAG templates), as vLLM's
    reasoning_effort: str | None = None  # OpenAI's; a variable of the chat template, as vLLM passes it
    include_reasoning: LaxBool = True  # vLLM's: false drops the reasoning (--reasoning-parser); refused without one
    parallel_tool_calls: LaxBool | None = None  # OpenAI's: false, a required tool choice makes one call at most
    mm_processor_kwargs: dict[str, Any] | None = None  # not implemented: refused when set

    # The server's parsers, set by the API before the request's checks (``use_parsers``): the tool-call parser
    # (--tool-call-parser, with --enable-auto-tool-choice; None: tool_choice "auto" is refused) and the reasoning
    # parser (--reasoning-parser; None: the reply is not split, include_reasoning false is refused).
    _tool_call_parser: str | None = PrivateAttr(default=None)
    _reasoning_parser: str | None = PrivateAttr(default=None)

    def use_parsers(self, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
        """Parse an "auto" tool choice's calls with ``tool_call_parser`` and split the reply's reasoning with
        ``reasoning_parser`` (the server's; None: neither)."""
        self._tool_call_parser = tool_call_parser
        self._reasoning_parser = reasoning_parser

    def reasoning_split(self) -> str | None:
        """The reasoning parser that splits this request's reply (``reasoning.split_reasoning``): the server's;
        under an output constraint (structured outputs, a forced tool choice), whose grammar holds from the first
        token, "qwen3", which finds reasoning only where the reply opens the block itself (a JSON reply is all
        content, where deepseek_r1's rule would make an unclosed block of it)."""
        if self._reasoning_parser is None:
            return None
        return "qwen3" if _constrains(self.structured_outputs_params()) else self._reasoning_parser

    def takes_tools(self) -> bool:
        return True

    def forced_tool_choice(self) -> ForcedToolChoice | None:
        """As ``tool_calls.forced_tool_choice``, over this request's tools and choice (checked there).

        Raises:
            ValidationError: a tool or choice vLLM's ``check_tool_usage`` refuses, or "auto" without the server's
                parser (``AUTO_WHY``).
        """
        return forced_tool_choice(
            self.tools,
            self.tool_choice,
            parallel=self.parallel_tool_calls is not False,
            auto=self._tool_call_parser is not None,
            sent="tool_choice" in self.model_fields_set,
        )

    def tool_calls_mode(self) -> ForcedToolChoice | AutoToolChoice | None:
        """How the reply's tool calls are made: forced (``forced_tool_choice``), parsed out of the reply (tools
        with tool_choice "auto", vLLM's default, on a server with a parser), or None (no call).

        Raises:
            ValidationError: as ``forced_tool_choice``.
        """
        forced = self.forced_tool_choice()
        if forced is not None:
            return forced
        if self._tool_call_parser is not None and self.tools and self.tool_choice in (None, "auto"):
            return AutoToolChoice(self._tool_call_parser, parallel=self.parallel_tool_calls is not False)
        return None

    def tool_schema_field(self) -> str:
        """The field whose JSON schema a forced tool choice's constraint is: the named function's
        ``tools[i].function.parameters``, or ``tools`` (a required choice's schema holds every tool's)."""
        name = self.tool_choice.get("function", {}).get("name") if isinstance(self.tool_choice, dict) else None
        for i, tool in enumerate(self.tools or []):
            if name is not None and isinstance(tool, dict) and (tool.get("function") or {}).get("name") == name:
                return f"tools[{i}].function.parameters"
        return "tools"

    def template_tools(self) -> list[Any] | None:
        """The tools, rendered as vLLM renders them: under tool_choice "none" (no call asked for) and under a forced
        choice (the call's schema constrains the reply; the template tells the model of the tools)."""
        return self.tools or None

    def structured_outputs_params(self) -> dict[str, Any] | None:
        """``SamplingRequest``'s constraint; under a forced tool choice, the call's JSON schema instead
        (``ForcedToolChoice.schema``), with structured outputs' options (``disable_any_whitespace``) kept.

        Raises:
            ValidationError: a forced tool choice beside another constraint (response_format, structured_outputs
                or a guided_* field).
        """
        fields = super().structured_outputs_params()
        forced = self.forced_tool_choice()
        if forced is None:
            return fields
        other = _constraint_kinds(fields)
        if other:
            raise ValidationError(
                "tool_choice",
                f"a {forced.describe()} constrains the reply to the call's JSON; it cannot be combined with another "
                f"constraint (structured_outputs.{other[0]}, from response_format, structured_outputs or guided_*)",
            )
        return {**(fields or {}), "json": forced.schema()}

    def template_variables(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with ``reasoning_effort`` added when set (vLLM's), the kwargs winning.

        Raises:
            ValidationError: ``include_reasoning`` false without the server's reasoning parser (nothing splits the
                reply).
        """
        if not self.include_reasoning and self._reasoning_parser is None:
            raise ValidationError(
                "include_reasoning", "false needs the server's reasoning parser (--reasoning-parser), which is off"
            )
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """Raises ValidationError naming the field as sent."""
        if self.top_logprobs is not None and self.top_logprobs != 0 and not self.logprobs:
            raise ValidationError("top_logprobs", "needs logprobs=true")  # 0 is vLLM's default: allowed alone
        if self.continue_final_message and self.add_generation_prompt:
            raise ValidationError(
                "continue_final_message", "cannot be true with add_generation_prompt=true (vLLM's rule)"
            )
        explicit = self.explicit_sampling_fields()
        max_tokens = self.requested_max_tokens()
        if max_tokens is not None:
            explicit["max_tokens"] = max_tokens
        elif defaults.get("max_tokens") is None:
            # Unset and no model default: all the room left within max_model_len (vLLM's chat; the
            # InputProcessor sizes it once the prompt is known), not SamplingParams' 16.
            explicit["max_tokens"] = None
        if self.logprobs:
            explicit["logprobs"] = self.top_logprobs or 0
        if isinstance(self.tool_calls_mode(), AutoToolChoice):
            explicit["skip_special_tokens"] = False  # vLLM's parsers': call tags may be special tokens
        explicit["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        return sampling_params_with_defaults(explicit, defaults)

    def echoed(self) -> str:
        """What ``echo`` puts before the reply (vLLM's): the last message's text when the reply is in its role
        (``response_role``), else nothing."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or not isinstance(last, dict) or last.get("role") != self.response_role():
            return ""
        content = last.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, list):  # its text parts, as the template saw them joined
            texts = [p if isinstance(p, str) else p.get("text") for p in content if isinstance(p, str | dict)]
            return "\n".join(t for t in texts if isinstance(t, str))
        return ""

    def response_role(self) -> str:
        """The role of the reply (vLLM's ``get_chat_request_role``): the assistant's after a generation prompt,
        else the last message's (the message the model continues)."""
        last = self.messages[-1] if self.messages else None
        if self.add_generation_prompt or not isinstance(last, dict):
            return "assistant"
        return str(last.get("role", "assistant"))

    def messages_for_template(self) -> list[dict[str, Any]]:
        """The messages as ``render_chat`` takes them: a null content (an assistant turn that called tools) is
        empty text; every other key is kept as sent (the chat template may read ``name`` and the like)."""
        messages: list[dict[str, Any]] = []
        for message in self.messages:
            if isinstance(message, dict) and message.get("content", "") is None:
                message = {**message, "content": ""}
            messages.append(message)
        return messages


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``): a prompt, or chat
    messages rendered with the chat template under the chat API's rendering fields."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    # the tokenizer's BOS and the like: by default on a prompt, not on messages (their template renders them)
    add_special_tokens: LaxBool | None = None
    return_token_strs: LaxBool = False
    # for messages, as the chat API's
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # rendered as a chat with them renders them (vLLM's TokenizeChatRequest)

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens: as set, else on a prompt and not on messages."""
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None

    def check_rendering(self) -> None:
        """Raises ValidationError for both add_generation_prompt and continue_final_message (vLLM's rule), and for
        a malformed tool (``check_tools``)."""
        if self.messages is not None and self.continue_final_message and self.add_generation_prompt:
            raise ValidationError(
                "continue_final_message", "cannot be true with add_generation_prompt=true (vLLM's rule)"
            )
        if self.tools:
            check_tools(self.tools)

    def template_tools(self) -> list[Any] | None:
        return self.tools or None


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings`` (OpenAI's body, vLLM's ``EmbeddingCompletionRequest``): ``input`` is one text, a
    list of texts, one token-id list or a list of them; vLLM's extra ``truncate_prompt_tokens``, ``normalize``
    and ``pooling_type`` (ours) too. Or, instead of ``input``, vLLM's ``EmbeddingChatRequest``: ``messages``, one
    conversation rendered with the chat template (``add_generation_prompt`` false and ``add_special_tokens`` false
    unless set, as vLLM's), embedded as one input."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's chat embeddings; checked by the InputProcessor's render_chat, as chat's
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: LaxBool = False
    continue_final_message: LaxBool = False
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # ignored, as vLLM ignores it
    truncate_prompt_tokens: int | None = None
    normalize: LaxBool | None = None
    pooling_type: Literal["LAST", "MEAN", "CLS"] | None = None
    priority: int = 0
    add_special_tokens: LaxBool | None = True  # vLLM's: the tokenizer's BOS and the like on a text input (None: true)
    request_id: str | None = None  # vLLM's: the response's id is embd- and this (default: a uuid)
    # vLLM's base64 encodings: only its defaults are implemented (refused otherwise, ``check_unsupported``).
    embed_dtype: str | None = None
    endianness: str | None = None

    def check_unsupported(self) -> None:
        """Raises ValidationError naming an encoding vLLM offers that this server does not: ``embed_dtype`` other
        than float32, ``endianness`` other than little (or vLLM's "native" on a little-endian host)."""
        if self.embed_dtype not in (None, "float32"):
            raise ValidationError("embed_dtype", f"only float32 is supported, got {self.embed_dtype!r}")
        if self.endianness not in (None, "little", "native") or (
            self.endianness == "native" and sys.byteorder != "little"
        ):
            raise ValidationError("endianness", f"only little-endian is supported, got {self.endianness!r}")

    def prompts(self) -> list[str | list[int]]:
        """The inputs: one text or token-id list each (``messages``: none here, the caller renders them).

        Raises:
            ValidationError: an empty ``input`` list; both ``input`` and ``messages``, or neither.
        """
        value = self.input
        if self.messages is not None:
            if value is not None:
                raise ValidationError("messages", "give input or messages, not both")
            return []
        if value is None:
            raise ValidationError("input", "is required (or messages, for a conversation)")
        if isinstance(value, str):
            return [value]
        if not value:
            raise ValidationError("input", "must not be empty")
        if all(isinstance(p, int) for p in value):
            return [[p for p in value if isinstance(p, int)]]
        return [p for p in value if not isinstance(p, int)]

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(
            pooling_type=self.pooling_type,
            normalize=self.normalize,
            dimensions=self.dimensions,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
        )


def request_field(field: str, request: SamplingRequest) -> str:
    """The field a ``ValidationError`` about ``SamplingParams`` (or the prompt) names, as the client sent it:
    chat's ``top_logprobs`` and ``max_completion_tokens``, chat's rendered prompt as ``messages``, a constraint
    from ``response_format`` as that, beam search's width as ``n``."""
    if field == "beam_width":
        return "n"
    for name, key in GUIDED_FIELDS.items():
        constraint = f"{STRUCTURED_OUTPUTS_FIELD}.{key}"
        if getattr(request, name) is not None and (field == constraint or field.startswith(constraint + "[")):
            return name + field.removeprefix(constraint)
    if request.response_format is not None:
        kind = str(request.response_format.get("type"))
        from_format = {"json_object": "json_object", "json_schema": "json"}.get(kind)
        if from_format is not None and field == f"{STRUCTURED_OUTPUTS_FIELD}.{from_format}":
            return "response_format"  # the constraint came from there
    if isinstance(request, ChatCompletionRequest):
        if field == f"{STRUCTURED_OUTPUTS_FIELD}.json" and _forces_a_call(request):
            return request.tool_schema_field()  # the constraint is the tool call's schema
        if field == "logprobs":
            return "top_logprobs"
        if field == "max_tokens" and request.max_completion_tokens is not None:
            return "max_completion_tokens"
        if field == "prompt":
            return "messages"
    elif field.startswith("prompt_token_ids"):  # the prompt as token ids, as the client sent them
        return field.replace("prompt_token_ids", "prompt", 1)
    return field


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter`` body (its ``lora_int_id`` is ignored: adapters go by name)."""

    lora_name: str
    lora_int_id: int | None = None


def _forces_a_call(request: ChatCompletionRequest) -> bool:
    """Whether ``request``'s tool choice forces a call (its JSON schema is then the reply's constraint)."""
    try:
        return request.forced_tool_choice() is not None
    except ValidationError:
        return False


def _constraint_kinds(fields: Mapping[str, Any] | None) -> list[str]:
    """The constraints (json, regex, ...) structured outputs' ``fields`` hold, besides their options."""
    return [kind for kind in STRUCTURED_OUTPUT_KINDS if (fields or {}).get(kind) not in (None, False)]


def _constrains(fields: Mapping[str, Any] | None) -> bool:
    """Whether structured outputs' ``fields`` hold a constraint, not only options."""
    return bool(_constraint_kinds(fields))
