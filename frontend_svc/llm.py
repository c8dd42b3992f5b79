"""``LLM``: offline batch generation and chat (vLLM ``vllm/entrypoints/llm.py``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, cast

from frontend_svc.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from frontend_svc.engine_types import LoRARequest, ModelConfig
from frontend_svc.errors import ValidationError
from frontend_svc.input_processor import ChatMessage, PromptType
from frontend_svc.llm_engine import LLMEngine
from frontend_svc.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from splitserve.base.pooling_params import PoolingParams


class LLM:
    """Generate for many prompts at once; the engine batches them continuously.

    ``LLM(model=M)`` runs the core in-process; ``core_address="host:port"`` sends the requests over gRPC to a
    ``splitserve core`` (``frontend_svc.grpc_client``; several cores: "host:port,host:port", or
    "dns:///name:port" for every address a name resolves to). Close it (or use it as a context manager) to free
    the core's memory (in-process) or the connections at once; that happens anyway when the object is
    garbage-collected.

    As vLLM's ``LLM``, a ``max_tokens`` past max_model_len is cut to the room the prompt leaves: the completion
    ends there with finish reason "length" (the servers refuse such a request, as vLLM's servers answer 400).
    ``max_tokens=None`` asks for all the room left.

    Args:
        model: local Hugging Face folder or hub id.
        **kwargs: ``LLMEngine`` arguments (core_address, tokenizer, generation_config, and engine-core
            settings, which only an in-process core takes).

    Raises:
        ModelNotFoundError, ValueError, EngineDeadError: as ``LLMEngine``.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(model, **kwargs)
        self._request_counter = itertools.count()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.llm_engine.close()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's ``LLM.model_config`` (``LLMEngine.model_config``)."""
        return self.llm_engine.model_config

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``sampling_params=None`` uses: the model's generation-config defaults over vLLM's (vLLM's
        ``LLM.get_default_sampling_params``; ``generation_config="vllm"`` gives plain ``SamplingParams()``)."""
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self, output_dir: str | None = None) -> None:
        """vLLM's ``LLM.start_profile``: torch.profiler records the engine core's steps until ``stop_profile``
        (``output_dir``: where the traces go; None: the system's temporary directory, or a remote core's
        ``--profile-dir``). Raises FailedPreconditionError while a profile runs."""
        self.llm_engine.start_profile(output_dir)

    def stop_profile(self) -> list[str]:
        """Stop the profile and write it: the Chrome traces' paths, one per core (``chrome://tracing``,
        Perfetto). Raises FailedPreconditionError when none runs."""
        return self.llm_engine.stop_profile()

    def sleep(self, level: int = 1) -> None:
        """Put the engine core to sleep between uses, e.g. while an RL trainer holds the accelerator (vLLM's
        ``LLM.sleep``): level 1 drops the KV cache and the prefix cache and moves the weights to host memory;
        level 2 drops the weights too, reloaded from the checkpoint by ``wake_up``. ``generate`` raises
        ``EngineDeadError`` until ``wake_up``.

        Raises:
            ValidationError: ``level`` not 1 or 2.
            NotSupportedError: a remote core runs without ``--enable-admin-rpcs``.
        """
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` released: ``tags`` None for everything, else ``"weights"`` and / or
        ``"kv_cache"`` (vLLM's ``LLM.wake_up``; e.g. the weights alone, to update them before the KV cache takes
        memory again). Raises ValidationError for another tag."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order, each with its n completions. Arguments in
        vLLM's order.

        Args:
            prompts: one prompt or a list; a prompt is text, a list of token ids, or a {"prompt"} /
                {"prompt_token_ids"} dict, which may hold vLLM's ``"multi_modal_data": {"image": a PIL image or a
                list of them}``, one per image placeholder of the prompt (``frontend_svc.mm_processor``).
            sampling_params: one for all prompts or one per prompt (default: ``get_default_sampling_params()``,
                the model's generation-config defaults).
            use_tqdm: show vLLM's progress bar on stderr: "Processed prompts" (completions: n per prompt) with the
                estimated input and output speed in tokens/s of the requests finished so far; a callable makes
                the bar instead of ``tqdm.auto.tqdm`` (same arguments), as in vLLM.
            lora_request: the LoRA adapter to generate with, one for all prompts or one per prompt (None: the base
                model), as vLLM's; an adapter not loaded yet is loaded from its ``lora_path`` first (the ``LLM``
                needs ``enable_lora=True``).
            priority: one for all prompts or one per prompt (lower is served first under the priority policy).
            tokenization_kwargs: the tokenizer's keyword arguments for text prompts (``{"add_special_tokens":
                False}``, truncation), as vLLM's.

        Raises:
            ValidationError: a bad prompt or parameter (nothing is left running); ``tokenization_kwargs`` with a
                prompt that holds images.
            InternalError, EngineDeadError, ...: the error of the first request the core failed, refused or lost
                (``LLMEngine.step``; ``error.request_id`` is its ``RequestOutput.request_id``); the call's other
                requests are aborted: nothing of it is left running.
        """
        prompt_list = _as_prompt_list(prompts)
        if tokenization_kwargs:
            processor = self.llm_engine.input_processor
            prompt_list = [processor.tokenize_with(prompt, tokenization_kwargs) for prompt in prompt_list]
        return self._run(prompt_list, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``, ``frontend_svc.beam_search``): the best
        ``params.beam_width`` sequences of each, best first, their ``tokens`` the prompt's and the generated ones
        and their ``text`` the decode of all of them.

        Args:
            prompts: text, token ids, or {"prompt"} / {"prompt_token_ids"} dicts (with ``multi_modal_data`` too).
            params: beam width, max_tokens, ignore_eos, temperature, length_penalty.
            lora_request: one adapter for every prompt or one per prompt.
            use_tqdm: a progress bar over the steps (an upper bound: the search ends once every beam has).
            concurrency_limit: prompts searched at once (None: all).

        Raises:
            ValidationError: a bad prompt, ``2 * beam_width`` above the engine's max_logprobs, ``lora_request``
                of another length, ``concurrency_limit`` below 1.
            EngineDeadError, ...: as ``generate``.
        """
        prompt_list = list(prompts)
        lora_requests = _as_lora_list(lora_request, len(prompt_list))
        return beam_search(
            self.generate, self.llm_engine, prompt_list, params, lora_requests, use_tqdm, concurrency_limit
        )

    def chat(
        self,
        messages: list[ChatMessage] | Sequence[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        *,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation or a list of them, rendered with the tokenizer's chat template (a multimodal
        model's processor template when it has one); a message's content is text or a list of parts:
        {"type": "text", "text"}, OpenAI's {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
        (URLs are not fetched) or {"type": "image", "image": a PIL image}; a message's ``name``, ``tool_calls``
        and ``tool_call_id`` reach the template. Sampling parameters, progress bar, LoRA adapters and priority as
        ``generate``; the rendering's arguments in vLLM's order: ``continue_final_message`` leaves the last message
        open (not with ``add_generation_prompt``), ``tools`` (function schemas) and ``chat_template_kwargs`` go to
        the template. Tool calls in the output are not parsed. ``tokenization_kwargs`` (vLLM's overrides of the
        rendered text's tokenization): ``add_special_tokens`` (default False: the template renders BOS) and
        ``truncate_prompt_tokens``.

        Raises:
            ValidationError: as ``generate``; a malformed message; ``chat_template_content_format`` other than
                "auto" (the template decides: ``chat_content_format``), "string" or "openai";
                ``tokenization_kwargs`` with another key; ``mm_processor_kwargs`` (not supported).
        """
        if mm_processor_kwargs:
            raise ValidationError("mm_processor_kwargs", "is not supported")
        if continue_final_message and add_generation_prompt:
            raise ValidationError("continue_final_message", "cannot be True with add_generation_prompt=True")
        tokenization = dict(tokenization_kwargs or {})
        add_special_tokens = bool(tokenization.pop("add_special_tokens", False))
        for key in tokenization:
            if key != "truncate_prompt_tokens":
                raise ValidationError(
                    f"tokenization_kwargs.{key}", "LLM.chat takes add_special_tokens and truncate_prompt_tokens"
                )
        conversations = _as_conversation_list(messages)
        processor = self.llm_engine.input_processor
        prompts: list[PromptType] = [
            processor.render_chat(
                conversation,
                add_generation_prompt,
                chat_template,
                continue_final_message=continue_final_message,
                add_special_tokens=add_special_tokens,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
                content_format=chat_template_content_format,
            )
            for conversation in conversations
        ]
        if tokenization:
            prompts = [processor.tokenize_with(prompt, tokenization) for prompt in prompts]
        return self._run(prompts, sampling_params, use_tqdm, priority, lora_request)

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (vLLM's ``LLM.encode``): each prompt is computed once (prefill only; no token is
        sampled) and its final-layer hidden states pooled into one vector, ``output.outputs.data`` (a list of
        float32 values, ``dimensions`` or hidden_size long). Outputs come back in prompt order.

        Args:
            prompts: one prompt or a list: text, token ids, or a {"prompt"} / {"prompt_token_ids"} dict.
            pooling_params: one for all prompts or one per prompt (default ``PoolingParams()``: the core's pooler
                config, LAST pooling with normalize unless the model folder's modules.json says otherwise).
            use_tqdm, priority, lora_request, tokenization_kwargs: as ``generate``.
            truncate_prompt_tokens: vLLM's keyword, set in every prompt's pooling params (the last this many
                tokens are kept; -1: as many as fit).

        Raises:
            ValidationError: a bad prompt or parameter, naming the field (nothing is left running).
            InternalError, EngineDeadError, ...: as ``generate``.
        """
        prompt_list = _as_prompt_list(prompts)
        if tokenization_kwargs:
            processor = self.llm_engine.input_processor
            prompt_list = [processor.tokenize_with(prompt, tokenization_kwargs) for prompt in prompt_list]
        params_list = _as_pooling_params_list(pooling_params, len(prompt_list))
        if truncate_prompt_tokens is not None:
            params_list = [replace(params, truncate_prompt_tokens=truncate_prompt_tokens) for params in params_list]
        priorities = _as_priority_list(priority, len(prompt_list))
        lora_requests = _as_lora_list(lora_request, len(prompt_list))
        request_ids = self._add_all(zip(prompt_list, params_list, priorities, lora_requests, strict=True))
        outputs = self._run_engine(request_ids, len(request_ids), use_tqdm)
        return [output for output in outputs if isinstance(output, PoolingRequestOutput)]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: int | Sequence[int] | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``LLM.embed``): ``encode`` (the same arguments), each output read as
        an embedding, ``output.outputs.embedding`` (list[float])."""
        outputs = self.encode(
            prompts,
            pooling_params,
            use_tqdm=use_tqdm,
            priority=priority,
            truncate_prompt_tokens=truncate_prompt_tokens,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
        )
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., Any],
        priority: int | Sequence[int] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _as_params_list(sampling_params, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        lora_requests = _as_lora_list(lora_request, len(prompts))
        final_only = [params.clone() for params in params_list]
        for params in final_only:
            params.output_kind = RequestOutputKind.FINAL_ONLY
        request_ids = self._add_all(zip(prompts, final_only, priorities, lora_requests, strict=True))
        outputs = self._run_engine(request_ids, sum(params.n for params in params_list), use_tqdm)
        return [output for output in outputs if isinstance(output, RequestOutput)]

    def _add_all(
        self, requests: Iterable[tuple[PromptType, SamplingParams | PoolingParams, int, LoRARequest | None]]
    ) -> list[str]:
        """Add each (prompt, params, priority, LoRA request) under a new id; returns the ids. One refused aborts
        those added before it (nothing is left running) and raises."""
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for prompt, params, priority, lora_request in requests:
                request_id = str(next(self._request_counter))
                engine.add_request(request_id, prompt, params, priority=priority, lora_request=lora_request)
                request_ids.append(request_id)
        except Exception:
            engine.abort_request(request_ids)
            raise
        return request_ids

    def _run_engine(
        self, request_ids: list[str], num_completions: int, use_tqdm: bool | Callable[..., Any]
    ) -> list[RequestOutput | PoolingRequestOutput]:
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput | PoolingRequestOutput] = {}
        make_bar = use_tqdm if callable(use_tqdm) else tqdm
        # As vLLM's LLM._run_engine: the bar counts completions (n per prompt) and shows the speed of the finished
        # ones (prompt tokens once per completion, all completions' tokens) over the time since it started.
        with make_bar(
            total=num_completions,
            desc="Processed prompts",
            disable=not use_tqdm,
            dynamic_ncols=True,
            postfix=speed_postfix(0, 0, 0.0),
        ) as bar:
            num_input_tokens = num_output_tokens = 0
            try:
                while self.llm_engine.has_unfinished_requests():
                    for output in self.llm_engine.step():
                        if not output.finished:
                            continue
                        finished[output.request_id] = output
                        if use_tqdm:
                            input_tokens, output_tokens = count_tokens(output)
                            num_input_tokens += input_tokens
                            num_output_tokens += output_tokens
                            elapsed_s = bar.format_dict["elapsed"]
                            bar.set_postfix_str(speed_postfix(num_input_tokens, num_output_tokens, elapsed_s), False)
                            bar.update(1 if isinstance(output, PoolingRequestOutput) else len(output.outputs))
            except Exception:  # a request failed (vLLM's LLM raises too): the call ends, all of it
                self.llm_engine.abort_request(request_ids)
                raise
        return [finished[request_id] for request_id in request_ids]


def count_tokens(output: RequestOutput | PoolingRequestOutput) -> tuple[int, int]:
    """(input, output) tokens of a finished request as vLLM's ``LLM`` progress bar counts them: the prompt's once
    per completion, and the tokens of all its completions (a pooling request: its prompt, no output)."""
    num_prompt_tokens = len(output.prompt_token_ids or ())
    if isinstance(output, PoolingRequestOutput):
        return num_prompt_tokens, 0
    return num_prompt_tokens * len(output.outputs), sum(len(c.token_ids) for c in output.outputs)


def speed_postfix(num_input_tokens: int, num_output_tokens: int, elapsed_s: float) -> str:
    """vLLM's progress-bar postfix, "est. speed input: 123.45 toks/s, output: 234.56 toks/s": tokens over
    ``elapsed_s`` seconds (0 toks/s before any time has passed)."""
    input_speed = num_input_tokens / elapsed_s if elapsed_s > 0 else 0.0
    output_speed = num_output_tokens / elapsed_s if elapsed_s > 0 else 0.0
    return f"est. speed input: {input_speed:.2f} toks/s, output: {output_speed:.2f} toks/s"


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompt_list = list(prompts)
    if prompt_list and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt_list):
        return [cast(list[int], prompt_list)]  # one prompt given as token ids (the check above: all ints)
    return cast(list[PromptType], prompt_list)  # not all ints: a list of prompts


def _as_conversation_list(messages: list[ChatMessage] | Sequence[list[ChatMessage]]) -> list[list[ChatMessage]]:
    if messages and isinstance(messages[0], dict):
        return [cast(list[ChatMessage], messages)]  # one conversation: its items are messages
    return list(cast(Sequence[list[ChatMessage]], messages))


def _as_priority_list(priority: int | Sequence[int] | None, num_prompts: int) -> list[int]:
    """One priority per prompt; a single int (or None: 0) applies to every prompt, as vLLM's ``LLM``."""
    if priority is None or isinstance(priority, int):
        return [priority or 0] * num_prompts
    priorities = list(priority)
    if len(priorities) != num_prompts:
        raise ValidationError("priority", f"has {len(priorities)} entries for {num_prompts} prompts")
    return priorities


def _as_lora_list(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt; a single one applies to every prompt, as vLLM's ``LLM``."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    lora_requests = list(lora_request)
    if len(lora_requests) != num_prompts:
        raise ValidationError("lora_request", f"has {len(lora_requests)} entries for {num_prompts} prompts")
    return lora_requests


def _as_params_list(
    sampling_params: SamplingParams | Sequence[SamplingParams], num_prompts: int
) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    return _checked_params_list(sampling_params, num_prompts, SamplingParams, PoolingParams, "embed or encode")


def _as_pooling_params_list(
    pooling_params: PoolingParams | Sequence[PoolingParams] | None, num_prompts: int
) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams()] * num_prompts
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * num_prompts
    return _checked_params_list(pooling_params, num_prompts, PoolingParams, SamplingParams, "generate")


def _checked_params_list(given: Any, num_prompts: int, kind: type[Any], other: type[Any], other_call: str) -> list[Any]:
    """``given`` (one ``other``, or a sequence meant to hold one ``kind`` per prompt) as that list, every entry
    checked before any request is added.

    Raises:
        ValidationError: ``given`` is an ``other``, has a length other than ``num_prompts``, or holds something
            else than a ``kind`` (naming ``sampling_params[i]`` / ``pooling_params[i]``).
    """
    field = "sampling_params" if kind is SamplingParams else "pooling_params"
    hint = f" (use {other_call})"
    if isinstance(given, other):
        raise ValidationError(field, f"must be {kind.__name__}, got {other.__name__}{hint}")
    params_list: list[Any] = list(given)
    if len(params_list) != num_prompts:
        raise ValidationError(field, f"has {len(params_list)} entries for {num_prompts} prompts")
    for i, params in enumerate(params_list):
        if not isinstance(params, kind):
            more = hint if isinstance(params, other) else ""
            raise ValidationError(f"{field}[{i}]", f"must be {kind.__name__}, got {type(params).__name__}{more}")
    return params_list
