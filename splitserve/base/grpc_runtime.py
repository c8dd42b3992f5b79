"""What both gRPC servers share: how they listen (address, message limits, TLS, metrics endpoint), health,
reflection, and SIGTERM handling. Imports grpc only."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.base.grpc_errors import GrpcErrorsInterceptor
from splitserve.base.tls import ServerTLS

logger = logging.getLogger(__name__)
T = TypeVar("T")

# What a server receives is requests: an EngineCoreRequest of a 1M-token prompt is about 5 MiB on the wire, a
# public Generate call with a 1M-token text a few MiB more. A larger message is refused by grpc before it is read
# into memory or parsed (RESOURCE_EXHAUSTED). What a server sends is outputs, which can be large: cumulative text
# with top-k logprobs of every token, prompt logprobs of a long prompt. gRPC's own default is 4 MiB both ways.
DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 16 * 2**20
DEFAULT_MAX_SEND_MESSAGE_BYTES = 256 * 2**20
MAX_MESSAGE_BYTES = 2**31 - 1  # the most grpc takes (an int32): no limit of our own
# Both sides ping every 2 s and drop a peer that does not answer within 2 s, so a core or frontend that hangs
# or loses its network (no TCP reset) is noticed within seconds. ``ping_timeout_ms`` is what grpcio honours
# for that; ``keepalive_timeout_ms`` alone leaves its 60 s default. Our servers accept pings this often; a
# proxy in between must too (or it answers GOAWAY "too_many_pings").
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 2000),
    # Accept what KEEPALIVE_OPTIONS sends: pings every 2 s with no call open. Without this a server counts such
    # pings as abuse and answers GOAWAY "too_many_pings" after a few idle seconds.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
]


@dataclass(frozen=True)
class MessageLimits:
    """The largest gRPC message a server takes and the largest it sends, in bytes, each sized for what it
    carries (``--max-receive-message-mib``, ``--max-send-message-mib``). A message over the receive limit is
    refused before it is parsed; one over the send limit fails its call (RESOURCE_EXHAUSTED both ways)."""

    receive_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES
    send_bytes: int = DEFAULT_MAX_SEND_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("receive_bytes", "send_bytes"):
            if not 0 < getattr(self, name) < 2**31:  # grpc takes an int32
                raise ValueError(f"{name} must be in [1, 2^31), got {getattr(self, name)}")

    @classmethod
    def from_mib(cls, receive_mib: float, send_mib: float) -> MessageLimits:
        """Limits given in MiB (the command line's unit).

        Raises:
            ValueError: a limit outside [1 byte, 2 GiB).
        """
        return cls(int(receive_mib * 2**20), int(send_mib * 2**20))

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.receive_bytes),
            ("grpc.max_send_message_length", self.send_bytes),
        ]


@dataclass(frozen=True)
class ServerOptions:
    """How a server listens: the flags both servers take (``--host``, ``--port``, message limits,
    ``--shutdown-timeout``, ``--metrics-host`` / ``--metrics-port``, ``--ssl-*``)."""

    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port
    message_limits: MessageLimits = MessageLimits()
    shutdown_timeout_s: float = 30.0  # how long in-flight requests get to finish after SIGTERM
    metrics_port: int | None = None  # None: no /metrics endpoint
    metrics_host: str | None = None  # the /metrics endpoint's address; None: ``host``
    tls: ServerTLS | None = None  # None: plaintext

    @property
    def metrics_bind_host(self) -> str:
        return self.metrics_host if self.metrics_host is not None else self.host


def add_port(server: grpc.aio.Server, options: ServerOptions) -> int:
    """Listen on ``options.host:options.port``, with TLS when ``options.tls`` is set; returns the port bound.

    Raises:
        ValueError: a TLS file cannot be read or is not PEM.
        RuntimeError: the address cannot be bound (grpc's error).
    """
    address = f"{options.host}:{options.port}"
    if options.tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, options.tls.credentials())


def describe_transport(options: ServerOptions) -> str:
    """For the startup log: "plaintext", "TLS" or "TLS, client certificates required"."""
    return options.tls.describe() if options.tls is not None else "plaintext"


def make_server(
    limits: MessageLimits | None = None, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
) -> grpc.aio.Server:
    """An asyncio server with ``limits`` (default: ``MessageLimits()``) and our keepalive; ``interceptors``
    (grpc.aio.ServerInterceptor: tracing, metrics) run on every call, in order, and then
    ``grpc_errors.GrpcErrorsInterceptor``: a request that does not parse is INVALID_ARGUMENT on every method."""
    return grpc.aio.server(
        options=(limits or MessageLimits()).options() + SERVER_KEEPALIVE_OPTIONS,
        interceptors=[*interceptors, GrpcErrorsInterceptor()],
    )


class HealthServicer(health.aio.HealthServicer):
    """grpcio-health-checking's asyncio servicer (``Check``, ``set``), with ``List``, and a ``Watch`` that ends,
    status OK, at ``end_watches``, after sending the latest status. grpc's own Watch never ends: one still open
    when the server stops is cancelled by grpc, which then may log a CancelledError traceback for it (at a plain
    SIGTERM, whenever a client watches)."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {
            "": health_pb2.HealthCheckResponse.SERVING
        }
        self._changed = asyncio.Condition()
        self._ending = False

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super().set(service, status)
        async with self._changed:
            self._statuses[service] = status
            self._changed.notify_all()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        """The service's status now and at every change (grpc.health.v1), until ``end_watches``."""
        last = None
        async with self._changed:
            while True:
                status = self._statuses.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                if self._ending:
                    return
                await self._changed.wait()

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """Every service's status (grpc.health.v1; grpc's asyncio servicer leaves it unimplemented, which answered
        UNKNOWN "Unexpected <class 'NotImplementedError'>")."""
        statuses = {name: health_pb2.HealthCheckResponse(status=status) for name, status in self._statuses.items()}
        return health_pb2.HealthListResponse(statuses=statuses)

    async def end_watches(self) -> None:
        """End every open ``Watch`` call, and any started from now on, with status OK, each after it has sent
        the latest status."""
        async with self._changed:
            self._ending = True
            self._changed.notify_all()


async def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> HealthServicer:
    """Register grpc.health.v1 and server reflection. The whole server ("") is SERVING while the process runs:
    liveness. Each service name is NOT_SERVING until ``set_serving``: readiness (loaded, not draining; for a
    frontend, some core reachable)."""
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    for name in service_names:
        await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: HealthServicer, service_names: list[str], serving: bool) -> None:
    """Set each service name (readiness) to SERVING or NOT_SERVING; "" (liveness) stays SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in service_names:
        await servicer.set(name, status)


async def stop_server(server: grpc.aio.Server, health_servicer: HealthServicer, grace_s: float) -> None:
    """Stop ``server`` at the end of a shutdown: end its health Watch calls (OK), then stop it, cancelling the
    calls still open after ``grace_s``. Each server ends its own long streams before this (the core's
    ``Connect``, the frontend's ``Generate``), so that a normal shutdown cancels none and logs no traceback."""
    await health_servicer.end_watches()
    await server.stop(grace=grace_s)


def on_termination(callback: Callable[[], None]) -> None:
    """Call ``callback`` (on the running event loop) on SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback)


def run_in_daemon_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """Run a slow blocking call (model load, waiting for a core) off the event loop, on a daemon thread, so a
    SIGTERM meanwhile can still end the process at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def target() -> None:
        try:
            result = fn()
        except BaseException as e:  # handed to the awaiting coroutine
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_exception, future, e)
        else:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_set_result, future, result)

    threading.Thread(target=target, name="splitserve-startup", daemon=True).start()
    return future


def _set_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[T], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
