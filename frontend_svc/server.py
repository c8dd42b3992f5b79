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

import logging
from typing import Any

import grpc

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.config import FrontendConfig, load_chat_template
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.core_client_factory import check_core_settings
from frontend_svc.http_server import HttpServer
from frontend_svc.service import GENERATION_GRPC_SERVICE, FrontendServerState, GenerationServicer
from frontend_svc.stat_logger import PrometheusStatLogger, StatLogger
from frontend_svc.tokenizer import load_tokenizer
from splitserve.base import grpc_runtime, server_lifecycle, tracing
from splitserve.base.api_key import ApiKeyInterceptor
from splitserve.base.model_files import resolve_model_path
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

logger = logging.getLogger(__name__)
# After the drain, how long calls still running get to end with the error the closed engine gives them.
CLOSE_WAIT_S = 2.0


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
    return await server_lifecycle.serve_until_stopped(
        options,
        tracing.FRONTEND_TRACING_SERVICE_NAME,
        lambda observability: _FrontendServer(
            model, core_addresses, frontend or FrontendConfig(), core_config, observability, options
        ),
    )


class _FrontendServer(server_lifecycle.ServerHooks[AsyncLLM]):
    """What only the frontend does in the servers' shared sequence (``splitserve.base.server_lifecycle``)."""

    def __init__(
        self,
        model: str,
        core_addresses: list[str] | None,
        frontend: FrontendConfig,
        core_config: dict[str, Any],
        observability: server_lifecycle.ServerObservability,
        options: grpc_runtime.ServerOptions,
    ) -> None:
        # The API key after tracing and metrics: the calls it refuses are traced and counted too.
        api_key = [ApiKeyInterceptor(frontend.api_key)] if frontend.api_key is not None else []
        super().__init__("frontend", GENERATION_GRPC_SERVICE, logger, api_key)
        self.model = model
        self.core_addresses = core_addresses
        self.frontend = frontend
        self.core_config = core_config
        self.observability = observability
        # The largest HTTP request body taken: the gRPC API's receive limit.
        self.max_request_bytes = options.message_limits.receive_bytes
        self.tls = options.tls  # the HTTP API's too
        self.http_server: HttpServer | None = None
        self.model_name = frontend.served_model_name or model
        self.state = FrontendServerState(
            model=self.model_name,
            model_path=model,
            trust_request_chat_template=frontend.trust_request_chat_template,
            max_n=frontend.max_n,
            enable_admin_routes=frontend.enable_admin_routes,
            enable_prompt_tokens_details=frontend.enable_prompt_tokens_details,
            return_tokens_as_token_ids=frontend.return_tokens_as_token_ids,
            tool_call_parser=frontend.tool_call_parser if frontend.enable_auto_tool_choice else None,
            reasoning_parser=frontend.reasoning_parser,
            allow_runtime_lora_updating=frontend.allow_runtime_lora_updating,
        )
        if observability.tracer_provider is not None:
            self.state.tracer = observability.tracer_provider.get_tracer("splitserve.frontend")
        if frontend.core_tls is not None:
            frontend.core_tls.credentials()  # a file that cannot be read fails here, before anything listens

    async def open_listeners(self, host: str) -> None:
        """The OpenAI-compatible HTTP API, when ``--http-port`` is given (its requests are counted in the drain)."""
        frontend = self.frontend
        if frontend.http_port is None:
            return
        http_host = frontend.http_host if frontend.http_host is not None else host
        self.http_server = HttpServer(
            self.state, http_host, frontend.http_port, frontend.api_key, self.max_request_bytes, self.tls
        )
        port = await self.http_server.start()
        scheme = "https" if self.tls is not None else "http"
        logger.info("splitserve frontend serving the OpenAI-compatible HTTP API on %s://%s:%d", scheme, http_host, port)

    async def close_listeners(self) -> None:
        if self.http_server is not None:
            await self.http_server.stop()
            self.http_server = None

    def add_servicers(self, server: grpc.aio.Server) -> None:
        api_grpc.add_GenerationServicer_to_server(GenerationServicer(self.state), server)

    def log_listening(self, host: str, port: int, transport: str) -> None:
        frontend = self.frontend
        logger.info(
            "splitserve frontend listening on %s:%d, %s, %s (engine core: %s%s)",
            host,
            port,
            transport,
            "API key required" if frontend.api_key is not None else "no API key",
            ", ".join(self.core_addresses) if self.core_addresses else "in-process",
            ", TLS" if frontend.core_tls is not None else "",
        )

    def load(self, control: server_lifecycle.ServerControl) -> AsyncLLM:
        """The tokenizer, then the core client (waiting for a first core, or loading the in-process one)."""
        model_path = resolve_model_path(self.model, weights=not self.core_addresses)
        self.state.tokenizer = load_tokenizer(model_path)
        registry = self.observability.registry
        if self.core_addresses:
            from frontend_svc.grpc_client import GrpcCoreClient

            grpc_client = GrpcCoreClient(
                self.core_addresses,
                wait_ready_s=None,
                tracer_provider=self.observability.tracer_provider,
                tls=self.frontend.core_tls,
            )
            grpc_client.add_availability_listener(lambda available: self._availability_changed(control, available))
            client: EngineCoreClient = grpc_client
        else:
            from frontend_svc.inproc_client import AsyncInprocClient

            inproc_client = AsyncInprocClient(str(model_path), **self.core_config)
            inproc_client.add_death_listener(control.die)
            # Asleep (sleep mode, through the HTTP API's admin routes): NOT_SERVING, as a core server would be.
            inproc_client.add_availability_listener(lambda available: self._availability_changed(control, available))
            core_tracer_provider = self.observability.start_tracer_provider(tracing.CORE_TRACING_SERVICE_NAME)
            inproc_client.observe_core(self.model_name, registry, core_tracer_provider)
            client = inproc_client
        stat_loggers: list[StatLogger] = []
        if registry is not None:
            stat_loggers.append(PrometheusStatLogger(registry, self.model_name, client.get_engine_info().max_model_len))
        engine = AsyncLLM(
            str(model_path),
            tokenizer=self.state.tokenizer,
            stat_loggers=stat_loggers,
            generation_config=self.frontend.generation_config,
            engine_core_client=client,
            limit_mm_per_prompt=self.frontend.limit_mm_per_prompt,
            stream_interval=self.frontend.stream_interval,
        )
        if self.frontend.chat_template is not None:
            engine.input_processor.default_chat_template = load_chat_template(self.frontend.chat_template)
        engine.input_processor.default_content_format = self.frontend.chat_template_content_format
        return engine

    def _availability_changed(
        self, control: server_lifecycle.ServerControl, available: bool
    ) -> None:  # on the transport thread
        if self.state.engine is not None and not self.state.draining:
            if available:
                self.state.engine.refresh_engine_info()  # the core may have come back with other settings
            control.set_serving_soon(available)

    def load_failed_message(self) -> str:
        return f"could not start the engine for {self.model}"

    def loaded(self, engine: AsyncLLM) -> None:
        self.state.engine = engine

    def start(self, control: server_lifecycle.ServerControl) -> bool:
        return bool(getattr(self._engine().engine_core, "is_available", lambda: True)())

    def stop_admitting(self) -> None:
        self.state.draining = True

    async def drain(self, death: BaseException | None, shutdown_timeout_s: float) -> None:
        state = self.state
        if death is not None:  # every request has its error on the way: the calls end as soon as they get it
            logger.error(
                "the in-process engine core is down (%s): NOT_SERVING; exiting once its %d call(s) have their errors",
                death,
                state.active_calls,
            )
        else:
            logger.info(
                "shutting down: %d call(s) in flight, waiting up to %.0f s", state.active_calls, shutdown_timeout_s
            )
        await server_lifecycle.wait_until(lambda: not state.active_calls, shutdown_timeout_s)
        self._engine().close()  # calls still running end now, with UNAVAILABLE, rather than being cancelled
        await server_lifecycle.wait_until(lambda: not state.active_calls, CLOSE_WAIT_S)

    def _engine(self) -> AsyncLLM:
        if self.state.engine is None:
            raise RuntimeError("the engine has not started")  # the sequence starts it before it serves
        return self.state.engine
