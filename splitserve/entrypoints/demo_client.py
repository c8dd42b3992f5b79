"""The demo client: real prompts through the public gRPC API, text printed as it streams, TTFT and latency per
request. Uses only the generated stubs of ``protos/splitserve/frontend/v1/generation.proto``."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

from splitserve.base.tls import ClientTLS, bearer_metadata, secure_or_insecure_aio_channel
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc


@dataclass
class DemoRequest:
    label: str
    prompt: str = ""
    chat: str = ""  # a user message, rendered with the model's chat template
    params: api.SamplingParams = field(default_factory=api.SamplingParams)


def demo_requests() -> list[DemoRequest]:
    return [
        DemoRequest(
            "completion", prompt="The capital of France is", params=api.SamplingParams(max_tokens=40, temperature=0.0)
        ),
        DemoRequest(
            "completion, stop strings",
            prompt="def fibonacci(n):",
            params=api.SamplingParams(max_tokens=60, temperature=0.8, seed=1, stop=[".", "\n"]),
        ),
        DemoRequest(
            "chat",
            chat="Write a haiku about autumn.",
            params=api.SamplingParams(max_tokens=40, temperature=0.7, seed=2),
        ),
        DemoRequest(
            "n=2 completions",
            prompt="Once upon a time",
            params=api.SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=3),
        ),
    ]


@dataclass
class Timing:
    ttft_s: float
    latency_s: float
    completion_tokens: int


async def run_request(
    stub: api_grpc.GenerationStub, request: DemoRequest, show: bool, metadata: tuple[tuple[str, str], ...] = ()
) -> Timing:
    """Stream one request; with ``show``, print each completion's text as it arrives. ``metadata``: sent with the
    call (the API key)."""
    start = time.perf_counter()
    if request.chat:
        message = api.ChatMessage(role="user", content=[api.ContentPart(text=request.chat)])
        call = stub.Chat(api.ChatRequest(messages=[message], sampling_params=request.params), metadata=metadata)
    else:
        request_pb = api.GenerateRequest(prompt=request.prompt, sampling_params=request.params)
        call = stub.Generate(request_pb, metadata=metadata)
    ttft = None
    completion_tokens = 0
    texts: dict[int, str] = {}
    async for response in call:
        if ttft is None and any(o.token_ids for o in response.outputs):
            ttft = time.perf_counter() - start
        for output in response.outputs:
            texts[output.index] = texts.get(output.index, "") + output.text
            if show and request.params.n <= 1:
                sys.stdout.write(output.text)
                sys.stdout.flush()
        completion_tokens = response.usage.completion_tokens
    latency = time.perf_counter() - start
    if show and request.params.n > 1:
        for index in sorted(texts):
            print(f"\n  [{index}] {texts[index]!r}", end="")
    return Timing(ttft if ttft is not None else latency, latency, completion_tokens)


async def run_demo(address: str, tls: ClientTLS | None = None, api_key: str | None = None) -> int:
    """Each request streamed live, one after the other; then all at once (batched by the core). Returns 0.
    ``tls``: the frontend serves TLS; ``api_key``: it requires that key."""
    metadata = bearer_metadata(api_key)
    async with secure_or_insecure_aio_channel(address, tls) as channel:
        stub = api_grpc.GenerationStub(channel)
        info = await stub.GetModelInfo(api.GetModelInfoRequest(), metadata=metadata)
        print(f"model {info.model} (max_model_len {info.max_model_len}, vocabulary {info.vocab_size}) at {address}\n")
        for request in demo_requests():
            shown = request.chat or request.prompt
            print(f"--- {request.label}: {shown!r}\n", end="")
            timing = await run_request(stub, request, show=True, metadata=metadata)
            print(
                f"\n    TTFT {timing.ttft_s * 1000:.0f} ms, latency {timing.latency_s * 1000:.0f} ms, "
                f"{timing.completion_tokens} tokens\n"
            )
        requests = demo_requests()
        start = time.perf_counter()
        timings = await asyncio.gather(*(run_request(stub, r, show=False, metadata=metadata) for r in requests))
        wall = time.perf_counter() - start
        print(f"--- the same {len(requests)} requests at once: {wall:.2f} s in all")
        for request, timing in zip(requests, timings, strict=True):
            ttft_ms, latency_ms = timing.ttft_s * 1000, timing.latency_s * 1000
            print(
                f"    {request.label:<26} TTFT {ttft_ms:6.0f} ms   latency {latency_ms:6.0f} ms   "
                f"{timing.completion_tokens} tokens"
            )
    return 0
