"""``splitserve core``: the engine core as a gRPC server.

Health is NOT_SERVING until the model is loaded and from SIGTERM on. On SIGTERM the core stops admitting,
lets in-flight requests finish for up to ``shutdown_timeout_s``, aborts what is left, and exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import time

from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.grpc_status import status_code_value
from core_svc.service import SERVICE_NAME, CoreServerState, EngineCoreServicer
from splitserve import grpc_runtime
from splitserve.engine.v1 import engine_core_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


async def serve_core(
    config: CoreConfig,
    host: str = "0.0.0.0",
    port: int = 50061,
    max_message_bytes: int = grpc_runtime.DEFAULT_MAX_MESSAGE_BYTES,
    shutdown_timeout_s: float = 30.0,
) -> int:
    """Run until SIGTERM / SIGINT; returns the process exit code (0 after a clean drain, 1 if loading failed)."""
    state = CoreServerState()
    server = grpc_runtime.make_server(max_message_bytes)
    pb_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(state), server)
    health = grpc_runtime.add_health_and_reflection(server, [SERVICE_NAME])
    await grpc_runtime.set_serving(health, [SERVICE_NAME], False)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    logger.info("splitserve core listening on %s:%d (loading %s)", host, bound, config.model)

    stop = asyncio.Event()
    grpc_runtime.on_termination(stop.set)
    load = grpc_runtime.run_in_daemon_thread(lambda: EngineCore(config))
    done, _ = await asyncio.wait({load, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if load not in done:
        await server.stop(None)
        return 0
    try:
        engine_core = load.result()
    except Exception:
        logger.exception("could not load %s", config.model)
        await server.stop(None)
        return 1
    engine_loop = EngineLoop(engine_core, status_code_value)
    failed = False

    def on_death(error: BaseException) -> None:  # the engine thread died: stop serving, exit non-zero
        nonlocal failed
        failed = True
        event_loop.call_soon_threadsafe(stop.set)

    event_loop = asyncio.get_running_loop()
    engine_loop.on_death(on_death)
    engine_loop.start()
    state.engine_loop = engine_loop
    await grpc_runtime.set_serving(health, [SERVICE_NAME], True)
    logger.info("splitserve core ready on %s:%d", host, bound)

    await stop.wait()
    logger.info(
        "shutting down: draining %d request(s) for up to %.0f s",
        engine_loop.num_unfinished_requests(),
        shutdown_timeout_s,
    )
    state.draining = True
    await grpc_runtime.set_serving(health, [SERVICE_NAME], False)
    deadline = time.monotonic() + shutdown_timeout_s
    while engine_loop.num_unfinished_requests() and time.monotonic() < deadline and engine_loop.dead_error is None:
        await asyncio.sleep(0.05)
    left = engine_loop.num_unfinished_requests()
    if left:
        logger.warning("aborting %d request(s) still running after %.0f s", left, shutdown_timeout_s)
    await server.stop(grace=1.0)  # ends the streams; their requests are aborted as the streams close
    engine_loop.stop()
    logger.info("splitserve core stopped")
    return 1 if failed else 0
