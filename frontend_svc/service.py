"""The public ``Generation`` servicer: thin and typed over ``AsyncLLM``; errors ended with their status by
``splitserve.base.grpc_status``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.embeddings import check_num_inputs, encode_all
from frontend_svc.engine_types import LoRARequest
from frontend_svc.errors import EngineDeadError, FrontendError, NotSupportedError, ValidationError
from frontend_svc.input_processor import PromptType
from frontend_svc.outputs import RequestOutput
from frontend_svc.sampling_params import MAX_N, RequestOutputKind, SamplingParams
from frontend_svc.tokenize_budget import utf8_size
from frontend_svc.wire import (
    chat_messages_from_api,
    default_sampling_params_to_api,
    embed_inputs_from_api,
    embed_pooling_params_from_api,
    embed_response_to_api,
    generate_request_from_api,
    lora_adapter_to_api,
    lora_request_from_api,
    request_output_to_api,
    sampling_params_from_api,
)
from splitserve.base.grpc_status import abort
from splitserve.base.request_rules import token_ids_violation
from splitserve.base.tracing import SpanAttributes, inject_headers
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

GENERATION_GRPC_SERVICE = api.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class FrontendServerState:
    model: str  # the name clients see (--served-model-name, else --model as given)
    model_path: str = ""  # --model as given (the model cards' root; empty: ``model``)
    trust_request_chat_template: bool = False  # whether a Chat call may bring its own template (as vLLM's flag)
    max_n: int = MAX_N  # the most completions one call may ask for (--max-n; docs/operations.md)
    allow_runtime_lora_updating: bool = False  # whether clients may load and unload LoRA adapters (the flag)
    tokenizer: Any = None  # loaded first: Tokenize / Detokenize work before any core is reachable
    engine: AsyncLLM | None = None  # set once the core is reachable (or loaded, in-process)
    draining: bool = False
    active_calls: int = 0
    tracer: Tracer | None = None  # None: tracing is off
    enable_admin_routes: bool = False  # the HTTP API's /sleep, /wake_up, /is_sleeping (--enable-admin-routes)
    enable_prompt_tokens_details: bool = False  # the HTTP API's usage.prompt_tokens_details (vLLM's flag)
    return_tokens_as_token_ids: bool = False  # the HTTP API's logprobs tokens as "token_id:<id>" (vLLM's flag)
    tool_call_parser: str | None = None  # parses tool_choice "auto"'s calls (--enable-auto-tool-choice); None: refused
    reasoning_parser: str | None = None  # splits chat replies' reasoning (--reasoning-parser); None: not split


class GenerationServicer(api_grpc.GenerationServicer):
    def __init__(self, state: FrontendServerState) -> None:
        self.state = state

    async def Generate(
        self, request: api.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.GenerateResponse]:
        engine = await self._engine(context)
        try:
            prompt: PromptType = generate_request_from_api(request)
            params = sampling_params_from_api(request.sampling_params, engine.default_sampling_params)
            lora = lora_request_from_api(request.lora_name)
        except FrontendError as e:
            await abort(context, e)
        async for message in self._stream(context, engine, prompt, params, request, lora):
            yield message

    async def Chat(
        self, request: api.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.GenerateResponse]:
        engine = await self._engine(context)
        try:
            params = sampling_params_from_api(request.sampling_params, engine.default_sampling_params)
            lora = lora_request_from_api(request.lora_name)
            add_generation_prompt = request.add_generation_prompt if request.HasField("add_generation_prompt") else True
            chat_template = request.chat_template if request.HasField("chat_template") else None
            if chat_template is not None and not self.state.trust_request_chat_template:
                raise ValidationError(
                    "chat_template",
                    "per-request chat templates are off; start the frontend with "
                    "--trust-request-chat-template to allow them",
                )
            # Rendering runs the template and tokenizes: CPU work, kept off the event loop, within the tokenize budget.
            messages = chat_messages_from_api(request.messages)
            prompt = await engine.input_processor.budget.run(
                text_size(messages),
                lambda: engine.input_processor.render_chat(messages, add_generation_prompt, chat_template),
            )
        except FrontendError as e:
            await abort(context, e)
        async for message in self._stream(context, engine, prompt, params, request, lora):
            yield message

    async def Tokenize(self, request: api.TokenizeRequest, context: grpc.aio.ServicerContext) -> api.TokenizeResponse:
        tokenizer = await self._tokenizer(context)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True

        def tokenize() -> api.TokenizeResponse:
            token_ids = tokenizer(request.text, add_special_tokens=add_special).input_ids
            return api.TokenizeResponse(token_ids=token_ids, tokens=tokenizer.convert_ids_to_tokens(token_ids))

        if self.state.engine is None:  # the tokenizer is loaded, no core reached yet: nothing to bound it by
            return await asyncio.to_thread(tokenize)
        # A text no prompt could be is refused by its length, as prompts are: tokenizing costs seconds and
        # about 300 bytes of memory per token (a 16 MiB text of short words: 13 s and 2 GB).
        input_processor = self.state.engine.input_processor
        try:
            input_processor.check_text_length(request.text, "text", "the text")
        except ValidationError as e:
            await abort(context, e)
        return await input_processor.budget.run(utf8_size(request.text), tokenize)

    async def Detokenize(
        self, request: api.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> api.DetokenizeResponse:
        tokenizer = await self._tokenizer(context)
        token_ids = list(request.token_ids)
        engine = self.state.engine
        if engine is not None and len(token_ids) > engine.engine_info.max_model_len:
            # As Tokenize's text: no sequence of this model is longer, and decoding costs time and memory per id.
            error = ValidationError(
                "token_ids",
                f"has {len(token_ids)} ids, more than any sequence of this model has "
                f"(max_model_len={engine.engine_info.max_model_len})",
            )
            await abort(context, error)
        vocab_size = len(tokenizer)
        if token_ids and not (min(token_ids) >= 0 and max(token_ids) < vocab_size):  # at C speed; then find it
            violation = token_ids_violation("token_ids", token_ids, vocab_size)
            if violation is not None:
                await abort(context, ValidationError.from_violation(violation))
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(tokenizer.decode, token_ids, skip_special_tokens=skip)
        return api.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request: api.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> api.ModelInfo:
        engine = await self._engine(context, allow_draining=True)
        info = engine.engine_info
        msg = api.ModelInfo(
            model=self.state.model,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=engine.input_processor.eos_token_ids,
            max_logprobs=info.max_logprobs,
            has_chat_template=bool(getattr(engine.tokenizer, "chat_template", None)),
            kv_cache_tokens=info.kv_cache_tokens,
            default_sampling_params=default_sampling_params_to_api(engine.default_sampling_params),
            generation_config=engine.generation_config,
        )
        if engine.tokenizer.bos_token_id is not None:
            msg.bos_token_id = engine.tokenizer.bos_token_id
        return msg

    async def LoadLoraAdapter(
        self, request: api.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> api.LoadLoraAdapterResponse:
        engine = await self._engine(context)
        try:
            lora = await load_lora_adapter(self.state, engine, request.lora_name, request.lora_path)
        except FrontendError as e:
            await abort(context, e)
        return api.LoadLoraAdapterResponse(adapter=lora_adapter_to_api(lora))

    async def UnloadLoraAdapter(
        self, request: api.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> api.UnloadLoraAdapterResponse:
        engine = await self._engine(context)
        try:
            await unload_lora_adapter(self.state, engine, request.lora_name)
        except FrontendError as e:
            await abort(context, e)
        return api.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: api.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> api.ListLoraAdaptersResponse:
        engine = await self._engine(context, allow_draining=True)
        try:
            loras = await engine.get_loras()
        except FrontendError as e:
            await abort(context, e)
        return api.ListLoraAdaptersResponse(adapters=[lora_adapter_to_api(lora) for lora in loras])

    async def Embed(self, request: api.EmbedRequest, context: grpc.aio.ServicerContext) -> api.EmbedResponse:
        """Every input pooled as a pooling request (``AsyncLLM.encode``), all in flight at once; one response.
        A refused input fails the call (INVALID_ARGUMENT naming ``inputs[i]``) and the others are aborted."""
        engine = await self._engine(context)
        request_id = request.request_id or f"embd-{uuid.uuid4().hex}"
        self.state.active_calls += 1
        try:
            check_num_inputs(len(request.inputs), "inputs")
            prompts = embed_inputs_from_api(request)
            params = embed_pooling_params_from_api(request)
            outputs = await encode_all(engine, prompts, params, request_id, "inputs", request.priority)
        except FrontendError as e:
            await abort(context, e)
        finally:
            self.state.active_calls -= 1
        return embed_response_to_api(request_id, outputs)

    async def _stream(
        self,
        context: grpc.aio.ServicerContext,
        engine: AsyncLLM,
        prompt: PromptType,
        params: Any,
        request: Any,
        lora: LoRARequest | None,
    ) -> AsyncIterator[api.GenerateResponse]:
        """Stream one request's outputs; cancellation of the call aborts it (the generator is closed). With
        tracing on, the request gets an ``llm_request`` span (a child of the call's server span) whose context
        goes to the core in ``trace_headers``."""
        if params.n > self.state.max_n:
            error = ValidationError("n", f"must be at most {self.state.max_n} on this server (--max-n), got {params.n}")
            await abort(context, error)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        delta = params.output_kind == RequestOutputKind.DELTA
        # Per completion index the ids sent so far, and their total, kept as a running sum: a message costs what
        # it carries, not the request's n.
        completion_tokens: dict[int, int] = {}
        total_completion_tokens = 0
        first = True
        span = trace_headers = None
        if self.state.tracer is not None:
            span = self.state.tracer.start_span("llm_request", kind=SpanKind.INTERNAL)
            trace_headers = inject_headers(trace.set_span_in_context(span))
        request_span = RequestSpan(span, request_id, params, self.state.model)
        self.state.active_calls += 1
        try:
            async for output in engine.generate(
                prompt,
                params,
                request_id,
                trace_headers=trace_headers,
                priority=request.priority,
                cache_salt=cache_salt,
                lora_request=lora,
            ):
                for completion in output.outputs:
                    previous = completion_tokens.get(completion.index, 0)
                    count = previous + len(completion.token_ids) if delta else len(completion.token_ids)
                    completion_tokens[completion.index] = count
                    total_completion_tokens += count - previous
                request_span.update(output, total_completion_tokens)
                yield request_output_to_api(output, first, total_completion_tokens)
                first = False
        except FrontendError as e:
            request_span.fail(e)
            await abort(context, e)
        except (asyncio.CancelledError, GeneratorExit):
            request_span.cancelled()
            raise
        except Exception as e:
            request_span.fail(e)
            raise
        finally:
            self.state.active_calls -= 1
            request_span.end()

    async def _tokenizer(self, context: grpc.aio.ServicerContext) -> Any:
        if self.state.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is still loading its tokenizer")
        return self.state.tokenizer

    async def _engine(self, context: grpc.aio.ServicerContext, allow_draining: bool = False) -> AsyncLLM:
        engine = self.state.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is not ready: no engine core yet")
        if self.state.draining and not allow_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is shutting down")
        client = engine.engine_core
        if not getattr(client, "is_available", lambda: True)():
            error = EngineDeadError(getattr(client, "unavailable_reason", lambda: "no engine core is reachable")())
            await abort(context, error)
        return engine


def check_runtime_lora_updating(state: FrontendServerState) -> None:
    """Loading and unloading adapters at run time is on (``--allow-runtime-lora-updating``, as vLLM's
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): a load makes the core read any path it is given.

    Raises:
        NotSupportedError: it is off (UNIMPLEMENTED; 501 over HTTP).
    """
    if not state.allow_runtime_lora_updating:
        raise NotSupportedError(
            "loading and unloading LoRA adapters at run time is off on this server; start the frontend with "
            "--allow-runtime-lora-updating (docs/operations.md), or the core with --lora-modules name=path"
        )


async def load_lora_adapter(
    state: FrontendServerState, engine: AsyncLLM, lora_name: str, lora_path: str
) -> LoRARequest:
    """Load the adapter at ``lora_path`` as ``lora_name`` on every core (vLLM's ``/v1/load_lora_adapter``); the
    gRPC and HTTP APIs' one implementation.

    Raises:
        NotSupportedError: runtime updating is off (``check_runtime_lora_updating``).
        ValidationError: an empty ``lora_name`` or ``lora_path``, the base model's name as ``lora_name``, or the
            core's refusal (a folder it cannot read or load, a rank above its maximum, a setting it does not serve).
        AlreadyExistsError: the name is loaded from another folder (ALREADY_EXISTS; the same folder again is no
            error).
        FailedPreconditionError: a core runs without ``--enable-lora``.
    """
    check_runtime_lora_updating(state)
    if not lora_name:
        raise ValidationError("lora_name", "must name the adapter")
    if lora_name == state.model:
        raise ValidationError("lora_name", f"{lora_name!r} is the base model's name; choose another")
    if not lora_path:
        raise ValidationError("lora_path", "must give the adapter's folder on the engine core's file system")
    try:
        return await engine.engine_core.add_lora_async(LoRARequest(lora_name=lora_name, lora_path=lora_path))
    except ValidationError as e:  # the core names the fields of its AddLora (lora_request.lora_path): name ours
        field = e.field.removeprefix("lora_request.")
        if field == e.field:
            raise
        raise ValidationError(field, e.description) from e


async def unload_lora_adapter(state: FrontendServerState, engine: AsyncLLM, lora_name: str) -> None:
    """Unload ``lora_name`` from every core (vLLM's ``/v1/unload_lora_adapter``).

    Raises:
        NotSupportedError: runtime updating is off (``check_runtime_lora_updating``).
        ValidationError: an empty ``lora_name``.
        NotFoundError: no core has it loaded.
    """
    check_runtime_lora_updating(state)
    if not lora_name:
        raise ValidationError("lora_name", "must name the adapter")
    await engine.engine_core.remove_lora_async(lora_name)


def text_size(messages: list[dict[str, Any]]) -> int:
    """The UTF-8 size of a conversation's texts (``chat_messages_from_api``'s messages)."""
    size = 0
    for message in messages:
        content = message.get("content")
        parts = [content] if isinstance(content, str) else [p.get("text") for p in content or [] if isinstance(p, dict)]
        size += sum(utf8_size(text) for text in parts if isinstance(text, str))
    return size


class RequestSpan:
    """The ``llm_request`` span of one public call and its ``gen_ai.*`` attributes (vLLM's): the request's
    parameters at the start; usage and latencies (seconds) at the end. The queue, prefill and decode times come
    from the core's timestamps (``RequestOutput.metrics``; for n > 1, of the completion that finished last); the
    time to first token is the first completion's. Each of the n completions' finish reason is kept as its
    outputs come (a DELTA output holds only the completions that changed); a cancelled call's unfinished ones
    read ``abort``. Does nothing when tracing is off."""

    def __init__(self, span: Span | None, request_id: str, params: SamplingParams, model: str) -> None:
        self.span = span
        self.start = time.time()
        self.first_token_time: float | None = None
        self.first_token_latency: float | None = None  # the core's, the smallest over the completions
        self.last_output: RequestOutput | None = None
        self.completion_tokens = 0
        self.num_sequences = params.n
        self.finish_reasons: dict[int, str] = {}
        self.was_cancelled = False
        if span is None:
            return
        attributes: dict[str, str | int | float] = {
            SpanAttributes.GEN_AI_REQUEST_ID: request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: model,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            SpanAttributes.GEN_AI_REQUEST_TOP_P: params.top_p,
            SpanAttributes.GEN_AI_REQUEST_N: params.n,
        }
        if params.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        span.set_attributes(attributes)

    def update(self, output: RequestOutput, completion_tokens: int) -> None:
        if self.span is None:
            return
        if self.first_token_time is None and completion_tokens:
            self.first_token_time = time.time()
        self.last_output = output
        self.completion_tokens = completion_tokens
        for completion in output.outputs:
            if completion.finish_reason:
                self.finish_reasons[completion.index] = completion.finish_reason
        latency = output.metrics.first_token_latency if output.metrics is not None else None
        if latency is not None and (self.first_token_latency is None or latency < self.first_token_latency):
            self.first_token_latency = latency

    def fail(self, error: Exception) -> None:
        if self.span is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))

    def cancelled(self) -> None:
        """The client went away (the request was aborted)."""
        self.was_cancelled = True
        if self.span is not None:
            self.span.add_event("cancelled")

    def end(self) -> None:
        if self.span is None:
            return
        span, self.span = self.span, None
        output = self.last_output
        attributes: dict[str, str | int | float | list[str]] = {
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: self.completion_tokens,
            SpanAttributes.GEN_AI_LATENCY_E2E: time.time() - self.start,
        }
        stats = output.metrics if output is not None else None
        if self.first_token_latency is not None:  # the core's: also right when outputs were held back
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = self.first_token_latency
        elif self.first_token_time is not None:
            attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = self.first_token_time - self.start
        if output is not None:
            unfinished = "abort" if self.was_cancelled else ""
            attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] = len(output.prompt_token_ids)
            attributes[SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES] = self.num_sequences
            attributes[SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS] = [
                self.finish_reasons.get(i, unfinished) for i in range(self.num_sequences)
            ]
            if stats is not None:
                attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = stats.queued_time
                attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = stats.prefill_time
                attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = stats.decode_time
                attributes[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = stats.inference_time
        span.set_attributes(attributes)
        span.end()
