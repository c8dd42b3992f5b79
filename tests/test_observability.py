"""Traces and metrics of the split stack as real processes on loopback.

Both services export their spans over OTLP (the standard ``OTEL_*`` variables) to a collector this test runs
in memory, and serve Prometheus metrics (``--metrics-port``). One Generate call arrives with a caller's
``traceparent``; a known workload follows; the scraped counters must equal that workload, computed here from
the requests themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from splitserve.base.tracing import SpanAttributes
from splitserve.entrypoints import stack
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.metrics_helpers import sample, scrape, scrape_when

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
# The HTTP API's traced completion: its own trace, WORKLOAD[3]'s prompt.
HTTP_TRACE_ID, HTTP_CALLER_SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HTTP_MAX_TOKENS = 3
CORE_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "256"]
# The names each server reports the model by (--served-model-name): metrics labels, the frontend's spans.
CORE_NAME, FRONTEND_NAME = "tiny-core", "tiny"
# (prompt token ids, max_tokens): all prompts shorter than a KV block, so no prefix-cache hits.
WORKLOAD = [([5, 6, 7], 4), ([8, 9, 10, 11, 12], 7), ([13] * 14, 1), ([20, 21, 22, 23], 5)]


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, object]
    events: list[str]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span in memory."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            Span(
                                service=str(resource.get("service.name")),
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_span_id=span.parent_span_id.hex(),
                                kind=span.kind,
                                attributes={a.key: _value(a.value) for a in span.attributes},
                                events=[e.name for e in span.events],
                            )
                        )
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(any_value) -> object:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclass
class Run:
    traced_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # what the stop-token request returned
    http_token_ids: list[int] = field(default_factory=list)  # what the HTTP API's completion returned
    frontend_metrics: str = ""
    core_metrics: str = ""
    spans: list[Span] = field(default_factory=list)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model

    return str(make_test_model(tmp_path_factory.mktemp("observed-model"), "llama", "tiny"))


@pytest.fixture(scope="module")
def run(model, tmp_path_factory) -> Run:
    collector = Collector()
    receiver = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, receiver)
    receiver_port = receiver.add_insecure_port("127.0.0.1:0")
    receiver.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver_port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    logs = tmp_path_factory.mktemp("observed-logs")
    core_metrics_port, frontend_metrics_port = stack.free_port(), stack.free_port()
    result = Run()
    core = frontend = None
    try:
        with patched_environ(env):  # the children take it; ours goes back
            core_args = [*CORE_ARGS, "--metrics-port", str(core_metrics_port), "--served-model-name", CORE_NAME]
            core = stack.start_core(model, logs, core_args)
            frontend_args = ["--metrics-port", str(frontend_metrics_port), "--served-model-name", FRONTEND_NAME]
            http_port = stack.free_port()
            frontend_args += ["--http-port", str(http_port)]
            frontend = stack.start_frontend(model, [core.address], logs, frontend_args)
        core.wait_serving()
        frontend.wait_serving()
        asyncio.run(_workload(frontend.address, result))
        result.http_token_ids = _http_completion(http_port)
        # A call is counted when its handler's task ends, which may be just after its client has the status.
        result.frontend_metrics = scrape_when(
            f"127.0.0.1:{frontend_metrics_port}",
            lambda text: (
                "splitserve:grpc_server_handled_total" in text
                and sample(text, "splitserve:grpc_server_handled_total", grpc_method="Generate")
                == expected_counts(result)["grpc_requests"] + 1
            ),  # the requests and the refused call
        )
        result.core_metrics = scrape(f"127.0.0.1:{core_metrics_port}")
    finally:
        for process in (frontend, core):
            if process is not None:
                assert process.stop() == 0
        receiver.stop(grace=1).wait()
    result.spans = collector.spans
    return result


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def greedy(max_tokens: int, **kwargs) -> api.SamplingParams:
    return api.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=api.OUTPUT_KIND_DELTA, **kwargs
    )


async def _workload(address: str, result: Run) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_grpc.GenerationStub(channel)

        async def call(prompt: list[int], params: api.SamplingParams, metadata: tuple = ()) -> list[int]:
            request = api.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
            responses = [r async for r in stub.Generate(request, metadata=metadata)]
            return [t for r in responses for t in r.outputs[0].token_ids]

        # The traced call: all of WORKLOAD[0].
        prompt, max_tokens = WORKLOAD[0]
        result.traced_token_ids = await call(prompt, greedy(max_tokens), (("traceparent", TRACEPARENT),))
        await asyncio.gather(*(call(p, greedy(m)) for p, m in WORKLOAD[1:]))
        # One that a stop token ends: WORKLOAD[1]'s prompt again, stopping at the third token it produces
        # greedily (the first occurrence of that token ends it).
        reference = await call(WORKLOAD[1][0], greedy(5))
        result.stop_token_ids = await call(WORKLOAD[1][0], greedy(5, stop_token_ids=[reference[2]]))
        assert result.stop_token_ids == reference[: reference.index(reference[2]) + 1]
        # Refused by the frontend (not a request: no token or request counter moves).
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call([], greedy(1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _http_completion(port: int) -> list[int]:
    """A greedy completion of WORKLOAD[3]'s prompt over the HTTP API, traced by the caller: its token ids."""
    import httpx2 as httpx

    body = {
        "prompt": WORKLOAD[3][0],
        "max_tokens": HTTP_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    headers = {"traceparent": f"00-{HTTP_TRACE_ID}-{HTTP_CALLER_SPAN_ID}-01"}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def expected_counts(run: Run) -> dict[str, float]:
    """Requests, tokens and finish reasons of the whole workload (the gRPC calls and the HTTP one), from the
    requests themselves."""
    prompts = [p for p, _ in WORKLOAD] + [WORKLOAD[1][0]] * 2 + [WORKLOAD[3][0]]
    generated = [len(run.traced_token_ids)] + [m for _, m in WORKLOAD[1:]] + [5, len(run.stop_token_ids)]
    generated.append(len(run.http_token_ids))
    return {
        "requests": len(prompts),
        "grpc_requests": len(prompts) - 1,
        "length": len(prompts) - 1,
        "stop": 1,
        "prompt_tokens": sum(len(p) for p in prompts),
        "generation_tokens": sum(generated),
        "decode_outputs": sum(g - 1 for g in generated),  # one token per output after the first
    }


def test_frontend_metrics_equal_the_workload(run):
    want = expected_counts(run)
    text = run.frontend_metrics
    assert sample(text, "splitserve:request_success_total", finished_reason="length") == want["length"]
    assert sample(text, "splitserve:request_success_total", finished_reason="stop") == want["stop"]
    assert sample(text, "splitserve:request_success_total", finished_reason="abort") == 0
    assert sample(text, "splitserve:prompt_tokens_total") == want["prompt_tokens"]
    assert sample(text, "splitserve:generation_tokens_total") == want["generation_tokens"]
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_max_tokens",
    ):
        assert sample(text, f"splitserve:{histogram}_count") == want["requests"], histogram
    assert sample(text, "splitserve:request_prompt_tokens_sum") == want["prompt_tokens"]
    # Every request has n = 1: n and its one completion's tokens, once each.
    assert sample(text, "splitserve:request_params_n_count") == want["requests"]
    assert sample(text, "splitserve:request_params_n_sum") == want["requests"]
    assert sample(text, "splitserve:request_max_num_generation_tokens_sum") == want["generation_tokens"]
    assert sample(text, "splitserve:request_generation_tokens_sum") == want["generation_tokens"]
    assert sample(text, "splitserve:inter_token_latency_seconds_count") == want["decode_outputs"]
    handled = sample(text, "splitserve:grpc_server_handled_total", grpc_method="Generate", grpc_code="OK")
    assert handled == want["grpc_requests"]
    refused = sample(text, "splitserve:grpc_server_handled_total", grpc_method="Generate", grpc_code="INVALID_ARGUMENT")
    assert refused == 1
    assert sample(text, "splitserve:prompt_tokens_total", engine="0") == want["prompt_tokens"]  # labelled
    assert sample(text, "splitserve:prompt_tokens_total", model_name=FRONTEND_NAME) == want["prompt_tokens"]


def test_core_metrics_equal_the_workload(run):
    want = expected_counts(run)
    text = run.core_metrics
    assert sample(text, "splitserve:core_request_finished_total", finished_reason="length") == want["length"]
    assert sample(text, "splitserve:core_request_finished_total", finished_reason="stop") == want["stop"]
    assert sample(text, "splitserve:core_generation_tokens_total") == want["generation_tokens"]
    assert sample(text, "splitserve:core_generation_tokens_total", model_name=CORE_NAME) == want["generation_tokens"]
    assert sample(text, "splitserve:prompt_tokens_by_source_total") == want["prompt_tokens"]
    assert sample(text, "splitserve:prompt_tokens_by_source_total", source="local_cache_hit") == 0
    for histogram in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert sample(text, f"splitserve:request_{histogram}_seconds_count") == want["requests"], histogram
    # vLLM's count: a request of P prompt tokens that generates G tokens adds P + G over its steps.
    assert sample(text, "splitserve:iteration_tokens_total_sum") == want["prompt_tokens"] + want["generation_tokens"]
    assert sample(text, "splitserve:num_requests_running") == 0
    assert sample(text, "splitserve:num_requests_waiting") == 0
    # vLLM's cache_config_info: the core's --num-kv-blocks and block size as labels
    cache_config = {
        "block_size": "16",
        "num_gpu_blocks": "64",
        "enable_prefix_caching": "True",
        "cache_dtype": "float32",
    }
    assert sample(text, "splitserve:cache_config_info", model_name=CORE_NAME, **cache_config) == 1
    assert sample(text, "splitserve:kv_cache_usage_perc") == 0
    assert sample(text, "splitserve:num_preemptions_total") == 0
    assert sample(text, "process_cpu_seconds_total") > 0


def test_one_trace_across_both_services(run):
    traced = [s for s in run.spans if s.trace_id == TRACE_ID]
    by_name = {s.name: s for s in traced}
    server = by_name["/splitserve.frontend.v1.Generation/Generate"]
    assert (server.service, server.parent_span_id) == ("splitserve-frontend", CALLER_SPAN_ID)
    request = by_name["llm_request"]
    assert (request.service, request.parent_span_id) == ("splitserve-frontend", server.span_id)
    core = by_name["core_request"]
    assert (core.service, core.parent_span_id) == ("splitserve-core", request.span_id)
    for phase in ("core_queue", "core_prefill", "core_decode"):
        assert (by_name[phase].service, by_name[phase].parent_span_id) == ("splitserve-core", core.span_id)
    assert core.events[:3] == ["queued", "scheduled", "first_token"] and core.events[-1] == "finished"

    prompt, max_tokens = WORKLOAD[0]
    attributes = request.attributes
    assert attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == len(prompt)
    assert attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == len(run.traced_token_ids) == max_tokens
    assert attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] == max_tokens
    assert attributes[SpanAttributes.GEN_AI_REQUEST_TEMPERATURE] == 0.0
    assert attributes[SpanAttributes.GEN_AI_REQUEST_N] == 1
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_MODEL] == FRONTEND_NAME
    latencies = [
        attributes[name]
        for name in (
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL,
            SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE,
            SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN,
            SpanAttributes.GEN_AI_LATENCY_E2E,
        )
    ]
    assert all(isinstance(x, float) and x >= 0 for x in latencies)
    assert latencies[3] <= latencies[4]  # TTFT within e2e
    assert core.attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == len(prompt)
    assert core.attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == max_tokens
    assert core.attributes[SpanAttributes.CORE_FINISH_REASON] == "length"


def test_an_http_request_continues_its_callers_trace_into_the_core(run):
    """The HTTP API's request gets vLLM's llm_request span, a SERVER span under the caller's traceparent, and the
    core's spans under it."""
    traced = {s.name: s for s in run.spans if s.trace_id == HTTP_TRACE_ID}
    request = traced["llm_request"]
    assert (request.service, request.parent_span_id) == ("splitserve-frontend", HTTP_CALLER_SPAN_ID)
    assert request.kind == 2  # SPAN_KIND_SERVER (OTLP's numbering)
    assert (traced["core_request"].service, traced["core_request"].parent_span_id) == (
        "splitserve-core",
        request.span_id,
    )
    attributes = request.attributes
    assert attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == len(WORKLOAD[3][0])
    assert attributes[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS] == len(run.http_token_ids) == HTTP_MAX_TOKENS
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert attributes[SpanAttributes.GEN_AI_RESPONSE_MODEL] == FRONTEND_NAME


def test_untraced_calls_start_their_own_traces(run):
    """The calls without a traceparent get one trace each, also across both services."""
    requests = [s for s in run.spans if s.name == "llm_request" and s.trace_id != TRACE_ID]
    assert len(requests) == expected_counts(run)["requests"] - 1
    core_requests = {s.trace_id: s for s in run.spans if s.name == "core_request"}
    for request in requests:
        assert core_requests[request.trace_id].parent_span_id == request.span_id


def test_the_stream_metadata_carries_the_connections_context(run):
    """The frontend's Connect stream is a CLIENT span whose context reaches the core in the stream's metadata."""
    client = [s for s in run.spans if s.service == "splitserve-frontend" and s.name.endswith("EngineCore/Connect")]
    server = [s for s in run.spans if s.service == "splitserve-core" and s.name.endswith("EngineCore/Connect")]
    assert len(client) == 1 and len(server) == 1
    assert (server[0].trace_id, server[0].parent_span_id) == (client[0].trace_id, client[0].span_id)


def test_no_tracing_without_the_environment(checkpoint, monkeypatch):
    """Tracing off: no provider, no exporter thread, no spans, not even to a global provider; the engine core
    gets no stats tracker."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from frontend_svc.server import serve_frontend
    from splitserve.base import tracing
    from splitserve.base.grpc_runtime import ServerOptions

    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.tracing_configured()
    assert tracing.init_tracer_provider("x") is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert not tracing.tracing_configured()

    exporter = InMemorySpanExporter()
    global_provider = TracerProvider()
    global_provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", global_provider)
    port = stack.free_port()
    metrics_port = stack.free_port()
    model = str(checkpoint("llama", "tiny"))

    async def scenario() -> tuple[list[int], list[str], str]:
        options = ServerOptions("127.0.0.1", port, metrics_port=metrics_port)
        server = asyncio.create_task(serve_frontend(model, None, options))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_grpc.GenerationStub(channel)
            for _ in range(600):
                try:
                    await stub.GetModelInfo(api.GetModelInfoRequest(), timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            request = api.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling_params=greedy(3))
            responses = [r async for r in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))]
        threads = [t.name for t in threading.enumerate()]
        text = await asyncio.to_thread(scrape, f"127.0.0.1:{metrics_port}")
        os.kill(os.getpid(), 15)  # SIGTERM: the server drains and returns
        assert await asyncio.wait_for(server, 60) == 0
        return [t for r in responses for t in r.outputs[0].token_ids], threads, text

    token_ids, threads, text = asyncio.run(scenario())
    assert len(token_ids) == 3
    assert not [t for t in threads if "otel" in t.lower() or "span" in t.lower()], threads
    assert exporter.get_finished_spans() == ()
    # `serve` runs the core in-process: one endpoint has both services' metrics.
    assert sample(text, "splitserve:generation_tokens_total") == 3
    assert sample(text, "splitserve:core_generation_tokens_total") == 3
    assert sample(text, "splitserve:request_queue_time_seconds_count") == 1


def test_console_exporter_and_bad_protocol(monkeypatch):
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    from splitserve.base import tracing

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = tracing.init_tracer_provider("splitserve-test")
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "splitserve-test"
    processor = provider._active_span_processor._span_processors[0]
    assert isinstance(processor.span_exporter, ConsoleSpanExporter)
    provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "named-by-env")
    provider = tracing.init_tracer_provider("splitserve-test")
    assert provider.resource.attributes["service.name"] == "named-by-env"
    provider.shutdown()
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        tracing.init_tracer_provider("splitserve-test")


def test_metrics_port_in_use_fails_clearly():
    from splitserve.base import metrics
    from splitserve.base.metrics_server import MetricsServer

    first = MetricsServer(metrics.make_registry(), 0, "127.0.0.1")
    try:
        with pytest.raises(OSError):
            MetricsServer(metrics.make_registry(), first.port, "127.0.0.1")
    finally:
        first.stop()
    time.sleep(0)


def test_the_calls_counter_keeps_health_watch_working():
    """Health Watch is a coroutine that writes its responses (not a generator); counted calls must still work."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.base import grpc_runtime, metrics

    async def scenario() -> tuple[list[int], float, float]:
        registry = metrics.make_registry()
        server = grpc_runtime.make_server(interceptors=[metrics.GrpcMetricsInterceptor(registry)])
        health = await grpc_runtime.add_health_and_reflection(server, ["svc"])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        statuses = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            live = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="svc"))
            async for response in watch:
                statuses.append(response.status)
                if len(statuses) == 1:
                    await grpc_runtime.set_serving(health, ["svc"], True)
                elif len(statuses) == 2:
                    await grpc_runtime.set_serving(health, ["svc"], False)
                else:
                    watch.cancel()
                    break
        await server.stop(None)
        labels = {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check", "grpc_code": "OK"}
        checks = registry.get_sample_value("splitserve:grpc_server_handled_total", labels)
        return (
            [live.status, *statuses],
            checks,
            registry.get_sample_value(
                "splitserve:grpc_server_handled_total", {**labels, "grpc_method": "Watch", "grpc_code": "UNKNOWN"}
            ),
        )

    statuses, checks, failed_watches = asyncio.run(scenario())
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses == [serving, not_serving, serving, not_serving]  # "" is live; "svc" follows set_serving
    assert checks == 1 and not failed_watches


class RecordingSpan:
    """The part of an OpenTelemetry span ``_RequestSpan`` uses, recording the attributes set."""

    def __init__(self) -> None:
        self.attributes: dict[str, object] = {}
        self.events: list[str] = []
        self.ended = False

    def set_attributes(self, attributes: dict[str, object]) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str) -> None:
        self.events.append(name)

    def end(self) -> None:
        self.ended = True


def test_request_span_of_n2_deltas_has_both_completions_reasons_and_the_first_ttft():
    """A DELTA output holds only the completions that changed: the span keeps each completion's finish reason
    as it comes, reports n sequences, and the smallest time to first token of the two; a cancelled call's
    unfinished completion reads abort."""
    from frontend_svc.outputs import CompletionOutput, RequestOutput
    from frontend_svc.sampling_params import RequestOutputKind, SamplingParams
    from frontend_svc.service import RequestSpan
    from frontend_svc.stats import RequestStateStats

    def delta(index: int, finish: str | None, first_token_latency: float) -> RequestOutput:
        completion = CompletionOutput(index, "x", [7], None, None, finish)
        stats = RequestStateStats(arrival_time=0.0, first_token_latency=first_token_latency)
        return RequestOutput("r", "p", [1, 2, 3], None, [completion], finish is not None, metrics=stats)

    params = SamplingParams(n=2, temperature=1.0, max_tokens=5, output_kind=RequestOutputKind.DELTA)
    for cancelled, reasons in ((False, ["stop", "length"]), (True, ["abort", "length"])):
        span = RecordingSpan()
        request_span = RequestSpan(span, "r", params, "m")  # type: ignore[arg-type]  # a recording stand-in
        request_span.update(delta(1, None, 0.25), 1)
        request_span.update(delta(0, None, 0.5), 2)
        request_span.update(delta(1, "length", 0.25), 3)
        if cancelled:
            request_span.cancelled()
        else:
            request_span.update(delta(0, "stop", 0.5), 4)
        request_span.end()
        assert span.ended and span.attributes[SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES] == 2
        assert span.attributes[SpanAttributes.GEN_AI_RESPONSE_FINISH_REASONS] == reasons
        assert span.attributes[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] == 0.25
        assert span.attributes[SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS] == 3
