"""``splitserve core``: the engine core as a gRPC server.

Health: "" (liveness) is SERVING while the process runs; ``splitserve.engine.v1.EngineCore`` (readiness) is
NOT_SERVING until the model is loaded and from SIGTERM on. On SIGTERM the core stops admitting,
lets in-flight requests finish for up to ``shutdown_timeout_s``, aborts what is left, and exits 0.

A step whose model runner raises fails only its own requests (INTERNAL); the core keeps serving. If the engine
dies (declared dead after ``max_consecutive_failed_steps`` failed steps in a row, or any fault outside the
model runner), its requests end with UNAVAILABLE, readiness goes NOT_SERVING, and the process exits 1 without a
drain, for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from core_svc.admin import AdminPolicy
from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.observability import observe_engine
from core_svc.service import ENGINE_CORE_GRPC_SERVICE, CoreServerState, EngineCoreServicer
from core_svc.startup import process_age_s
from splitserve.base import grpc_runtime, metrics, tracing
from splitserve.base.metrics_server import MetricsServer
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


async def serve_core(config: CoreConfig, options: grpc_runtime.ServerOptions, admin: AdminPolicy | None = None) -> int:
    """Run until SIGTERM / SIGINT, or until the engine dies; returns the process exit code (0 after a clean
    drain, 1 if loading failed or the engine died). ``options``: where and how it listens (TLS, the metrics
    endpoint: none without ``metrics_port``). ``admin``: whether ResetPrefixCache / StartProfile / StopProfile are
    on, and where profiles go (default: off). Tracing follows the ``OTEL_*`` environment (``splitserve.base.tracing``).

    Raises:
        ValueError: a TLS file cannot be read or is not PEM.
        OSError: the metrics port cannot be bound.
    """
    message_limits = options.message_limits
    state = CoreServerState(
        max_receive_message_bytes=message_limits.receive_bytes,
        max_send_message_bytes=message_limits.send_bytes,
        admin=admin or AdminPolicy(),
    )
    tracer_provider = tracing.init_tracer_provider(tracing.CORE_TRACING_SERVICE_NAME)
    registry = metrics.make_registry() if options.metrics_port is not None else None
    interceptors = tracing.grpc_server_interceptors(tracer_provider)
    if registry is not None:
        interceptors.append(metrics.GrpcMetricsInterceptor(registry))
    metrics_server = None
    if registry is not None and options.metrics_port is not None:
        metrics_server = MetricsServer(registry, options.metrics_port, options.metrics_bind_host)
    try:
        return await _serve(config, state, options, interceptors, registry, tracer_provider)
    finally:
        gc.unfreeze()  # what _serve froze is collectable again, for a process that goes on (the tests)
        if metrics_server is not None:
            metrics_server.stop()
        if tracer_provider is not None:
            tracer_provider.shutdown()  # exports what is left


async def _serve(
    config: CoreConfig,
    state: CoreServerState,
    options: grpc_runtime.ServerOptions,
    interceptors: list[object],
    registry: CollectorRegistry | None,
    tracer_provider: TracerProvider | None,
) -> int:
    host, shutdown_timeout_s = options.host, options.shutdown_timeout_s
    server = grpc_runtime.make_server(options.message_limits, interceptors)
    pb_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(state), server)
    health = await grpc_runtime.add_health_and_reflection(server, [ENGINE_CORE_GRPC_SERVICE])
    bound = grpc_runtime.add_port(server, options)
    await server.start()
    logger.info(
        "splitserve core listening on %s:%d, %s (loading %s)",
        host,
        bound,
        grpc_runtime.describe_transport(options),
        config.model,
    )
    if state.admin.enabled:
        logger.warning(
            "admin RPCs are on (ResetPrefixCache, StartProfile, StopProfile): every client that reaches this port "
            "may call them; profiles go under %s",
            state.admin.profile_dir,
        )

    stop = asyncio.Event()
    grpc_runtime.on_termination(stop.set)
    load = grpc_runtime.run_in_daemon_thread(lambda: EngineCore(config))
    done, _ = await asyncio.wait({load, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if load not in done:
        await grpc_runtime.stop_server(server, health, 0)
        return 0
    try:
        engine_core = load.result()
    except Exception:
        logger.exception("could not load %s", config.model)
        await grpc_runtime.stop_server(server, health, 0)
        return 1
    observe_engine(engine_core, config.model_name, registry, tracer_provider)
    # As the frontend does (and vLLM's EngineCore): the startup heap, the model's included, is left out of garbage
    # collection, so a full collection walks only what requests made (16384 of them at once, with n = 16384).
    gc.collect()
    gc.freeze()
    engine_loop = EngineLoop(engine_core)
    failed = False

    def on_death(error: BaseException) -> None:  # the engine thread died: stop serving, exit non-zero
        nonlocal failed
        failed = True
        event_loop.call_soon_threadsafe(stop.set)

    event_loop = asyncio.get_running_loop()
    engine_loop.on_death(on_death)
    engine_loop.start()
    state.engine_loop = engine_loop
    await grpc_runtime.set_serving(health, [ENGINE_CORE_GRPC_SERVICE], True)
    age_s = process_age_s()
    logger.info(
        "splitserve core ready on %s:%d%s", host, bound, f", {age_s:.1f} s after its process started" if age_s else ""
    )

    await stop.wait()
    state.draining = True
    await grpc_runtime.set_serving(health, [ENGINE_CORE_GRPC_SERVICE], False)
    if failed:  # nothing to drain: the loop already ended every request (INTERNAL or UNAVAILABLE)
        logger.error(
            "the engine core is down (%s): NOT_SERVING; its requests have ended, exiting without a drain",
            engine_loop.dead_error,
        )
    else:
        logger.info(
            "shutting down: draining %d request(s) for up to %.0f s",
            engine_loop.num_unfinished_requests(),
            shutdown_timeout_s,
        )
        deadline = time.monotonic() + shutdown_timeout_s
        while engine_loop.num_unfinished_requests() and time.monotonic() < deadline and engine_loop.is_alive:
            await asyncio.sleep(0.05)
        left = engine_loop.num_unfinished_requests()
        if left:
            logger.warning("aborting %d request(s) still running after %.0f s", left, shutdown_timeout_s)
    state.end_streams()  # the requests still on them are aborted as they close
    await grpc_runtime.stop_server(server, health, 1.0)
    engine_loop.stop()
    logger.info("splitserve core stopped")
    return 1 if failed else 0
