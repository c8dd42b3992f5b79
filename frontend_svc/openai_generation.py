"""One API request's engine requests (one per prompt) for the OpenAI-compatible HTTP API: started before any
response (a refusal is an error response, not a broken stream), their outputs merged, counted in the frontend's
active calls, streamed as server-sent events, and aborted in the core when the client goes away. With tracing on,
each engine request gets an ``llm_request`` span (a SERVER span continuing the caller's W3C ``traceparent``, as
vLLM's OpenAI server does) whose context goes to the core."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind
from starlette.types import Receive, Scope, Send

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.engine_types import LoRARequest
from frontend_svc.errors import EngineDeadError, FrontendError, ValidationError
from frontend_svc.input_processor import MAX_TOKENS_HINT, PromptType
from frontend_svc.openai_protocol import ChatCompletionRequest, SamplingRequest, request_field
from frontend_svc.openai_responses import UsageCounter, envelope, error_body
from frontend_svc.outputs import RequestOutput
from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
from frontend_svc.service import FrontendServerState, RequestSpan
from splitserve.base.status import StatusCode, status_code_of
from splitserve.base.tracing import inject_headers

T = TypeVar("T")
# The HTTP status of each error kind (the gRPC code its class states), with OpenAI's error type and code.
HTTP_STATUS: dict[StatusCode, tuple[int, str, str | None]] = {
    StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    # vLLM's 400 for a LoRA name already loaded (from another folder, here).
    StatusCode.ALREADY_EXISTS: (400, "invalid_request_error", "already_exists"),
    # vLLM's 400 for a request that can never fit (the KV cache); 413 is only the body limit's (``BodyLimit``).
    StatusCode.RESOURCE_EXHAUSTED: (400, "invalid_request_error", "request_too_large"),
    StatusCode.UNIMPLEMENTED: (501, "invalid_request_error", "not_implemented"),
    StatusCode.INTERNAL: (500, "server_error", None),
    StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
}
SSE_DONE = "data: [DONE]\n\n"


class Generation:
    """The engine requests of one API request (one per prompt), their outputs merged, counted in the frontend's
    active calls (a drain waits for them), and the chunk envelope of its stream. A model that names a LoRA adapter
    (``lora_request``) runs every prompt with it; the chunks name that model, as vLLM's."""

    def __init__(
        self,
        state: FrontendServerState,
        engine: AsyncLLM,
        request_id: str,
        request: SamplingRequest,
        params: SamplingParams,
        prompts: list[PromptType],
        lora_request: LoRARequest | None = None,
        http_headers: dict[str, str] | None = None,
    ) -> None:
        self.state = state
        self.engine = engine
        self.request_id = request_id
        self.request = request
        self.params = params
        self.prompts = prompts
        self.lora_request = lora_request  # the adapter the request's model names; None: the base model
        self.created = int(time.time())
        self.usage = UsageCounter()
        self._merged: AsyncGenerator[tuple[int, RequestOutput], None] | None = None
        self._first: tuple[int, RequestOutput] | None = None
        self._released = False  # a stream's release() has run
        self.http_headers = http_headers or {}  # the caller's, for its trace context
        self._spans: list[RequestSpan] = []  # per prompt (spans that do nothing when tracing is off)
        self._completion_tokens: list[dict[int, int]] = []  # per prompt: ids sent so far per completion index

    @property
    def model_name(self) -> str:
        """The model the responses name: the adapter's name, else the served model's."""
        return self.lora_request.lora_name if self.lora_request is not None else self.state.model

    async def start(self) -> None:
        """Queue the requests and wait for the first output: a refused request raises here, before any response
        has started.

        Raises:
            FrontendError: the request was refused (a ValidationError names the field as the client sent it).
        """
        suffix = len(self.prompts) > 1
        request_ids = [f"{self.request_id}-{i}" if suffix else self.request_id for i in range(len(self.prompts))]
        tracer = self.state.tracer
        caller = propagate.extract(self.http_headers) if tracer is not None else None
        trace_headers: list[dict[str, str] | None] = []
        for request_id in request_ids:
            span = None
            if tracer is not None:
                span = tracer.start_span("llm_request", context=caller, kind=SpanKind.SERVER)
            trace_headers.append(inject_headers(trace.set_span_in_context(span)) if span is not None else None)
            self._spans.append(RequestSpan(span, request_id, self.params, self.model_name))
            self._completion_tokens.append({})
        generators = [
            self.engine.generate(
                prompt,
                self.params,
                request_ids[i],
                trace_headers=trace_headers[i],
                priority=self.request.priority,
                cache_salt=self.request.cache_salt,
                lora_request=self.lora_request,
            )
            for i, prompt in enumerate(self.prompts)
        ]
        if suffix:  # a batch: a refused prompt is named by its index (``prompt[1]``)
            generators = [_prompt_indexed(self.request, i, g) for i, g in enumerate(generators)]
        self._merged = merge(generators)
        try:
            self._first = await named_async(self.request, anext(self._merged))
        except BaseException as e:
            await self._merged.aclose()
            self.end_spans(e)
            raise
        self._count(*self._first)

    def prompt_token_ids(self) -> list[int]:
        """The first prompt's token ids (known once ``start`` has returned)."""
        if self._first is None:
            raise RuntimeError("start() first")
        return list(self._first[1].prompt_token_ids)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, from the first on."""
        if self._merged is None or self._first is None:
            raise RuntimeError("start() first")
        yield self._first
        async for item in self._merged:
            self._count(*item)
            yield item

    def _count(self, prompt_index: int, output: RequestOutput) -> None:
        """Update prompt ``prompt_index``'s span with ``output`` (its completion tokens so far); nothing to do
        when tracing is off."""
        if self._spans[prompt_index].span is None:
            return
        counts = self._completion_tokens[prompt_index]
        delta = self.params.output_kind == RequestOutputKind.DELTA
        for completion in output.outputs:
            previous = counts.get(completion.index, 0)
            counts[completion.index] = previous + len(completion.token_ids) if delta else len(completion.token_ids)
        self._spans[prompt_index].update(output, sum(counts.values()))

    def end_spans(self, error: BaseException | None = None) -> None:
        """End every prompt's span once: failed with ``error``, or cancelled when the requests were closed
        before they finished (the client went away)."""
        for span in self._spans:
            if isinstance(error, Exception) and not isinstance(error, asyncio.CancelledError):
                span.fail(error)
            elif span.last_output is None or not span.last_output.finished:
                span.cancelled()
            span.end()

    async def collect(self) -> dict[int, RequestOutput]:
        """Each prompt's final output (the requests are FINAL_ONLY)."""
        self.state.active_calls += 1
        try:
            await self.start()
            return {prompt_index: output async for prompt_index, output in self.outputs()}
        except BaseException as e:
            self.end_spans(e)
            raise
        finally:
            self.state.active_calls -= 1
            await self.aclose()

    async def stream(
        self, request: Request, events: Callable[[Generation], AsyncIterator[dict[str, Any]]]
    ) -> StreamingResponse:
        """Server-sent events of ``events``' chunks, the usage chunk (``stream_options.include_usage``), then
        ``data: [DONE]``. An error after the first output ends the stream with an error event."""
        self.state.active_calls += 1
        try:
            await until_disconnect(request, self.start())
        except BaseException:
            await self.release()
            raise

        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in events(self):
                    yield _sse(chunk)
                if self.request.include_usage:
                    usage_chunk = self.chunk(str(_chunk_object(self.request)), [])
                    usage_chunk["usage"] = self.usage.body(self.state.enable_prompt_tokens_details)
                    yield _sse(usage_chunk)
            except FrontendError as e:
                self.end_spans(e)
                status, error_type, code = HTTP_STATUS[status_code_of(e)]
                param = e.field if isinstance(e, ValidationError) else None
                yield _sse(error_body(str(e), error_type, param, code))
            finally:
                await self.release()
            yield SSE_DONE

        return _ReleasingStreamingResponse(body(), self.release, media_type="text/event-stream")

    def chunk(self, object_type: str, choices: list[Any], usage: tuple[int, int] | None = None) -> dict[str, Any]:
        """A stream's chunk; with ``continuous_usage_stats``, the usage of its choice so far, ``usage`` (prompt
        tokens, the choice's tokens so far), as vLLM's: each chunk counts its own prompt and choice."""
        chunk = envelope(self.request_id, object_type, self.created, self.model_name, choices)
        if self.request.continuous_usage:
            prompt_tokens, completion_tokens = usage or (0, 0)
            chunk["usage"] = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
        return chunk

    async def aclose(self) -> None:
        if self._merged is not None:
            await self._merged.aclose()
        self.end_spans()

    async def release(self) -> None:
        """A stream's end, once however it comes (its body's end, or its response's if the body never ran):
        out of the active calls, and the engine requests closed (aborted in the core if unfinished)."""
        if self._released:
            return
        self._released = True
        self.state.active_calls -= 1
        await self.aclose()


class _ReleasingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that calls ``on_close`` when it ends, however: the body's own ``finally`` never runs
    when the response fails or is cancelled before the body starts (the client gone before the headers)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _chunk_object(request: SamplingRequest) -> str:
    return "chat.completion.chunk" if isinstance(request, ChatCompletionRequest) else "text_completion"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def merge(
    generators: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several requests as they come, as (index of the generator, output). Closing the merge (or
    an error in one) cancels them all, which aborts them in the core."""
    if len(generators) == 1:
        try:
            async for output in generators[0]:
                yield 0, output
        finally:
            await generators[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, generator: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for output in generator:
                queue.put_nowait((index, output, None))
            queue.put_nowait((index, None, None))
        except Exception as e:
            queue.put_nowait((index, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client disconnects first (vLLM's ``with_cancellation``): the request it queued
    is aborted in the core.

    Raises:
        EngineDeadError: the client disconnected (answered 503 to no one: the client is gone).
    """
    task = asyncio.ensure_future(work)
    disconnected = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not disconnected.done():
            disconnected.cancel()
        if not task.done():
            task.cancel()
            # The cancellation lands at the task's next await: wait for it, so the core's abort has been sent.
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise EngineDeadError("the client disconnected")
    return task.result()  # or the work's own error


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _prompt_indexed(
    request: SamplingRequest, index: int, generator: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    """``generator``'s outputs; a ValidationError about its prompt names it as ``prompt[index]`` (and the token
    within it: ``prompt[index][3]``)."""
    try:
        async for output in generator:
            yield output
    except ValidationError as e:
        field = request_field(e.field, request)
        if field == "prompt" or field.startswith("prompt["):
            raise ValidationError(f"prompt[{index}]{field.removeprefix('prompt')}", e.description) from None
        raise
    finally:
        await generator.aclose()


def named(request: SamplingRequest, make: Callable[[], T]) -> T:
    """``make()``, its ValidationError naming the field as the client sent it (``request_field``)."""
    try:
        return make()
    except ValidationError as e:
        raise _renamed(request, e) from None


async def named_async(request: SamplingRequest, work: Awaitable[T]) -> T:
    try:
        return await work
    except ValidationError as e:
        raise _renamed(request, e) from None


def _renamed(request: SamplingRequest, error: ValidationError) -> ValidationError:
    field = request_field(error.field, request)
    description = error.description
    if description.endswith(MAX_TOKENS_HINT):  # the gRPC API's words: HTTP's instead
        description = description.removesuffix(MAX_TOKENS_HINT)
        if isinstance(request, ChatCompletionRequest):
            description += " (leave max_tokens and max_completion_tokens unset, or null, to take all the room left)"
    if (field, description) == (error.field, error.description):
        return error
    return ValidationError(field, description)
