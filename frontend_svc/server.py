"""``splitserve frontend`` (cores over gRPC) and ``splitserve serve`` (the core in-process): the public API.

Health is NOT_SERVING until a core is reachable (or loaded), while every core is unreachable, and from
SIGTERM on. On SIGTERM the frontend stops taking calls, lets streams in flight finish for up to
``shutdown_timeout_s``, then closes them and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.core_client import EngineCoreClient
from frontend_svc.service import SERVICE_NAME, FrontendServerState, GenerationServicer
from frontend_svc.tokenizer import load_tokenizer
from splitserve import grpc_runtime
from splitserve.frontend.v1 import generation_pb2_grpc as api_grpc
from splitserve.model_files import resolve_model_path

logger = logging.getLogger(__name__)


async def serve_frontend(
    model: str,
    core_addresses: list[str] | None,
    host: str = "0.0.0.0",
    port: int = 50051,
    max_message_bytes: int = grpc_runtime.DEFAULT_MAX_MESSAGE_BYTES,
    shutdown_timeout_s: float = 30.0,
    trust_request_chat_template: bool = False,
    **core_config: Any,
) -> int:
    """Run until SIGTERM / SIGINT; returns the exit code. ``core_addresses`` None runs the core in this process
    with ``core_config``."""
    state = FrontendServerState(model=model, trust_request_chat_template=trust_request_chat_template)
    server = grpc_runtime.make_server(max_message_bytes)
    api_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
    health = grpc_runtime.add_health_and_reflection(server, [SERVICE_NAME])
    await grpc_runtime.set_serving(health, [SERVICE_NAME], False)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    where = ", ".join(core_addresses) if core_addresses else "in-process"
    logger.info("splitserve frontend listening on %s:%d (engine core: %s)", host, bound, where)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    grpc_runtime.on_termination(stop.set)

    def set_serving(available: bool) -> None:  # from the client's transport thread
        if state.engine is not None and not state.draining:
            if available:
                state.engine.refresh_engine_info()  # the core may have come back with other settings
            loop.call_soon_threadsafe(
                lambda: loop.create_task(grpc_runtime.set_serving(health, [SERVICE_NAME], available))
            )

    def build() -> AsyncLLM:
        state.tokenizer = load_tokenizer(resolve_model_path(model))
        if core_addresses:
            from frontend_svc.grpc_client import GrpcCoreClient

            client: EngineCoreClient = GrpcCoreClient(
                core_addresses, wait_ready_s=None, max_message_bytes=max_message_bytes
            )
            client.add_availability_listener(set_serving)  # type: ignore[attr-defined]
        else:
            client = EngineCoreClient.make_client(str(resolve_model_path(model)), None, True, **core_config)
        return AsyncLLM(model, tokenizer=state.tokenizer, engine_core_client=client)

    starting = grpc_runtime.run_in_daemon_thread(build)
    done, _ = await asyncio.wait({starting, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if starting not in done:
        await server.stop(None)
        return 0
    try:
        state.engine = starting.result()
    except Exception:
        logger.exception("could not start the engine for %s", model)
        await server.stop(None)
        return 1
    available = getattr(state.engine.engine_core, "is_available", lambda: True)()
    await grpc_runtime.set_serving(health, [SERVICE_NAME], available)
    logger.info("splitserve frontend ready on %s:%d", host, bound)

    await stop.wait()
    logger.info("shutting down: %d call(s) in flight, waiting up to %.0f s", state.active_calls, shutdown_timeout_s)
    state.draining = True
    await grpc_runtime.set_serving(health, [SERVICE_NAME], False)
    deadline = time.monotonic() + shutdown_timeout_s
    while state.active_calls and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    state.engine.close()  # calls still running end now, with UNAVAILABLE, rather than being cancelled
    for _ in range(40):
        if not state.active_calls:
            break
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)
    logger.info("splitserve frontend stopped")
    return 0
