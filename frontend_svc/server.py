"""``splitserve frontend`` (cores over gRPC) and ``splitserve serve`` (the core in-process): the public API.

Health: "" (liveness) is SERVING while the process runs; ``splitserve.frontend.v1.Generation`` (readiness) is
NOT_SERVING until a core is reachable (or loaded), while every core is unreachable, and from SIGTERM on. On
SIGTERM the frontend stops taking calls, lets streams in flight finish for up to ``shutdown_timeout_s``, then
closes them and exits 0.

An in-process core (``serve``) that dies (declared dead after failed steps, or any fault on its thread) cannot
come back: as a split core would, the server then goes NOT_SERVING and exits 1 once its calls have ended (each
with the error the core gave its request), for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.config import FrontendConfig
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.core_client_factory import check_core_settings, make_client
from frontend_svc.service import GENERATION_GRPC_SERVICE, FrontendServerState, GenerationServicer
from frontend_svc.stat_logger import PrometheusStatLogger, StatLogger
from frontend_svc.tokenizer import load_tokenizer
from splitserve.base import grpc_runtime, metrics, tracing
from splitserve.base.api_key import ApiKeyInterceptor
from splitserve.base.metrics_server import MetricsServer
from splitserve.base.model_files import resolve_model_path
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

logger = logging.getLogger(__name__)


async def serve_frontend(
    model: str,
    core_addresses: list[str] | None,
    options: grpc_runtime.ServerOptions,
    frontend: FrontendConfig | None = None,
    **core_config: Any,
) -> int:
    """Run until SIGTERM / SIGINT, or until an in-process core dies; returns the exit code (0 after a drain, 1 if
    the engine could not start or the in-process core died). ``core_addresses`` None runs the core in this process
    with ``core_config``. ``options``: where and how it listens (TLS, the metrics endpoint: none without
    ``metrics_port``; in-process, the core's metrics too). ``frontend``: chat templates, the model's sampling
    defaults (``generation_config``, as vLLM's ``--generation-config``), the API key, TLS to the cores, the
    most completions a call may ask for (``max_n``), the name clients see the model by (``served_model_name``).
    Tracing follows the ``OTEL_*`` environment (``splitserve.base.tracing``).

    Raises:
        ValueError: a TLS file cannot be read or is not PEM; engine-core settings given with ``core_addresses``.
        OSError: the metrics port cannot be bound.
    """
    check_core_settings(core_addresses, core_config)
    frontend = frontend or FrontendConfig()
    tracer_provider = tracing.init_tracer_provider(tracing.FRONTEND_TRACING_SERVICE_NAME)
    registry = metrics.make_registry() if options.metrics_port is not None else None
    metrics_server = None
    if registry is not None and options.metrics_port is not None:
        metrics_server = MetricsServer(registry, options.metrics_port, options.metrics_bind_host)
    observability = _Observability(tracer_provider, registry)
    try:
        return await _serve(model, core_addresses, options, frontend, observability, core_config)
    finally:
        gc.unfreeze()  # what _serve froze is collectable again, for a process that goes on (the tests)
        if metrics_server is not None:
            metrics_server.stop()
        observability.shutdown()


@dataclass
class _Observability:
    tracer_provider: TracerProvider | None  # None: tracing is off
    registry: CollectorRegistry | None  # None: no metrics
    core_tracer_provider: TracerProvider | None = None  # the in-process core's, as service splitserve-core

    def shutdown(self) -> None:
        for provider in (self.tracer_provider, self.core_tracer_provider):
            if provider is not None:
                provider.shutdown()  # exports what is left


async def _serve(
    model: str,
    core_addresses: list[str] | None,
    options: grpc_runtime.ServerOptions,
    frontend: FrontendConfig,
    observability: _Observability,
    core_config: dict[str, Any],
) -> int:
    host, shutdown_timeout_s = options.host, options.shutdown_timeout_s
    model_name = frontend.served_model_name or model
    state = FrontendServerState(
        model=model_name, trust_request_chat_template=frontend.trust_request_chat_template, max_n=frontend.max_n
    )
    provider, registry = observability.tracer_provider, observability.registry
    if provider is not None:
        state.tracer = provider.get_tracer("splitserve.frontend")
    interceptors = tracing.grpc_server_interceptors(provider)
    if registry is not None:
        interceptors.append(metrics.GrpcMetricsInterceptor(registry))
    if frontend.api_key is not None:  # last: the calls it refuses are traced and counted too
        interceptors.append(ApiKeyInterceptor(frontend.api_key))
    if frontend.core_tls is not None:
        frontend.core_tls.credentials()  # a file that cannot be read fails here, before anything listens
    server = grpc_runtime.make_server(options.message_limits, interceptors)
    api_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
    health = await grpc_runtime.add_health_and_reflection(server, [GENERATION_GRPC_SERVICE])
    bound = grpc_runtime.add_port(server, options)
    await server.start()
    where = ", ".join(core_addresses) if core_addresses else "in-process"
    logger.info(
        "splitserve frontend listening on %s:%d, %s, %s (engine core: %s%s)",
        host,
        bound,
        grpc_runtime.describe_transport(options),
        "API key required" if frontend.api_key is not None else "no API key",
        where,
        ", TLS" if frontend.core_tls is not None else "",
    )

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    grpc_runtime.on_termination(stop.set)
    core_death: list[BaseException] = []  # why the in-process core died, once it has

    def on_core_death(error: BaseException) -> None:  # on the core's thread
        def stop_serving() -> None:
            core_death.append(error)
            stop.set()

        loop.call_soon_threadsafe(stop_serving)

    def set_serving(available: bool) -> None:  # from the client's transport thread
        if state.engine is not None and not state.draining:
            if available:
                state.engine.refresh_engine_info()  # the core may have come back with other settings
            loop.call_soon_threadsafe(
                lambda: loop.create_task(grpc_runtime.set_serving(health, [GENERATION_GRPC_SERVICE], available))
            )

    def build() -> AsyncLLM:
        model_path = resolve_model_path(model, weights=not core_addresses)
        state.tokenizer = load_tokenizer(model_path)
        if core_addresses:
            from frontend_svc.grpc_client import GrpcCoreClient

            client: EngineCoreClient = GrpcCoreClient(
                core_addresses, wait_ready_s=None, tracer_provider=provider, tls=frontend.core_tls
            )
            client.add_availability_listener(set_serving)  # type: ignore[attr-defined]
        else:
            client = make_client(str(resolve_model_path(model)), None, True, **core_config)
            client.add_death_listener(on_core_death)  # type: ignore[attr-defined]
            observability.core_tracer_provider = tracing.init_tracer_provider(tracing.CORE_TRACING_SERVICE_NAME)
            client.observe_core(model_name, registry, observability.core_tracer_provider)  # type: ignore[attr-defined]
        stat_loggers: list[StatLogger] = []
        if registry is not None:
            stat_loggers.append(PrometheusStatLogger(registry, model_name, client.get_engine_info().max_model_len))
        return AsyncLLM(
            str(model_path),
            tokenizer=state.tokenizer,
            stat_loggers=stat_loggers,
            generation_config=frontend.generation_config,
            engine_core_client=client,
        )

    starting = grpc_runtime.run_in_daemon_thread(build)
    done, _ = await asyncio.wait({starting, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if starting not in done:
        await grpc_runtime.stop_server(server, health, 0)
        return 0
    try:
        state.engine = starting.result()
    except Exception:
        logger.exception("could not start the engine for %s", model)
        await grpc_runtime.stop_server(server, health, 0)
        return 1
    # The startup heap (modules, tokenizer; the model, in-process) is left out of garbage collection from now on,
    # as vLLM's servers do: each full collection otherwise walks it again, and with the objects of an n = 16384
    # request on top that paused the event loop (liveness answers included) for a third of a second.
    gc.collect()
    gc.freeze()
    available = getattr(state.engine.engine_core, "is_available", lambda: True)()
    await grpc_runtime.set_serving(health, [GENERATION_GRPC_SERVICE], available)
    logger.info("splitserve frontend ready on %s:%d", host, bound)

    await stop.wait()
    state.draining = True
    await grpc_runtime.set_serving(health, [GENERATION_GRPC_SERVICE], False)
    if core_death:  # every request has its error on the way: the calls end as soon as they get it
        logger.error(
            "the in-process engine core is down (%s): NOT_SERVING; exiting once its %d call(s) have their errors",
            core_death[0],
            state.active_calls,
        )
    else:
        logger.info("shutting down: %d call(s) in flight, waiting up to %.0f s", state.active_calls, shutdown_timeout_s)
    deadline = time.monotonic() + shutdown_timeout_s
    while state.active_calls and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    state.engine.close()  # calls still running end now, with UNAVAILABLE, rather than being cancelled
    for _ in range(40):
        if not state.active_calls:
            break
        await asyncio.sleep(0.05)
    await grpc_runtime.stop_server(server, health, 1.0)
    logger.info("splitserve frontend stopped")
    return 1 if core_death else 0
