"""The OpenAI-compatible HTTP API (vLLM's ``vllm/entrypoints/openai/api_server.py`` routes) over the frontend's
``AsyncLLM``: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (server-sent events when streaming,
ending with ``data: [DONE]``), vLLM's ``/tokenize`` and ``/detokenize``, ``/health`` (readiness) and ``/version``;
vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (with ``--allow-runtime-lora-updating``); with
``--enable-admin-routes``, vLLM's dev-mode ``POST /sleep``, ``POST /wake_up`` and ``GET /is_sleeping``.

A request's ``model`` naming a LoRA adapter loaded on the cores runs it with that adapter, as vLLM's; ``/v1/models``
lists the adapters after the base model (``parent``: the base model, ``root``: the adapter's folder).

Errors are OpenAI's bodies (``openai_responses.error_body``) with the status each error class's gRPC code maps
to (``HTTP_STATUS``): a refused field is 400 naming it in ``param``, an unknown model 404, no core ready 503. A
client that goes away (mid-stream, or while waiting for a whole completion) aborts its requests in the core.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError as PydanticValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import splitserve
from frontend_svc.async_llm import AsyncLLM
from frontend_svc.beam_search import beam_search_async
from frontend_svc.embeddings import check_num_inputs, encode_all
from frontend_svc.engine_types import LoRARequest
from frontend_svc.errors import EngineDeadError, FrontendError, NotFoundError, ValidationError
from frontend_svc.input_processor import PromptType, TokensPrompt, prompt_text
from frontend_svc.openai_generation import HTTP_STATUS, Generation, named, named_async, until_disconnect
from frontend_svc.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    SamplingRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from frontend_svc.openai_responses import (
    CompletionLogprobs,
    UsageCounter,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    completion_choice,
    envelope,
    error_body,
    prompt_logprobs_body,
    whole_completion_choice,
)
from frontend_svc.outputs import CompletionOutput, Logprob, RequestOutput
from frontend_svc.reasoning import ReasoningStream, split_reasoning
from frontend_svc.sampling_params import SamplingParams
from frontend_svc.service import FrontendServerState, load_lora_adapter, text_size, unload_lora_adapter
from frontend_svc.tokenize_budget import utf8_size
from frontend_svc.tool_calls import ToolCallDeltas, reply_with_calls
from splitserve.base.request_rules import token_ids_violation
from splitserve.base.status import status_code_of

T = TypeVar("T")


class UnknownModelError(NotFoundError):
    """A request named a model this server does not serve: 404 with OpenAI's ``model_not_found``."""


def make_app(state: FrontendServerState) -> FastAPI:
    """The FastAPI application over ``state`` (the gRPC servicer's: the same engine, drain flag and call count).
    The API key is checked before it, by ``http_server.ApiKeyCheck``, before any body is read."""
    app = FastAPI(
        title="splitserve",
        version=str(splitserve.__version__),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    api = _OpenAIApi(state)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """An unknown path (404) or method (405), in OpenAI's error body."""
        code = "not_found" if error.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(
            error_body(message, "invalid_request_error", None, code), error.status_code, headers=error.headers
        )

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_response(error.errors())

    @app.exception_handler(FrontendError)
    async def refused(request: Request, error: FrontendError) -> JSONResponse:
        return error_response(error)

    app.get("/health")(api.health)
    app.get("/version")(api.version)
    app.get("/load")(api.load)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions", response_model=None)(api.completions)
    app.post("/v1/chat/completions", response_model=None)(api.chat_completions)
    app.post("/v1/embeddings")(api.embeddings)
    app.post("/invocations", response_model=None)(api.invocations)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)
    if state.enable_admin_routes:  # vLLM serves them in its dev mode only
        app.post("/sleep")(api.sleep)
        app.post("/wake_up")(api.wake_up)
        app.get("/is_sleeping")(api.is_sleeping)
    app.post("/v1/load_lora_adapter", response_model=None)(api.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", response_model=None)(api.unload_lora_adapter)
    return app


def error_response(error: FrontendError) -> JSONResponse:
    status, error_type, code = HTTP_STATUS[status_code_of(error)]
    param = error.field if isinstance(error, ValidationError) else None
    if isinstance(error, UnknownModelError):
        param, code = "model", "model_not_found"
    return JSONResponse(error_body(str(error), error_type, param, code), status)


def _validation_response(errors: Sequence[Any]) -> JSONResponse:
    """A body pydantic refused: 400 naming the first offending field (``messages[0].content``) as
    ``"<field>: <pydantic's message>"``."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request body"}
    # A union's errors name the alternative tried (``prompt``, ``str``): the field is what the client sent.
    loc = [part for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    if first.get("type") == "json_invalid":
        field, message = "body", f"is not valid JSON: {first.get('msg')}"
    else:
        field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or "body"
        message = str(first.get("msg", "invalid value"))
    return JSONResponse(error_body(f"{field}: {message}", "invalid_request_error", field, "invalid_value"), 400)


def _is_type_tag(part: Any) -> bool:
    """Whether a pydantic error location part names a union's alternative (``str``, ``list[int]``), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or part.startswith(("list[", "dict[", "function-")))


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})
logger = logging.getLogger(__name__)


class _OpenAIApi:
    """The routes' handlers."""

    def __init__(self, state: FrontendServerState) -> None:
        self.state = state
        self.created = int(time.time())
        self._warned_shadowed = False  # logged once: an adapter named as the served model

    async def health(self) -> Response:
        """200 while a core is ready and the frontend not draining, else 503 (gRPC readiness, over HTTP)."""
        engine = self.state.engine
        ready = engine is not None and not self.state.draining and _core_available(engine)
        return Response(status_code=200 if ready else 503)

    async def load(self) -> dict[str, int]:
        """vLLM's ``GET /load``: ``{"server_load": N}``, the calls this frontend is serving now (both APIs), for a
        load balancer."""
        return {"server_load": self.state.active_calls}

    async def version(self) -> dict[str, str]:
        return {"version": str(splitserve.__version__)}

    async def models(self) -> dict[str, Any]:
        """The served model, then every LoRA adapter the cores have loaded (vLLM's model cards)."""
        engine = self._engine(allow_draining=True)
        loras = await engine.get_loras()
        base = self._model_card(self.state.model, self.state.model_path or self.state.model, None)
        base["max_model_len"] = engine.engine_info.max_model_len  # vLLM's: on the base model's card only
        cards = [base]
        if any(lora.lora_name == self.state.model for lora in loras) and not self._warned_shadowed:
            # A core's --lora-modules may name one so (a frontend load of that name is refused): requests naming
            # it get the base model, so it gets no card of its own (one id, one card).
            self._warned_shadowed = True
            logger.warning(
                "a LoRA adapter on the engine cores is named %r, as the served model: requests naming it run the "
                "base model; load it under another name",
                self.state.model,
            )
        cards += [
            self._model_card(lora.lora_name, lora.lora_path, self.state.model)
            for lora in loras
            if lora.lora_name != self.state.model
        ]
        return {"object": "list", "data": cards}

    def _model_card(self, model_id: str, root: str, parent: str | None) -> dict[str, Any]:
        """vLLM's ``ModelCard``: ``root`` the checkpoint (the model as the server was started with it) or the
        adapter's path, ``parent`` the base model of an adapter, one ``ModelPermission`` with vLLM's values."""
        return {
            "id": model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "root": root,
            "parent": parent,
            "max_model_len": None,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """vLLM's: load ``lora_path`` as ``lora_name`` on every core; 200 with a plain-text line. Refused with 501
        unless the frontend runs with ``--allow-runtime-lora-updating``; the core's refusal is 400 with its reason."""
        engine = self._engine()
        await load_lora_adapter(self.state, engine, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """vLLM's: unload ``lora_name`` from every core; 404 when none has it, 501 as ``load_lora_adapter``."""
        engine = self._engine()
        await unload_lora_adapter(self.state, engine, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        lora = self._lora_of(body.model)  # before the engine: an unknown model is 404 even while no core is up
        engine = self._engine()
        params, prompts = named(body, lambda: (self._params(body, engine), body.prompts()))
        request_id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        prompt_list: list[PromptType] = list(prompts)
        if body.add_special_tokens is False:  # text prompts tokenized without BOS and the like (vLLM's option)
            prompt_list = [await self._without_special_tokens("prompt", engine, p) for p in prompt_list]
        prompt_list = await self._truncated(body, engine, prompt_list)
        generation = Generation(self.state, engine, request_id, body, params, prompt_list, lora, dict(request.headers))
        if body.use_beam_search:
            outputs = await self._beam_search(engine, body, prompt_list, lora, request_id, request)
        elif body.stream:
            return await _model_found(generation.stream(request, self._completion_events), body.model)
        else:
            outputs = await _model_found(until_disconnect(request, generation.collect()), body.model)
        usage = UsageCounter()
        choices = []
        for prompt_index, output in sorted(outputs.items()):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                usage.add(
                    prompt_index, len(output.prompt_token_ids), output.num_cached_tokens, len(completion.token_ids)
                )
                logprobs = None
                echoed = _echoed_prompt(output) if body.echo else None
                if params.logprobs is not None:
                    logprobs = CompletionLogprobs(params.logprobs, engine.tokenizer, as_ids=self._as_ids(body)).body(
                        completion, echoed
                    )
                choice = whole_completion_choice(prompt_index * params.n + completion.index, completion, logprobs)
                if body.echo:
                    choice["text"] = _prompt_text(output, engine.tokenizer) + completion.text
                if params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
                    choice["token_ids"] = list(completion.token_ids)
                choices.append(choice)
        response = envelope(request_id, "text_completion", int(time.time()), generation.model_name, choices)
        response["usage"] = usage.body(self.state.enable_prompt_tokens_details)
        return JSONResponse(response)

    async def _completion_events(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        params, engine = generation.params, generation.engine
        logprobs_by_choice: dict[int, CompletionLogprobs] = {}
        ids_sent: set[int] = set()
        tokens_so_far: dict[int, int] = {}  # choice index -> its tokens streamed so far
        request = generation.request
        echoes = isinstance(request, CompletionRequest) and bool(request.echo)  # vLLM's: the prompt first
        as_ids = self._as_ids(request)
        async for prompt_index, output in generation.outputs():
            for completion in output.outputs:
                index = prompt_index * params.n + completion.index
                generation.usage.add(
                    prompt_index, len(output.prompt_token_ids), output.num_cached_tokens, len(completion.token_ids)
                )
                tokens_so_far[index] = tokens_so_far.get(index, 0) + len(completion.token_ids)
                if not (completion.text or completion.token_ids or completion.finish_reason):
                    continue
                first = index not in ids_sent  # this choice's first chunk
                ids_sent.add(index)
                echo = first and echoes  # on a choice's first chunk
                logprobs = None
                if params.logprobs is not None:
                    state = logprobs_by_choice.setdefault(
                        index, CompletionLogprobs(params.logprobs, engine.tokenizer, as_ids=as_ids)
                    )
                    logprobs = state.body(completion, _echoed_prompt(output) if echo else None)
                choice = completion_choice(index, completion, logprobs)
                if echo:
                    choice["text"] = _prompt_text(output, engine.tokenizer) + completion.text
                if request.return_token_ids:  # the prompt's ids on a choice's first chunk (vLLM's)
                    if first:
                        choice["prompt_token_ids"] = list(output.prompt_token_ids)
                    choice["token_ids"] = list(completion.token_ids)
                usage = (len(output.prompt_token_ids), tokens_so_far[index])
                yield generation.chunk("text_completion", [choice], usage)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        body.use_parsers(self.state.tool_call_parser, self.state.reasoning_parser)
        lora = self._lora_of(body.model)  # before the engine: an unknown model is 404 even while no core is up
        engine = self._engine()
        params = named(body, lambda: self._params(body, engine))
        prompt = await named_async(
            body, self._render_conversation(engine, body.messages_for_template(), body, body.add_special_tokens)
        )
        request_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        (prompt,) = await self._truncated(body, engine, [prompt])
        generation = Generation(self.state, engine, request_id, body, params, [prompt], lora, dict(request.headers))
        if body.use_beam_search:
            outputs = await self._beam_search(engine, body, [prompt], lora, request_id, request)
        elif body.stream:
            return await _model_found(generation.stream(request, self._chat_events), body.model)
        else:
            outputs = await _model_found(until_disconnect(request, generation.collect()), body.model)
        output = outputs[0]
        usage = UsageCounter()
        choices = []
        tool_calls, reasoner = body.tool_calls_mode(), body.reasoning_split()
        for completion in sorted(output.outputs, key=lambda c: c.index):
            usage.add(0, len(output.prompt_token_ids), output.num_cached_tokens, len(completion.token_ids))
            logprobs = (
                chat_logprobs(completion, body.top_logprobs or 0, engine.tokenizer, self._as_ids(body))
                if body.logprobs
                else None
            )
            choice = chat_choice(completion.index, completion, logprobs, body.response_role())
            message: dict[str, Any] = choice["message"]
            content: str | None = completion.text
            if reasoner is not None:  # vLLM's: the reasoning first, then the calls out of the content after it
                reasoning, content = split_reasoning(reasoner, completion.text)
                reasoning = reasoning if body.include_reasoning else None
                message.update(reasoning=reasoning, reasoning_content=reasoning)
            if tool_calls is not None:
                content, message["tool_calls"], choice["finish_reason"] = reply_with_calls(
                    tool_calls, content, completion.finish_reason
                )
            echoed = body.echoed()  # vLLM's: before the content the reasoning and calls left
            message["content"] = echoed + (content or "") if echoed else content
            if body.return_token_ids:
                choice["token_ids"] = list(completion.token_ids)
            choices.append(choice)
        response = envelope(request_id, "chat.completion", int(time.time()), generation.model_name, choices)
        response["usage"] = usage.body(self.state.enable_prompt_tokens_details)
        # vLLM's, beside the choices: null unless asked for
        response["prompt_logprobs"] = None
        response["prompt_token_ids"] = None
        if params.prompt_logprobs is not None:
            response["prompt_logprobs"] = prompt_logprobs_body(output.prompt_logprobs)
        if body.return_token_ids:
            response["prompt_token_ids"] = list(output.prompt_token_ids)
        return JSONResponse(response)

    async def _chat_events(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        request, tokenizer = generation.request, generation.engine.tokenizer
        if not isinstance(request, ChatCompletionRequest):
            raise TypeError("chat events need a chat request")
        # The role first, one chunk per choice, as vLLM's streams start.
        num_prompt_tokens = len(generation.prompt_token_ids())
        for i in range(generation.params.n):
            role = chat_chunk_choice(i, {"role": request.response_role(), "content": ""}, None, None)
            chunk = generation.chunk("chat.completion.chunk", [role], (num_prompt_tokens, 0))
            if request.return_token_ids and i == 0:  # vLLM's: the prompt's ids on the first chunk
                chunk["prompt_token_ids"] = list(generation.prompt_token_ids())
            yield chunk
        echoed = request.echoed()
        if echoed:  # vLLM's echo: the continued message's text, a chunk per choice
            for i in range(generation.params.n):
                echo = chat_chunk_choice(i, {"content": echoed}, None, None)
                yield generation.chunk("chat.completion.chunk", [echo], (num_prompt_tokens, 0))
        tokens_so_far: dict[int, int] = {}  # choice index -> its tokens streamed so far
        as_ids = self._as_ids(request)
        tool_calls, reasoner = request.tool_calls_mode(), request.reasoning_split()
        calls = {} if tool_calls is None else {i: ToolCallDeltas(tool_calls) for i in range(generation.params.n)}
        thinking = {} if reasoner is None else {i: ReasoningStream(reasoner) for i in range(generation.params.n)}
        async for _, output in generation.outputs():
            for completion in output.outputs:
                generation.usage.add(
                    0, len(output.prompt_token_ids), output.num_cached_tokens, len(completion.token_ids)
                )
                tokens_so_far[completion.index] = tokens_so_far.get(completion.index, 0) + len(completion.token_ids)
                if not (completion.text or completion.token_ids or completion.finish_reason):
                    continue
                logprobs = (
                    chat_logprobs(completion, request.top_logprobs or 0, tokenizer, as_ids)
                    if request.logprobs
                    else None
                )
                choice = chat_chunk_choice(completion.index, {"content": completion.text}, completion, logprobs)
                text, delta = completion.text, choice["delta"]
                if reasoner is not None:
                    reasoning, text = thinking[completion.index].feed(text, completion.finish_reason is not None)
                    delta = {"content": text} if text else {}
                    if reasoning and request.include_reasoning:
                        delta = {"reasoning": reasoning, "reasoning_content": reasoning, **delta}
                if tool_calls is not None:
                    delta.pop("content", None)
                    calls_delta, choice["finish_reason"] = calls[completion.index].delta(text, completion.finish_reason)
                    delta.update(calls_delta)
                choice["delta"] = delta
                if not (delta or choice["finish_reason"] or logprobs or request.return_token_ids):
                    continue  # a call or a tag still coming
                if request.return_token_ids:
                    choice["token_ids"] = list(completion.token_ids)
                usage = (num_prompt_tokens, tokens_so_far[completion.index])
                yield generation.chunk("chat.completion.chunk", [choice], usage)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        """OpenAI's embeddings: one ``{"object": "embedding", "index", "embedding"}`` per input (floats, or with
        ``encoding_format`` "base64" the float32 little-endian bytes in base64, as OpenAI's), and the usage. The
        inputs run as pooling requests, all in flight at once; a refused input is 400 naming ``input[i]``. A
        ``model`` naming a LoRA adapter pools with that adapter (as vLLM serves LoRA on pooling models); an unknown
        name is 404."""
        lora = self._lora_of(body.model)  # before the engine: an unknown model is 404 even while no core is up
        engine = self._engine()
        body.check_unsupported()
        prompts: list[PromptType] = list(body.prompts())
        if body.messages is not None:
            prompts = [await self._render_chat_embedding(body, engine)]
        check_num_inputs(len(prompts), "input")
        if body.add_special_tokens is False:  # text inputs tokenized without BOS and the like (vLLM's option)
            prompts = [await self._without_special_tokens(f"input[{i}]", engine, p) for i, p in enumerate(prompts)]
        params = body.to_pooling_params()
        request_id = f"embd-{body.request_id or uuid.uuid4().hex}"
        self.state.active_calls += 1
        try:
            work = encode_all(engine, prompts, params, request_id, "input", body.priority, lora)
            outputs = await _model_found(until_disconnect(request, work), body.model)
        finally:
            self.state.active_calls -= 1
        data = [
            {"object": "embedding", "index": i, "embedding": embedding_body(o.outputs.data, body.encoding_format)}
            for i, o in enumerate(outputs)
        ]
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return {
            "id": request_id,
            "object": "list",
            "created": int(time.time()),
            "model": lora.lora_name if lora is not None else self.state.model,
            "data": data,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
        }

    async def invocations(self, request: Request) -> Any:
        """vLLM's ``POST /invocations`` (SageMaker's route): the body answered by the route its fields name:
        ``messages`` chat completions, ``prompt`` completions, ``input`` embeddings.

        Raises:
            RequestValidationError: a body that is not a JSON object, names none of them, or fails that route's
                checks (400 naming the field).
        """
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise RequestValidationError([{"loc": ("body",), "msg": "must be a JSON object", "type": "value_error"}])
        try:  # validated from the JSON text, as the routes' own bodies are (strict JSON types)
            if "messages" in body and "input" not in body:
                return await self.chat_completions(ChatCompletionRequest.model_validate_json(raw), request)
            if "prompt" in body:
                return await self.completions(CompletionRequest.model_validate_json(raw), request)
            if "input" in body:
                return await self.embeddings(EmbeddingRequest.model_validate_json(raw), request)
        except PydanticValidationError as e:
            raise RequestValidationError(e.errors()) from e
        raise RequestValidationError(
            [
                {
                    "loc": ("body",),
                    "msg": "needs messages (chat), prompt (completions) or input (embeddings)",
                    "type": "value_error",
                }
            ]
        )

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: ``{"count", "max_model_len", "tokens", "token_strs"}`` of a prompt or of messages rendered as
        the chat API renders them (``token_strs`` null unless ``return_token_strs``)."""
        engine = await self._check_model(body.model)
        input_processor = engine.input_processor
        if (body.prompt is None) == (body.messages is None):
            raise ValidationError("prompt", "give prompt or messages, exactly one of them")
        if body.messages is not None:
            body.check_rendering()
            rendered = await self._render_conversation(engine, body.messages, body, body.special_tokens())
            fields: dict[str, Any] = dict(rendered) if isinstance(rendered, dict) else {}
            token_ids = list(fields.get("prompt_token_ids", []))
        else:
            text = body.prompt or ""
            input_processor.check_text_length(text, "prompt", "the prompt")
            token_ids = await input_processor.budget.run(
                utf8_size(text),
                lambda: list(engine.tokenizer(text, add_special_tokens=body.special_tokens()).input_ids),
            )
        token_strs = engine.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return {
            "count": len(token_ids),
            "max_model_len": engine.engine_info.max_model_len,
            "tokens": token_ids,
            "token_strs": token_strs,
        }

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        """vLLM's: ``{"prompt": text}`` of token ids."""
        engine = await self._check_model(body.model)
        if len(body.tokens) > engine.engine_info.max_model_len:
            raise ValidationError(
                "tokens",
                f"has {len(body.tokens)} ids, more than any sequence of this model has "
                f"(max_model_len={engine.engine_info.max_model_len})",
            )
        violation = token_ids_violation("tokens", body.tokens, len(engine.tokenizer))
        if violation is not None:
            raise ValidationError.from_violation(violation)
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}

    async def _render_chat_embedding(self, body: EmbeddingRequest, engine: AsyncLLM) -> PromptType:
        """The conversation of a chat embedding request, rendered as vLLM's ``EmbeddingChatRequest`` renders it:
        no generation prompt and no special tokens added unless the request sets them.

        Raises:
            ValidationError: as ``_render_conversation``.
        """
        add_special_tokens = bool(body.add_special_tokens) if "add_special_tokens" in body.model_fields_set else False
        return await self._render_conversation(engine, body.messages or [], body, add_special_tokens)

    async def _render_conversation(
        self,
        engine: AsyncLLM,
        messages: list[dict[str, Any]],
        body: ChatCompletionRequest | EmbeddingRequest | TokenizeRequest,
        add_special_tokens: bool,
    ) -> PromptType:
        """``messages`` rendered with the chat template under ``body``'s rendering fields (generation prompt,
        final message left open, template and its variables), within the tokenize budget.

        Raises:
            ValidationError: as ``render_chat``; ``chat_template`` while per-request templates are off.
        """
        if body.chat_template is not None and not self.state.trust_request_chat_template:
            raise ValidationError(
                "chat_template",
                "per-request chat templates are off; start the frontend with --trust-request-chat-template",
            )
        input_processor = engine.input_processor
        return await input_processor.budget.run(
            text_size(messages),
            lambda: input_processor.render_chat(
                messages,
                body.add_generation_prompt,
                body.chat_template,
                continue_final_message=body.continue_final_message,
                add_special_tokens=add_special_tokens,
                chat_template_kwargs=(
                    body.template_variables() if isinstance(body, ChatCompletionRequest) else body.chat_template_kwargs
                ),
                tools=body.template_tools() if isinstance(body, ChatCompletionRequest | TokenizeRequest) else None,
                documents=body.documents if isinstance(body, ChatCompletionRequest) else None,
            ),
        )

    async def _without_special_tokens(self, field: str, engine: AsyncLLM, prompt: PromptType) -> PromptType:
        """A text prompt as its token ids without the tokenizer's special tokens (``add_special_tokens=false``);
        token ids as they are. Raises ValidationError naming ``field`` for a text too long to fit."""
        if not isinstance(prompt, str):
            return prompt
        input_processor = engine.input_processor
        input_processor.check_text_length(prompt, field, "the prompt")
        token_ids = await input_processor.budget.run(
            utf8_size(prompt), lambda: list(engine.tokenizer(prompt, add_special_tokens=False).input_ids)
        )
        return TokensPrompt(prompt=prompt, prompt_token_ids=token_ids)

    async def _truncated(self, body: SamplingRequest, engine: AsyncLLM, prompts: list[PromptType]) -> list[PromptType]:
        """The prompts cut to ``truncate_prompt_tokens`` (vLLM's; ``truncation_side``), tokenized within the
        tokenize budget; as they are when it is not set.

        Raises:
            ValidationError: as ``truncation`` and ``InputProcessor.tokenize_with``.
        """
        truncation = named(body, lambda: body.truncation(engine.engine_info.max_model_len))
        if truncation is None:
            return prompts
        processor = engine.input_processor
        truncated: list[PromptType] = []
        for prompt in prompts:
            text = prompt_text(prompt)
            size = utf8_size(text) if text is not None else 0

            def cut(prompt: PromptType = prompt) -> PromptType:
                return processor.tokenize_with(prompt, truncation)

            truncated.append(await named_async(body, processor.budget.run(size, cut)))
        return truncated

    def _as_ids(self, body: SamplingRequest) -> bool:
        """Whether logprobs show tokens as "token_id:<id>": the request's return_tokens_as_token_ids, else the
        server's --return-tokens-as-token-ids (vLLM's)."""
        if body.return_tokens_as_token_ids is not None:
            return body.return_tokens_as_token_ids
        return self.state.return_tokens_as_token_ids

    def _sampling_params(self, body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLM) -> SamplingParams:
        body.check_unsupported()
        params = body.to_sampling_params(engine.default_sampling_params)
        if params.n > self.state.max_n:
            raise ValidationError("n", f"must be at most {self.state.max_n} on this server (--max-n), got {params.n}")
        return params

    def _params(self, body: CompletionRequest | ChatCompletionRequest, engine: AsyncLLM) -> SamplingParams:
        """The request's sampling parameters; with ``use_beam_search``, its beam search checked instead (n beams,
        greedy allowed) and the logprobs and n the responses are built with."""
        if not body.use_beam_search:
            return self._sampling_params(body, engine)
        body.check_unsupported()
        beams = body.beam_search_params(engine.default_sampling_params, engine.engine_info.max_model_len)
        if beams.beam_width > self.state.max_n:
            raise ValidationError(
                "n", f"must be at most {self.state.max_n} on this server (--max-n), got {beams.beam_width}"
            )
        logprobs = body.logprobs if isinstance(body, CompletionRequest) else (body.top_logprobs or 0)
        wants_logprobs = logprobs is not None if isinstance(body, CompletionRequest) else bool(body.logprobs)
        return SamplingParams(n=beams.beam_width, logprobs=logprobs if wants_logprobs else None, temperature=1.0)

    async def _beam_search(
        self,
        engine: AsyncLLM,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[PromptType],
        lora: LoRARequest | None,
        request_id: str,
        request: Request,
    ) -> dict[int, RequestOutput]:
        """``use_beam_search`` (vLLM's): each prompt's beam search (``beam_search_async``), its beams as the n
        completions of a ``RequestOutput`` (text: the generated tokens' decode, a final EOS left out unless
        include_stop_str_in_output; token_ids: the generated tokens; finish reason "stop" at EOS, else
        "length"), keyed by prompt index as ``Generation.collect`` gives them. Counted in the drain; a client that
        disconnects aborts the search."""
        max_model_len = engine.engine_info.max_model_len
        params = named(body, lambda: body.beam_search_params(engine.default_sampling_params, max_model_len))
        headers = dict(request.headers)
        trace_headers = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
        tokenizer = engine.tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)

        async def search(index: int, prompt: PromptType) -> tuple[int, RequestOutput]:
            found = await beam_search_async(engine, prompt, params, f"{request_id}-{index}", lora, trace_headers)
            sequences = found.sequences
            completions = [
                CompletionOutput(
                    index=i,
                    text=tokenizer.decode(beam.generated(eos, bool(body.include_stop_str_in_output))),
                    token_ids=beam.tokens[beam.num_prompt_tokens :],
                    cumulative_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs,
                    finish_reason=beam.finish_reason or "length",
                    stop_reason=beam.stop_reason,
                )
                for i, beam in enumerate(sequences)
            ]
            prompt_ids = sequences[0].tokens[: sequences[0].num_prompt_tokens] if sequences else []
            # the prompt's text as sent, for echo
            return index, RequestOutput(
                f"{request_id}-{index}", prompt_text(prompt), prompt_ids, None, completions, True
            )

        async def search_all() -> list[tuple[int, RequestOutput]]:
            """Every prompt's search at once; the first to fail (or the call's cancellation) cancels the others,
            so none goes on in the core after the answer."""
            tasks = [asyncio.ensure_future(search(i, p)) for i, p in enumerate(prompts)]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        self.state.active_calls += 1
        try:
            results = await named_async(body, _model_found(until_disconnect(request, search_all()), body.model))
        finally:
            self.state.active_calls -= 1
        return dict(results)

    async def sleep(self, level: int = 1, drain: bool = False) -> Response:
        """vLLM's ``POST /sleep?level=1``: every core to sleep (``AsyncLLM.sleep``); ``drain=true`` lets the
        requests in flight finish first. 200 once they sleep; 400 naming ``level`` for another level; 501 when a
        core runs without ``--enable-admin-rpcs``."""
        await self._admin_engine().sleep(level, drain)
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        """vLLM's ``POST /wake_up``, with ``tags`` query parameters (``?tags=weights``, repeated for several;
        none: everything). 200 once done; 400 naming ``tags[i]`` for an unknown tag."""
        tags = request.query_params.getlist("tags")
        await self._admin_engine().wake_up(tags or None)
        return Response(status_code=200)

    async def is_sleeping(self) -> dict[str, bool]:
        """vLLM's ``GET /is_sleeping``: ``{"is_sleeping": true}`` while a core sleeps."""
        return {"is_sleeping": await self._admin_engine().is_sleeping()}

    def _admin_engine(self) -> AsyncLLM:
        """The engine, also while no core takes requests (a sleeping one does not)."""
        engine = self.state.engine
        if engine is None:
            raise EngineDeadError("the frontend is not ready: no engine core yet")
        return engine

    def _lora_of(self, model: str | None) -> LoRARequest | None:
        """The adapter a generation request's ``model`` names: None for the served model (or no model). Any other
        name goes to the core as an adapter's, which the core answers NOT_FOUND when it has none of that name
        (``_model_found``); while no core is reachable, it is unknown here.

        Raises:
            UnknownModelError: another name while no core is reachable.
        """
        if not model or model == self.state.model:  # vLLM's: an empty name is the served model too
            return None
        engine = self.state.engine
        if engine is None or not _core_available(engine):
            raise self._unknown(model)
        return LoRARequest(lora_name=model)

    async def _check_model(self, model: str | None) -> AsyncLLM:
        """The engine, for a request (tokenize, detokenize) whose ``model`` is the served one or a loaded adapter
        (which share the tokenizer).

        Raises:
            UnknownModelError: any other name.
        """
        if model and model != self.state.model:
            engine = self.state.engine
            if engine is None or not _core_available(engine):
                raise self._unknown(model)
            if model not in {lora.lora_name for lora in await engine.get_loras()}:
                raise self._unknown(model)
        return self._engine(allow_draining=True)

    def _unknown(self, model: str) -> UnknownModelError:
        return UnknownModelError(
            f"The model `{model}` does not exist; this server serves `{self.state.model}` and the LoRA adapters "
            "/v1/models lists"
        )

    def _engine(self, allow_draining: bool = False) -> AsyncLLM:
        engine = self.state.engine
        if engine is None:
            raise EngineDeadError("the frontend is not ready: no engine core yet")
        if self.state.draining and not allow_draining:
            raise EngineDeadError("the frontend is shutting down")
        if not _core_available(engine):
            client = engine.engine_core
            raise EngineDeadError(getattr(client, "unavailable_reason", lambda: "no engine core is reachable")())
        return engine


def _echoed_prompt(output: RequestOutput) -> tuple[list[int], list[dict[int, Logprob] | None]] | None:
    """An echoed prompt's token ids and logprobs for the completions API's logprobs (None without them)."""
    if not output.prompt_logprobs:
        return None
    return list(output.prompt_token_ids), list(output.prompt_logprobs)


def _prompt_text(output: RequestOutput, tokenizer: Any) -> str:
    """The prompt as echoed: its text as sent, a token-id prompt decoded (special tokens kept), as vLLM's."""
    if output.prompt is not None:
        return output.prompt
    return str(tokenizer.decode(list(output.prompt_token_ids)))


async def _model_found(call: Awaitable[T], model: str | None) -> T:
    """``call``'s result; the core's NOT_FOUND for the adapter a request's ``model`` named as OpenAI's
    ``model_not_found`` (404, ``param: "model"``).

    Raises:
        UnknownModelError: the core has no adapter of that name.
    """
    try:
        return await call
    except UnknownModelError:
        raise
    except NotFoundError as e:
        raise UnknownModelError(f"The model `{model}` does not exist: {e}") from e


def embedding_body(data: list[float], encoding_format: str) -> list[float] | str:
    """An embedding as OpenAI sends it: the floats, or "base64": float32 little-endian bytes in base64 (what the
    ``openai`` client decodes with ``numpy.frombuffer(..., dtype="float32")``)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data, dtype="<f4").tobytes()).decode()
    return data


def _core_available(engine: AsyncLLM) -> bool:
    return bool(getattr(engine.engine_core, "is_available", lambda: True)())
