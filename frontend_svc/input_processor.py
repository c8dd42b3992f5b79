"""Prompts and parameters in, ``EngineCoreRequest`` out (vLLM ``InputProcessor``): tokenization, chat
templates, checks against the model, and EOS / generation-config stop ids folded in."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from frontend_svc.chars_per_token import max_chars_per_token
from frontend_svc.chat_content_format import CONTENT_FORMATS, detect_content_format
from frontend_svc.engine_types import EngineCoreRequest, EngineInfo, LoRARequest, MultiModalFeature
from frontend_svc.errors import ValidationError
from frontend_svc.mm_processor import IMAGE, SUPPORTED_MODEL_TYPES, EncodedImage, MultiModalProcessor, image_from_url
from frontend_svc.sampling_params import INT32_MAX, SamplingParams, bad_words_token_ids
from frontend_svc.tokenize_budget import TokenizeBudget, budget_bytes_of_memory, utf8_size
from splitserve.base.pooling_params import PoolingParams, pooling_params_violation
from splitserve.base.request_rules import max_tokens_violation, prompt_violation
from splitserve.base.sampling_rules import eos_and_stop_ids


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings beside the prompt and the sampling parameters."""

    arrival_time: float | None = None  # seconds since the epoch; None: now
    priority: int = 0  # lower is served first under the priority policy
    cache_salt: str | None = None  # isolates the request's prefix-cache entries
    trace_headers: dict[str, str] | None = None  # W3C traceparent / tracestate for the core's spans
    lora_request: LoRARequest | None = None  # the LoRA adapter to generate with; None: the base model


def check_options(options: RequestOptions) -> None:
    """Refuse, naming the field, what the wire to the core cannot carry: every conversion to protobuf that could
    raise ("Value out of range", a wrong type, text that is not UTF-8) is checked here, before anything is sent.

    Raises:
        ValidationError: priority outside int32, arrival_time not a finite number, cache_salt not a string or empty,
            trace_headers not a map of strings, or a string with lone surrogates.
    """
    priority, arrival_time = options.priority, options.arrival_time
    if (
        not (isinstance(priority, int) and not isinstance(priority, bool))
        or not -INT32_MAX - 1 <= priority <= INT32_MAX
    ):
        raise ValidationError("priority", f"must be a 32-bit integer, got {priority!r}")
    if arrival_time is not None and (
        not isinstance(arrival_time, int | float) or isinstance(arrival_time, bool) or not math.isfinite(arrival_time)
    ):
        raise ValidationError(
            "arrival_time", f"must be a finite number of seconds since the epoch, got {arrival_time!r}"
        )
    if options.cache_salt is not None:
        check_wire_string(options.cache_salt, "cache_salt")
        if not options.cache_salt:
            # vLLM's OpenAI layer refuses it too; the core would hash an empty salt as none (vLLM's rule)
            raise ValidationError("cache_salt", "must be a non-empty string when set")
    lora = options.lora_request
    if lora is not None:
        if not isinstance(lora, LoRARequest):
            raise ValidationError("lora_request", f"must be a LoRARequest, got {type(lora).__name__}")
        check_wire_string(lora.lora_name, "lora_request.lora_name")
        check_wire_string(lora.lora_path, "lora_request.lora_path")
        if not lora.lora_name:
            raise ValidationError("lora_request.lora_name", "must not be empty")
        if not (isinstance(lora.lora_int_id, int) and 0 <= lora.lora_int_id <= INT32_MAX):
            raise ValidationError("lora_request.lora_int_id", f"must be an int in [0, 2^31), got {lora.lora_int_id!r}")
    headers = options.trace_headers
    if headers is not None:
        if not isinstance(headers, Mapping):
            raise ValidationError("trace_headers", f"must map strings to strings, got {type(headers).__name__}")
        for key, value in headers.items():
            check_wire_string(key, "trace_headers")
            check_wire_string(value, f"trace_headers[{key!r}]")


def check_wire_string(value: Any, field: str) -> None:
    """A string protobuf can carry: a ``str`` that encodes to UTF-8 (no lone surrogates).

    Raises:
        ValidationError: naming ``field``.
    """
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    try:
        value.encode()
    except UnicodeEncodeError as e:
        raise ValidationError(field, f"is not valid Unicode text ({e.reason} at position {e.start})") from None


# How to ask for all the room left, in the gRPC and Python APIs' words (the HTTP API words it its own way).
MAX_TOKENS_HINT = " (max_tokens=None, max_tokens_unlimited over gRPC, takes all the room left)"


class TextPrompt(TypedDict, total=False):
    prompt: str
    multi_modal_data: dict[str, Any]  # vLLM's: {"image": a PIL image or EncodedImage, or a list of them}


# Message keys besides role and content that reach the chat template (vLLM's _parse_chat_message_content).
# Content part types read as text, and the key holding the text (vLLM's chat utils).
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}

# apply_chat_template's own arguments (and the template's conversation variable): not template variables.
_RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tools",
        "documents",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
    }
)


# Rendering arguments ``chat_template_kwargs`` may set too, over the request's own fields (vLLM's chat server
# updates its rendering arguments with the request's chat_template_kwargs).
_OVERRIDABLE_ARGUMENTS = frozenset({"add_generation_prompt", "continue_final_message", "tools", "documents"})


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # optional text, echoed in outputs
    multi_modal_data: dict[str, Any]  # as TextPrompt's
    mm_features: list[MultiModalFeature]  # set by ``process_multimodal``: prompt_token_ids are then expanded


PromptType = str | list[int] | TextPrompt | TokensPrompt
ChatMessage = dict[str, Any]  # {"role": ..., "content": str or [{"type": "text", "text": ...}]}

# A text of more than (max_model_len - 1) times this many UTF-8 bytes is refused before tokenizing, whatever the
# tokenizer: tokenizing costs memory per token and a text can have a token per byte, so this bounds what one
# prompt can cost (``tokenize_budget``). Text averages 2 to 4 bytes per token (English, code, JSON with the
# Llama 2 and GPT-2 tokenizers); a prompt refused by this bound but short enough in tokens would need tokens of
# over 32 bytes on average, such as long runs of one character.
MAX_BYTES_PER_TOKEN = 32


class InputProcessor:
    """Validates requests against the model the core serves and builds core requests."""

    def __init__(
        self, tokenizer: Any, engine_info: EngineInfo, mm_processor: MultiModalProcessor | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.info = engine_info
        self.mm_processor = mm_processor  # None: a text-only model, images are refused
        # Characters one token covers at most (None: no sound bound for this tokenizer), computed once.
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.budget = TokenizeBudget()  # what the server tokenizes at once (``tokenize_async``)
        # --chat-template (a server's): the template of chats that bring none, over the tokenizer's and processor's
        self.default_chat_template: str | None = None
        self.default_content_format = "auto"  # --chat-template-content-format: render_chat's "auto"
        # max_tokens past max_model_len cut to the room left (the offline LLM's, as vLLM's), not refused
        self.cap_max_tokens = False
        eos_ids = list(engine_info.eos_token_ids)
        if not eos_ids and getattr(tokenizer, "eos_token_id", None) is not None:
            eos_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = eos_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids). Text is tokenized with the tokenizer's special tokens (BOS).

        Raises:
            ValidationError: a prompt of another type, token ids that are not integers, or a text too long to
                fit within max_model_len whatever its tokens (refused before tokenizing).
        """
        if isinstance(prompt, str):
            self.check_text_length(prompt, "prompt", "the prompt")
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            # The caller's dict, checked here. To mypy a TokensPrompt is a TextPrompt (it has every key of one).
            fields: Mapping[str, Any] = prompt
            if "prompt_token_ids" in fields:
                return fields.get("prompt"), self._check_int_ids(fields["prompt_token_ids"])
            if "prompt" in fields:
                return self.tokenize(fields["prompt"])
            raise ValidationError("prompt", "a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, list | tuple):
            return None, self._check_int_ids(prompt)
        raise ValidationError("prompt", f"must be text or a list of token ids, got {type(prompt).__name__}")

    def tokenize_with(self, prompt: PromptType, tokenization_kwargs: Mapping[str, Any]) -> PromptType:
        """A text prompt (or a ``{"prompt"}`` dict) as a ``TokensPrompt`` tokenized with the tokenizer's keyword
        arguments ``tokenization_kwargs`` (vLLM's: ``add_special_tokens``, truncation); token ids as they are.
        vLLM's ``truncate_prompt_tokens`` among them keeps the last that many tokens of any prompt, text or ids
        (-1: max_model_len - 1, the most that leave room for an output token).

        Raises:
            ValidationError: a prompt with ``multi_modal_data`` (its placeholders are expanded as it is
                tokenized), a tokenizer refusing the arguments, a ``truncate_prompt_tokens`` other than -1 or a
                positive count, or as ``tokenize``.
        """
        fields: Mapping[str, Any] = prompt if isinstance(prompt, dict) else {}
        if "multi_modal_data" in fields:
            raise ValidationError("tokenization_kwargs", "is not supported with multi_modal_data")
        kwargs = dict(tokenization_kwargs)
        truncate = kwargs.pop("truncate_prompt_tokens", None)
        side = kwargs.pop("truncation_side", "left")  # vLLM's: which end truncate_prompt_tokens cuts
        if side not in ("left", "right"):
            raise ValidationError("truncation_side", f"must be 'left' or 'right', got {side!r}")
        if truncate is not None and (
            not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < -1 or truncate == 0
        ):
            raise ValidationError("truncate_prompt_tokens", f"must be -1 or a positive count, got {truncate!r}")
        text = prompt_text(prompt)
        if "prompt_token_ids" in fields or not isinstance(text, str):
            if truncate is None:
                return prompt
            _, token_ids = self.tokenize(prompt)
        else:
            if truncate is None:  # a text too long to fit is refused before tokenizing, unless it is cut
                self.check_text_length(text, "prompt", "the prompt")
            try:
                token_ids = list(self.tokenizer(text, **kwargs).input_ids)
            except TypeError as e:
                raise ValidationError("tokenization_kwargs", f"the tokenizer refused them: {e}") from e
        if truncate is not None:
            keep = self.info.max_model_len - 1 if truncate == -1 else truncate
            token_ids = token_ids[-keep:] if side == "left" else token_ids[:keep]
        result = TokensPrompt(prompt_token_ids=token_ids)
        if text is not None:
            result["prompt"] = text
        return result

    async def tokenize_async(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``tokenize`` on a worker thread, within ``budget`` (a text too long is refused before it waits).

        Raises:
            ValidationError: as ``tokenize``.
        """
        text = prompt_text(prompt)
        if not isinstance(text, str) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            return self.tokenize(prompt)  # token ids: nothing to tokenize
        self.check_text_length(text, "prompt", "the prompt")
        return await self.budget.run(utf8_size(text), lambda: self.tokenize(prompt))

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        *,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        documents: list[Any] | None = None,
        content_format: str = "auto",
    ) -> TokensPrompt:
        """Render a conversation with the tokenizer's chat template (transformers' ``apply_chat_template``).
        ``continue_final_message`` leaves the last message open (no end-of-turn) for the model to continue;
        ``add_special_tokens`` adds the tokenizer's own (BOS) to what the template rendered; ``tools`` (function
        schemas) and ``chat_template_kwargs`` (more variables: ``enable_thinking``, ...) go to the template, as
        vLLM's chat takes them.

        A message's text parts are joined with newlines, as vLLM, llama.cpp and TensorRT-LLM join them, unless the
        template takes them as parts (``content_format`` "openai", or "auto" and a template that loops over a
        message's content: ``chat_content_format``); then every message's content is a list of
        {"type": "text", "text"} parts. ``documents`` go to the template (RAG templates). In
        ``chat_template_kwargs``, the rendering arguments add_generation_prompt, continue_final_message, tools and
        documents override the fields given (vLLM's order).

        A message with images keeps its parts ({"type": "text"} and {"type": "image"}, as transformers'
        processors' chat templates take them) and the result carries the images in order as
        ``multi_modal_data`` (decoded and expanded by ``process_multimodal``); a multimodal model renders with its
        processor's chat template when it has one.

        Raises:
            ValidationError: a malformed message, a part neither text nor image, an image URL that is not a
                data: URI, images for a text-only model, a tokenizer without a chat template, a
                ``chat_template_kwargs`` key that names one of the arguments above, or a rendered conversation too
                long to fit within max_model_len (refused before tokenizing).
        """
        if not isinstance(messages, list) or not messages:
            raise ValidationError("messages", "must be a non-empty list of {'role', 'content'} messages")
        template_kwargs = dict(chat_template_kwargs or {})
        for key in template_kwargs:
            if key in _RENDER_ARGUMENTS and key not in _OVERRIDABLE_ARGUMENTS:
                raise ValidationError(
                    f"chat_template_kwargs.{key}", "is an argument of the rendering itself, not a template variable"
                )
        add_generation_prompt = bool(template_kwargs.pop("add_generation_prompt", add_generation_prompt))
        continue_final_message = bool(template_kwargs.pop("continue_final_message", continue_final_message))
        tools = template_kwargs.pop("tools", tools)
        documents = template_kwargs.pop("documents", documents)
        images: list[Any] = []
        normalized = [self._check_message(i, m, images) for i, m in enumerate(messages)]
        if images and self.mm_processor is None:
            raise _no_images_error(_images_field(images))  # before a text model's template sees image parts
        if chat_template is None:
            chat_template = self.default_chat_template
        if content_format == "auto":
            content_format = self.default_content_format
        if self.mm_processor is not None and chat_template is None:
            # A multimodal model's template is the processor's (chat_template.jinja beside
            # preprocessor_config.json) when it has one, as transformers' processor.apply_chat_template picks it;
            # it renders {"type": "image"} parts.
            chat_template = getattr(self.mm_processor.processor, "chat_template", None)
        template = _template_text(chat_template or getattr(self.tokenizer, "chat_template", None), tools)
        if template is None:
            raise ValidationError(
                "messages",
                "the model's tokenizer has no chat template: start the server with --chat-template (or pass "
                "chat_template)",
            )
        if content_format not in CONTENT_FORMATS:
            raise ValidationError(
                "chat_template_content_format", f"must be one of {', '.join(CONTENT_FORMATS)}, got {content_format!r}"
            )
        # Multimodal templates iterate over a message's parts (LLaVA's selects the image parts, then the text
        # ones): with images every message takes the parts form, as vLLM's "openai" content format.
        as_parts = bool(images) or (
            detect_content_format(template) == "openai" if content_format == "auto" else content_format == "openai"
        )
        normalized = [_content_as(m, as_parts) for m in normalized]
        if "developer" not in template:  # OpenAI's newer name of the system role, for templates that lack it
            normalized = [{**m, "role": "system"} if m["role"] == "developer" else m for m in normalized]
        try:
            text = self.tokenizer.apply_chat_template(
                normalized,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                documents=documents,
                **template_kwargs,
            )
        except Exception as e:  # jinja errors raised by the template itself (e.g. role order)
            raise ValidationError("messages", f"the chat template refused the conversation: {e}") from e
        self.check_text_length(text, "prompt", "the rendered conversation")
        # The rendered text already holds BOS and other special tokens: not added again unless asked for.
        token_ids = self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids
        prompt = TokensPrompt(prompt=text, prompt_token_ids=token_ids)
        if images:
            prompt["multi_modal_data"] = {IMAGE: images}
        return prompt

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Tokenize, check against the model and resolve the parameters. ``params`` is not modified.

        Returns:
            The core request (its params resolved: max_tokens set, EOS and generation-config stop ids folded in)
            and the prompt text (None for token-id prompts).

        Raises:
            ValidationError: empty prompt, no room for one output token within max_model_len, prompt plus
                max_tokens over max_model_len, token ids outside the vocabulary, min_tokens above the derived
                max_tokens, an option the wire cannot carry (``check_options``), or a parameter wrong for this
                model.
        """
        options = options or RequestOptions()
        check_options(options)
        prompt = self.process_multimodal(prompt)
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        mm_features: list[MultiModalFeature] = []
        if isinstance(prompt, dict):
            processed: Mapping[str, Any] = prompt
            mm_features = list(processed.get("mm_features", []))
        self._check_prompt(prompt_token_ids)
        resolved = params.clone()
        resolved.max_tokens = self._resolve_max_tokens(len(prompt_token_ids), params)
        if resolved.min_tokens > resolved.max_tokens:
            room = self.info.max_model_len - len(prompt_token_ids)
            source = "the room left within max_model_len" if resolved.max_tokens == room else "the model's default"
            raise ValidationError(
                "min_tokens",
                f"{resolved.min_tokens} is above the derived max_tokens {resolved.max_tokens} ({source})",
            )
        if resolved.bad_words:
            resolved.bad_words_token_ids = bad_words_token_ids(self.tokenizer, resolved.bad_words)
        resolved.verify(self.info.vocab_size, self.info.max_logprobs)
        if self.eos_token_ids:
            resolved.eos_token_id, resolved.stop_token_ids = eos_and_stop_ids(
                self.eos_token_ids, resolved.stop_token_ids or [], resolved.ignore_eos
            )
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=resolved,
            arrival_time=time.time() if options.arrival_time is None else options.arrival_time,
            priority=options.priority,
            cache_salt=options.cache_salt,
            trace_headers=dict(options.trace_headers or {}),
            mm_features=mm_features,
            lora_request=options.lora_request,
        )
        return request, prompt_text

    def process_pooling_inputs(
        self, request_id: str, prompt: PromptType, params: PoolingParams, options: RequestOptions | None = None
    ) -> tuple[EngineCoreRequest, str | None]:
        """A pooling request (vLLM's ``InputProcessor.process_inputs`` with ``PoolingParams``): tokenize, cut the
        prompt to its last ``truncate_prompt_tokens`` tokens (-1: max_model_len - 1; vLLM truncates on the left),
        check it against the model. Images are refused (a text pooling request). ``params`` is not modified.

        Raises:
            ValidationError: naming the field: a bad parameter (``pooling_params_violation``), a
                ``truncate_prompt_tokens`` above max_model_len, an empty prompt, one too long for max_model_len, ids
                outside the vocabulary, images, an option the wire cannot carry.
        """
        if not isinstance(params, PoolingParams):
            raise ValidationError("pooling_params", f"must be a PoolingParams, got {type(params).__name__}")
        violation = pooling_params_violation(params)
        if violation is not None:
            raise ValidationError.from_violation(violation)
        options = options or RequestOptions()
        check_options(options)
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise ValidationError("multi_modal_data", "pooling requests take text or token ids only")
        prompt_text, prompt_token_ids = self.tokenize(prompt)
        truncate = params.truncate_prompt_tokens
        if truncate is not None and truncate > self.info.max_model_len:
            raise ValidationError(
                "truncate_prompt_tokens",
                f"{truncate} cannot be greater than max_model_len={self.info.max_model_len} (vLLM's rule); -1 keeps "
                "as many as fit",
            )
        if truncate is not None:
            keep = self.info.max_model_len - 1 if truncate == -1 else truncate
            prompt_token_ids = prompt_token_ids[-keep:]
        self._check_prompt(prompt_token_ids, pooling=True)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=None,
            pooling_params=params.clone(),
            arrival_time=time.time() if options.arrival_time is None else options.arrival_time,
            priority=options.priority,
            cache_salt=options.cache_salt,
            trace_headers=dict(options.trace_headers or {}),
            lora_request=options.lora_request,
        )
        return request, prompt_text

    def process_multimodal(self, prompt: PromptType) -> PromptType:
        """A prompt with ``multi_modal_data`` as a ``TokensPrompt`` with its image placeholders expanded and its
        ``mm_features`` (``MultiModalProcessor.process``); any other prompt as it is.

        Raises:
            ValidationError: naming the field ("images" of Generate, "messages" of Chat, else
                "multi_modal_data"): a modality other than image, images for a text-only model, or as
                ``MultiModalProcessor.process`` and ``tokenize``.
        """
        if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            return prompt
        fields: Mapping[str, Any] = prompt
        images = _images_of(fields["multi_modal_data"])
        field = _images_field(images)
        text_or_ids = TokensPrompt()  # the prompt without its images, for ``tokenize`` to check
        if "prompt" in fields:
            text_or_ids["prompt"] = fields["prompt"]
        if "prompt_token_ids" in fields:
            text_or_ids["prompt_token_ids"] = fields["prompt_token_ids"]
        if not images:
            return self._as_tokens_prompt(*self.tokenize(text_or_ids))
        if self.mm_processor is None:
            raise _no_images_error(field)
        # Before the prompt is tokenized; within the core's limit too.
        self.mm_processor.check_count(len(images), field, self.info.image_limit_per_prompt)
        text, token_ids = self.tokenize(text_or_ids)
        token_ids, features = self.mm_processor.process(token_ids, images, field)
        result = self._as_tokens_prompt(text, token_ids)
        result["mm_features"] = features
        return result

    async def process_multimodal_async(self, prompt: PromptType) -> PromptType:
        """``process_multimodal`` on a worker thread (images decode and resize there), the prompt's text and its
        images' estimated memory (``preprocess_memory_bytes``) within ``budget``. The estimate reads every image's
        header on a thread of its own (``asyncio.to_thread``: up to 999 headers take a few hundred milliseconds,
        which would stall every other stream on the event loop), before the budget is taken.

        Raises:
            ValidationError: as ``process_multimodal``; a bad image (any of them, the last too) before anything is
                decoded or waits for the budget.
        """
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str):
            self.check_text_length(text, "prompt", "the prompt")
        size = utf8_size(text) if isinstance(text, str) else 0
        size += budget_bytes_of_memory(await asyncio.to_thread(self.preprocess_memory_bytes, prompt))
        return await self.budget.run(size, lambda: self.process_multimodal(prompt))

    def preprocess_memory_bytes(self, prompt: PromptType) -> int:
        """The memory processing the prompt's images takes (``MultiModalProcessor.preprocess_memory_bytes``, from
        their headers), for the budget; 0 when there are none or the model takes none (``process_multimodal``
        then says why).

        Raises:
            ValidationError: naming the field: more images than ``--limit-mm-per-prompt`` (before any header is
                read), or an image refused from its header (``MultiModalProcessor.check_headers``). A refused
                image is never charged 0 and processed after the others: the request is refused whole, here.
        """
        if self.mm_processor is None or not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            return 0
        images = _images_of(prompt["multi_modal_data"])
        field = _images_field(images)
        # Before opening 999+ headers.
        self.mm_processor.check_count(len(images), field, self.info.image_limit_per_prompt)
        return self.mm_processor.preprocess_memory_bytes(images, field)

    @staticmethod
    def _as_tokens_prompt(text: str | None, token_ids: list[int]) -> TokensPrompt:
        result = TokensPrompt(prompt_token_ids=token_ids)
        if text is not None:
            result["prompt"] = text
        return result

    @property
    def max_prompt_chars(self) -> int | None:
        """The longest text (in characters) that can tokenize to fewer than max_model_len tokens: longer texts
        are refused before tokenizing. None: no sound bound for this tokenizer (``chars_per_token``)."""
        if self.max_chars_per_token is None:
            return None
        return (self.info.max_model_len - 1) * self.max_chars_per_token

    @property
    def max_prompt_bytes(self) -> int:
        """The largest text (in UTF-8 bytes) tokenized for a prompt, whatever the tokenizer: (max_model_len - 1) *
        ``MAX_BYTES_PER_TOKEN``."""
        return (self.info.max_model_len - 1) * MAX_BYTES_PER_TOKEN

    def check_text_length(self, text: str, field: str, what: str) -> None:
        """Refuse, without tokenizing it, a text that has at least max_model_len tokens whatever they are, or that
        is larger than ``max_prompt_bytes``.

        Raises:
            ValidationError: naming ``field``; ``what`` says which text it was.
        """
        max_model_len = self.info.max_model_len
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise ValidationError(
                field,
                f"{what} has {len(text)} characters, more than any prompt that fits within "
                f"max_model_len={max_model_len} can have ({limit}: {max_model_len - 1} "
                f"tokens of at most {self.max_chars_per_token} characters each)",
            )
        max_bytes = self.max_prompt_bytes
        if len(text) > max_bytes or (4 * len(text) > max_bytes and utf8_size(text) > max_bytes):
            raise ValidationError(
                field,
                f"{what} has {utf8_size(text)} bytes (UTF-8), more than this server tokenizes for a prompt within "
                f"max_model_len={max_model_len} ({max_bytes}: {max_model_len - 1} tokens of "
                f"{MAX_BYTES_PER_TOKEN} bytes, where text averages 2 to 4 bytes per token)",
            )

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """max_tokens within max_model_len: None is all the room left, or the model's default_max_tokens capped
        to it (vLLM's servers' get_max_tokens); a value that does not fit is refused, as vLLM's servers refuse
        it (HTTP 400), or with ``cap_max_tokens`` (the offline LLM, as vLLM's) cut to the room left."""
        room = self.info.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            return room if params.default_max_tokens is None else min(params.default_max_tokens, room)
        violation = max_tokens_violation(params.max_tokens, num_prompt_tokens, self.info.max_model_len)
        if violation is not None and self.cap_max_tokens:
            return room  # the offline LLM's: the output stops at max_model_len ("length"), as vLLM's LLM
        if violation is not None:
            raise ValidationError(violation.field, violation.description + MAX_TOKENS_HINT)
        return params.max_tokens

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValidationError for a prompt the model cannot take (``prompt_violation``): empty, no room for an
        output token within max_model_len, an id outside the vocabulary."""
        self._check_prompt(prompt_token_ids)

    def _check_prompt(self, prompt_token_ids: list[int], pooling: bool = False) -> None:
        violation = prompt_violation(
            prompt_token_ids, self.info.max_model_len, self.info.vocab_size, "prompt", pooling=pooling
        )
        if violation is not None:
            raise ValidationError.from_violation(violation)

    @staticmethod
    def _check_int_ids(token_ids: Any) -> list[int]:
        ids = list(token_ids)
        if set(map(type, ids)) <= {int}:  # the usual case, at C speed: a long list costs the event loop little
            return ids
        for i, token_id in enumerate(ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise ValidationError(f"prompt_token_ids[{i}]", f"must be an integer token id, got {token_id!r}")
        return ids

    @staticmethod
    def _check_message(index: int, message: Any, images: list[Any]) -> ChatMessage:
        """The message as the chat template takes it, its content a list of {"type": "text", "text"} and
        {"type": "image"} parts (``_content_as`` gives it the template's form); its images are appended to
        ``images``. Text parts are OpenAI's "text", the Responses API's "input_text" / "output_text", an
        assistant's "refusal" and plain strings, as vLLM reads them; one whose text is null is left out (vLLM's).
        Besides role and content, the message keeps what vLLM's chat utils keep: a string ``name``, the call a
        tool message answers, an assistant's non-empty ``tool_calls`` (each function's ``arguments`` given as a
        JSON string turned into the object templates iterate over; one that is not a JSON object: {}), and its
        reasoning as both ``reasoning`` and ``reasoning_content``."""
        if not isinstance(message, dict) or "role" not in message:
            raise ValidationError(f"messages[{index}]", "must be a dict with a 'role' (and 'content')")
        kept: dict[str, Any] = {}
        if isinstance(message.get("name"), str):
            kept["name"] = message["name"]
        if message.get("tool_call_id") is not None:
            kept["tool_call_id"] = message["tool_call_id"]
        if message.get("tool_calls"):
            if not isinstance(message["tool_calls"], list):
                raise ValidationError(f"messages[{index}].tool_calls", "must be a list of tool calls")
            kept["tool_calls"] = [_tool_call_for_template(call) for call in message["tool_calls"]]
        reasoning = message.get("reasoning") or message.get("reasoning_content")
        if reasoning is not None:
            kept["reasoning"] = kept["reasoning_content"] = reasoning
        content = message.get("content")
        if content is None:  # an assistant turn that only called tools, or no content at all (vLLM: no parts)
            content = []
        elif isinstance(content, str):
            content = [content]
        if not isinstance(content, list):
            raise ValidationError(f"messages[{index}].content", "must be text or a list of content parts")
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            field = f"messages[{index}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif kind in _TEXT_PART_KEYS and isinstance(part, dict):
                text = part.get(_TEXT_PART_KEYS[kind])
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise ValidationError(
                        f"{field}.{_TEXT_PART_KEYS[kind]}", f"must be text, got {type(text).__name__}"
                    )
                parts.append({"type": "text", "text": text})
            elif kind in ("image_url", "image"):
                images.append(_chat_image(part, field))
                parts.append({"type": "image"})
            else:
                raise ValidationError(
                    field, f"must be a text, input_text, output_text, refusal, image_url or image part, got {kind!r}"
                )
        return {"role": message["role"], "content": parts, **kept}


def _tool_call_for_template(call: Any) -> Any:
    """A tool call as templates take it (vLLM's ``_postprocess_messages``): its function's ``arguments`` given as
    a JSON string turned into the object it encodes ({} for one that does not parse or is not an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}}


def _content_as(message: ChatMessage, as_parts: bool) -> ChatMessage:
    """``message`` (content as ``_check_message`` gives it: parts) in the template's form: the parts, or the text
    parts newline-joined into one string."""
    if as_parts:
        return message
    return {**message, "content": "\n".join(part["text"] for part in message["content"])}


def _template_text(template: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """The template text transformers renders: ``template`` itself, or of a tokenizer's named templates the
    "tool_use" one when tools are given and it exists, else "default" (transformers' ``get_chat_template``)."""
    if isinstance(template, dict):
        name = "tool_use" if tools and "tool_use" in template else "default"
        template = template.get(name)
    return template if isinstance(template, str) and template else None


def _chat_image(part: dict[str, Any], field: str) -> Any:
    """The image of a chat content part: OpenAI's {"type": "image_url", "image_url": {"url": "data:..."}} (or the
    url as a string), or {"type": "image", "image": a PIL image or EncodedImage}.

    Raises:
        ValidationError: naming ``field``: no image in it, or a URL that is not a data: URI (``image_from_url``).
    """
    if part["type"] == "image":
        if "image" not in part:
            raise ValidationError(field, "an image part needs 'image' (a PIL image or encoded bytes)")
        image = part["image"]
        return EncodedImage(image.data, image.mime_type, field) if isinstance(image, EncodedImage) else image
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ValidationError(f"{field}.image_url", "must be {'url': 'data:<mime type>;base64,...'}")
    return image_from_url(url, "", f"{field}.image_url")


def _no_images_error(field: str) -> ValidationError:
    return ValidationError(
        field,
        f"this model takes no images (only {', '.join(sorted(SUPPORTED_MODEL_TYPES))} models do, by config.json's "
        "model_type)",
    )


def prompt_text(prompt: PromptType) -> str | None:
    """A prompt's text: the prompt itself, or a dict's ``"prompt"``; None for token ids alone (or no text)."""
    if isinstance(prompt, str):
        return prompt
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    return text if isinstance(text, str) else None


def _images_of(mm_data: Any) -> list[Any]:
    """The images of vLLM's ``multi_modal_data``: {"image": one image or a list of them}.

    Raises:
        ValidationError: not a dict, or a modality other than "image".
    """
    if not isinstance(mm_data, Mapping):
        raise ValidationError(
            "multi_modal_data", f"must be a dict like {{'image': [...]}}, got {type(mm_data).__name__}"
        )
    unknown = sorted(set(mm_data) - {IMAGE})
    if unknown:
        raise ValidationError("multi_modal_data", f"only 'image' inputs are supported, got {unknown}")
    images = mm_data.get(IMAGE, [])
    return list(images) if isinstance(images, list | tuple) else [images]


def _images_field(images: list[Any]) -> str:
    """Where the request held its images, for errors about them all: an ``EncodedImage`` knows ("images[0]" of
    Generate, "messages[1].content[0]" of Chat: "images", "messages"); else vLLM's "multi_modal_data"."""
    if images and isinstance(images[0], EncodedImage):
        return images[0].field.split("[")[0]
    return "multi_modal_data"
