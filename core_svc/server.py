"""``splitserve core``: the engine core as a gRPC server.

Health: "" (liveness) is SERVING while the process runs; ``splitserve.engine.v1.EngineCore`` (readiness) is
NOT_SERVING until the model is loaded and from SIGTERM on. On SIGTERM the core stops admitting,
lets in-flight requests finish for up to ``shutdown_timeout_s``, aborts what is left, and exits 0.

A step whose model runner raises fails only its own requests (INTERNAL; RESOURCE_EXHAUSTED when the device ran
out of memory, which never counts toward declaring the core dead); the core keeps serving. If the engine
core dies (declared dead after ``max_consecutive_failed_steps`` failed steps in a row, or any fault outside the
model runner), its requests end with UNAVAILABLE, readiness goes NOT_SERVING, and the process exits 1 without a
drain, for its supervisor to restart it.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import grpc

from core_svc.admin import AdminPolicy
from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.observability import observe_engine_core
from core_svc.request_size import model_receive_limit
from core_svc.service import ENGINE_CORE_GRPC_SERVICE, CoreServerState, EngineCoreServicer
from core_svc.startup import process_age_s
from splitserve.base import grpc_runtime, model_files, server_lifecycle, tracing
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


async def serve_core(config: CoreConfig, options: grpc_runtime.ServerOptions, admin: AdminPolicy | None = None) -> int:
    """Run until SIGTERM / SIGINT, or until the engine core dies; returns the process exit code (0 after a clean
    drain, 1 if loading failed or the engine core died). ``options``: where and how it listens (TLS, the metrics
    endpoint: none without ``metrics_port``). ``admin``: whether ResetPrefixCache / StartProfile / StopProfile are
    on, and where profiles go (default: off). Tracing follows the ``OTEL_*`` environment (``splitserve.base.tracing``).

    Raises:
        ValueError: a TLS file cannot be read or is not PEM.
        OSError: the metrics port cannot be bound.
    """
    return await server_lifecycle.serve_until_stopped(
        options,
        tracing.CORE_TRACING_SERVICE_NAME,
        lambda observability: _CoreServer(config, options, admin or AdminPolicy(), observability),
    )


def model_message_limits(config: CoreConfig, limits: grpc_runtime.MessageLimits) -> grpc_runtime.MessageLimits:
    """``limits`` with the receive limit sized for ``config.model``'s images (``request_size.model_receive_limit``;
    for a hub id its config files are fetched first, without the weights), logged with why: for ``splitserve
    core`` without ``--max-receive-message-mib``. Before the server is made, which fixes its limit.

    Raises:
        ModelNotFoundError: the model's files cannot be had (``model_files.resolve_model_path``).
        ValueError: its config.json or image processor config unreadable, or a vision setting or image size bound
            of the wrong type, naming the file and key (``request_size.model_receive_limit``).
    """
    limit = model_receive_limit(
        model_files.resolve_model_path(config.model, weights=False),
        config,
        grpc_runtime.DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
        grpc_runtime.MAX_MESSAGE_BYTES,
    )
    logger.info(
        "receive limit %d bytes (%.1f MiB), from the model: %s; --max-receive-message-mib sets another",
        limit.receive_bytes,
        limit.receive_bytes / 2**20,
        limit.reason,
    )
    return replace(limits, receive_bytes=limit.receive_bytes)


class _CoreServer(server_lifecycle.ServerHooks[EngineCore]):
    """What only the core does in the servers' shared sequence (``splitserve.base.server_lifecycle``)."""

    def __init__(
        self,
        config: CoreConfig,
        options: grpc_runtime.ServerOptions,
        admin: AdminPolicy,
        observability: server_lifecycle.ServerObservability,
    ) -> None:
        super().__init__("core", ENGINE_CORE_GRPC_SERVICE, logger)
        self.config = config
        self.observability = observability
        self.state = CoreServerState(
            max_receive_message_bytes=options.message_limits.receive_bytes,
            max_send_message_bytes=options.message_limits.send_bytes,
            admin=admin,
        )
        self.engine_loop: EngineLoop | None = None

    def add_servicers(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(self.state), server)

    def log_listening(self, host: str, port: int, transport: str) -> None:
        logger.info("splitserve core listening on %s:%d, %s (loading %s)", host, port, transport, self.config.model)
        if self.state.admin.enabled:
            logger.warning(
                "admin RPCs are on (ResetPrefixCache, StartProfile, StopProfile, Sleep, WakeUp): every client that "
                "reaches this port may call them; profiles go under %s",
                self.state.admin.profile_dir,
            )

    def load(self, control: server_lifecycle.ServerControl) -> EngineCore:
        return EngineCore(self.config)

    def load_failed_message(self) -> str:
        return f"could not load {self.config.model}"

    def loaded(self, engine_core: EngineCore) -> None:
        observability = self.observability
        observe_engine_core(engine_core, self.config.model_name, observability.registry, observability.tracer_provider)
        self.engine_loop = EngineLoop(engine_core)

    def start(self, control: server_lifecycle.ServerControl) -> bool:
        engine_loop = self._engine_loop()
        engine_loop.on_death(control.die)  # the engine thread died: stop serving, exit non-zero
        engine_loop.start()
        self.state.engine_loop = engine_loop
        self.state.set_serving = control.set_serving_soon  # NOT_SERVING while asleep (Sleep / WakeUp)
        return True

    def ready_details(self) -> str:
        age_s = process_age_s()
        return f", {age_s:.1f} s after its process started" if age_s else ""

    def stop_admitting(self) -> None:
        self.state.draining = True

    async def drain(self, death: BaseException | None, shutdown_timeout_s: float) -> None:
        engine_loop = self._engine_loop()
        if death is not None:  # nothing to drain: the loop already ended every request (INTERNAL or UNAVAILABLE)
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
            await server_lifecycle.wait_until(
                lambda: not engine_loop.num_unfinished_requests() or not engine_loop.is_alive, shutdown_timeout_s
            )
            left = engine_loop.num_unfinished_requests()
            if left:
                logger.warning("aborting %d request(s) still running after %.0f s", left, shutdown_timeout_s)
        self.state.end_streams()  # the requests still on them are aborted as they close

    def stopped(self) -> None:
        self._engine_loop().stop()

    def _engine_loop(self) -> EngineLoop:
        if self.engine_loop is None:
            raise RuntimeError("the engine core is not loaded")  # the sequence starts it before it serves
        return self.engine_loop
