"""Choosing the engine-core client (vLLM's ``EngineCoreClient.make_client``): gRPC to remote cores, or the core
in this process. It sits above ``core_client`` and both clients, and imports the chosen client when it is chosen,
so that ``import frontend_svc`` loads neither the gRPC transport (with its tracing SDK) nor ``core_svc``."""

from __future__ import annotations

from typing import Any

from frontend_svc.core_client import EngineCoreClient
from splitserve.base import envs


def check_core_settings(core_address: str | list[str] | None, core_config: dict[str, Any]) -> None:
    """Engine-core settings configure an in-process core only: a remote core has its own flags.

    Raises:
        ValueError: ``core_config`` is not empty while ``core_address`` is given, naming the settings.
    """
    if core_address is not None and core_config:
        raise ValueError(
            "engine-core settings apply to an in-process core; with core_address they are the core's own flags: "
            + ", ".join(core_config)
        )


def make_client(
    model: str, core_address: str | None = None, asyncio_mode: bool = False, **core_config: Any
) -> EngineCoreClient:
    """The gRPC client of the core(s) at ``core_address`` ("host:port[,host:port...]"), or, when it is None,
    the in-process client: the core runs in this process, built from ``model`` and ``core_config`` (the
    fields of ``core_svc.config.CoreConfig``). Sync or asyncio per ``asyncio_mode`` (the gRPC client is both).

    Raises:
        EngineDeadError: no core answered at ``core_address`` within ``SPLITSERVE_ENGINE_READY_TIMEOUT_S``
            seconds (default 60; the log says, at once and every 10 s, what it waits for).
        ValueError: engine-core settings given with ``core_address`` (``check_core_settings``), or a
            ``core_address`` that names no core ("").
    """
    check_core_settings(core_address, core_config)
    if core_address is not None:
        from frontend_svc.grpc_client import GrpcCoreClient

        addresses = [a.strip() for a in core_address.split(",") if a.strip()]
        if not addresses:
            raise ValueError(f"core_address names no core: {core_address!r} (give host:port[,host:port...])")
        return GrpcCoreClient(addresses, wait_ready_s=envs.engine_ready_timeout_s())
    from frontend_svc.inproc_client import AsyncInprocClient, InprocClient

    client_class = AsyncInprocClient if asyncio_mode else InprocClient
    return client_class(model, **core_config)
