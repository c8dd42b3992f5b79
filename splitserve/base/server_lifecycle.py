"""The start-up and shutdown sequence both gRPC servers run (``splitserve core``, ``splitserve frontend`` /
``serve``), once: tracing and metrics, listen, load on a daemon thread while health says NOT_SERVING, freeze the
startup heap out of garbage collection, serve, and on SIGTERM / SIGINT stop admitting, drain, stop. Each server
gives what differs as a ``ServerHooks``.

Exit codes: 0 after a drain (or a signal during the load), 1 when the load failed or the server died
(``ServerControl.die``: its engine core is down), without a drain.
"""

from __future__ import annotations

import abc
import asyncio
import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from splitserve.base import grpc_runtime, metrics, tracing
from splitserve.base.metrics_server import MetricsServer

T = TypeVar("T")
# How often a drain looks whether what it waits for has finished.
DRAIN_POLL_S = 0.05


@dataclass
class ServerObservability:
    """A server's tracing (``tracer_provider``; None: off, no ``OTEL_*`` endpoint) and Prometheus metrics
    (``registry``, served on ``--metrics-port``; None: no endpoint). ``shutdown`` exports the last spans of
    every provider made here and stops the endpoint."""

    tracer_provider: TracerProvider | None
    registry: CollectorRegistry | None
    metrics_server: MetricsServer | None = None
    _tracer_providers: list[TracerProvider] = field(default_factory=list)

    @classmethod
    def start(cls, tracing_service_name: str, options: grpc_runtime.ServerOptions) -> ServerObservability:
        """Tracing as ``tracing_service_name`` (OpenTelemetry's service.name), and the /metrics endpoint when
        ``options.metrics_port`` is set.

        Raises:
            OSError: the metrics port cannot be bound.
        """
        registry = metrics.make_registry() if options.metrics_port is not None else None
        observability = cls(None, registry)
        observability.tracer_provider = observability.start_tracer_provider(tracing_service_name)
        if registry is not None and options.metrics_port is not None:
            observability.metrics_server = MetricsServer(registry, options.metrics_port, options.metrics_bind_host)
        return observability

    def start_tracer_provider(self, tracing_service_name: str) -> TracerProvider | None:
        """One more tracer provider (the in-process core's, as its own service), shut down with the others."""
        provider = tracing.init_tracer_provider(tracing_service_name)
        if provider is not None:
            self._tracer_providers.append(provider)
        return provider

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The server's tracing interceptor (when on), then the gRPC calls counter (with metrics)."""
        interceptors = tracing.grpc_server_interceptors(self.tracer_provider)
        if self.registry is not None:
            interceptors.append(metrics.GrpcMetricsInterceptor(self.registry))
        return interceptors

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        for provider in self._tracer_providers:
            provider.shutdown()  # exports what is left


class ServerControl:
    """What a server's hooks may ask of the running sequence, from any thread."""

    def __init__(self, health: grpc_runtime.HealthServicer, readiness_service: str) -> None:
        self._event_loop = asyncio.get_running_loop()
        self._health = health
        self._readiness_service = readiness_service
        self.stop = asyncio.Event()  # set by SIGTERM / SIGINT, or by ``die``
        self.death: BaseException | None = None  # why the server died, once it has

    def die(self, error: BaseException) -> None:
        """The engine core is down for good: stop serving and exit 1, without a drain."""

        def stop_serving() -> None:
            if self.death is None:
                self.death = error
            self.stop.set()

        self._event_loop.call_soon_threadsafe(stop_serving)

    def set_serving_soon(self, serving: bool) -> None:
        """Readiness to SERVING or NOT_SERVING, on the event loop, soon."""
        health, names = self._health, [self._readiness_service]
        self._event_loop.call_soon_threadsafe(
            lambda: self._event_loop.create_task(grpc_runtime.set_serving(health, names, serving))
        )


class ServerHooks(abc.ABC, Generic[T]):
    """What one server does at each step of ``serve_until_stopped``, ``T`` being what it loads (an
    ``EngineCore``, an ``AsyncLLM``). Lines go to ``logger``, the server module's, so that they keep its name."""

    def __init__(
        self,
        name: str,
        readiness_service: str,
        logger: logging.Logger,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.name = name  # "core", "frontend": its log lines say "splitserve {name} ..."
        self.readiness_service = readiness_service  # the gRPC service whose health status is readiness
        self.logger = logger
        self.interceptors = interceptors  # after tracing and metrics (an API key's refusals are counted too)

    @abc.abstractmethod
    def add_servicers(self, server: grpc.aio.Server) -> None:
        """Register the server's own services (health and reflection are added after them)."""

    @abc.abstractmethod
    def log_listening(self, host: str, port: int, transport: str) -> None:
        """Its "listening" line, once the port is bound."""

    @abc.abstractmethod
    def load(self, control: ServerControl) -> T:
        """The slow part (the model, a first core), on a daemon thread; a signal meanwhile ends the server (0)."""

    @abc.abstractmethod
    def load_failed_message(self) -> str:
        """The error line (with the traceback) when ``load`` raised; the server then exits 1."""

    def loaded(self, loaded: T) -> None:  # noqa: B027 (a hook that may do nothing)
        """On the event loop, with what ``load`` returned; what it makes is part of the frozen startup heap."""

    @abc.abstractmethod
    def start(self, control: ServerControl) -> bool:
        """Start serving (after the freeze); returns whether the server is ready now."""

    def ready_details(self) -> str:
        """What follows "splitserve {name} ready on host:port" in its log line."""
        return ""

    @abc.abstractmethod
    def stop_admitting(self) -> None:
        """From SIGTERM (or death) on: take no new requests. Readiness goes NOT_SERVING next."""

    @abc.abstractmethod
    async def drain(self, death: BaseException | None, shutdown_timeout_s: float) -> None:
        """Let what is in flight finish, for up to ``shutdown_timeout_s`` (``death`` None), or say why there is
        nothing to wait for; then end what is left (the gRPC server stops right after)."""

    def stopped(self) -> None:  # noqa: B027 (a hook that may do nothing)
        """After the gRPC server has stopped."""

    async def open_listeners(self, host: str) -> None:  # noqa: B027 (a hook that may do nothing)
        """Other listeners beside the gRPC port (the frontend's HTTP API), once it is bound; ``host`` is the gRPC
        server's. They serve from the same event loop; what they answer follows the server's state."""

    async def close_listeners(self) -> None:  # noqa: B027 (a hook that may do nothing)
        """Stop what ``open_listeners`` opened: after the gRPC server has stopped, or when the server ends early."""


async def serve_until_stopped(
    options: grpc_runtime.ServerOptions,
    tracing_service_name: str,
    make_hooks: Callable[[ServerObservability], ServerHooks[T]],
) -> int:
    """Run a server until SIGTERM / SIGINT, or until it dies; returns the process exit code (see the module
    docstring). ``make_hooks`` gets the server's tracing and metrics.

    Raises:
        ValueError: a TLS file cannot be read or is not PEM (``make_hooks`` may raise it too).
        OSError: the metrics port cannot be bound.
    """
    observability = ServerObservability.start(tracing_service_name, options)
    try:
        hooks = make_hooks(observability)
        return await _serve(options, hooks, [*observability.server_interceptors(), *hooks.interceptors])
    finally:
        gc.unfreeze()  # what _serve froze is collectable again, for a process that goes on (the tests)
        observability.shutdown()


async def _serve(
    options: grpc_runtime.ServerOptions, hooks: ServerHooks[T], interceptors: list[grpc.aio.ServerInterceptor]
) -> int:
    server = grpc_runtime.make_server(options.message_limits, interceptors)
    hooks.add_servicers(server)
    health = await grpc_runtime.add_health_and_reflection(server, [hooks.readiness_service])
    port = grpc_runtime.add_port(server, options)
    await server.start()
    hooks.log_listening(options.host, port, grpc_runtime.describe_transport(options))
    try:
        await hooks.open_listeners(options.host)
    except BaseException:  # a port in use: nothing serves, the error goes to the command line
        await hooks.close_listeners()
        await grpc_runtime.stop_server(server, health, 0)
        raise
    try:
        return await _serve_loaded(options, hooks, server, health, port)
    finally:
        await hooks.close_listeners()


async def _serve_loaded(
    options: grpc_runtime.ServerOptions,
    hooks: ServerHooks[T],
    server: grpc.aio.Server,
    health: grpc_runtime.HealthServicer,
    port: int,
) -> int:
    control = ServerControl(health, hooks.readiness_service)
    grpc_runtime.on_termination(control.stop.set)
    load = grpc_runtime.run_in_daemon_thread(lambda: hooks.load(control))
    stopped = asyncio.ensure_future(control.stop.wait())
    waits: set[asyncio.Future[Any]] = {load, stopped}
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if load not in done:
        await grpc_runtime.stop_server(server, health, 0)
        return 0
    try:
        loaded = load.result()
    except Exception:
        hooks.logger.exception(hooks.load_failed_message())
        await grpc_runtime.stop_server(server, health, 0)
        return 1
    hooks.loaded(loaded)
    # The startup heap (modules, tokenizer, the model) is left out of garbage collection from now on, as vLLM's
    # servers do: each full collection otherwise walks it again, and with the objects of an n = 16384 request on
    # top that paused the event loop (liveness answers included) for a third of a second.
    gc.collect()
    gc.freeze()
    ready = hooks.start(control)
    await grpc_runtime.set_serving(health, [hooks.readiness_service], ready)
    hooks.logger.info("splitserve %s ready on %s:%d%s", hooks.name, options.host, port, hooks.ready_details())

    await control.stop.wait()
    hooks.stop_admitting()
    await grpc_runtime.set_serving(health, [hooks.readiness_service], False)
    await hooks.drain(control.death, options.shutdown_timeout_s)
    await grpc_runtime.stop_server(server, health, 1.0)
    hooks.stopped()
    hooks.logger.info("splitserve %s stopped", hooks.name)
    return 1 if control.death is not None else 0


async def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` on the event loop every ``DRAIN_POLL_S`` until it is true or ``timeout_s`` has passed;
    returns its last answer."""
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    return done()
