"""How the frontend talks to an engine core (vLLM ``EngineCoreClient``): the interface, which the gRPC and
in-process clients implement (``core_client_factory`` chooses one)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod

from frontend_svc.engine_types import EngineCoreOutputs, EngineCoreRequest, EngineInfo, LoRARequest
from frontend_svc.errors import FrontendError


class EngineCoreClient(ABC):
    """Adds and aborts requests, and fetches outputs, sync or asyncio.

    Errors: ``add_request`` raises ValidationError or RequestTooLargeError for a request the core refuses;
    every call raises EngineDeadError once the core is gone.
    """

    @abstractmethod
    def get_engine_info(self) -> EngineInfo: ...

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Add several requests (n > 1 children), all or none: when one is refused or the call is interrupted,
        every one of them is aborted (ids the core never got are ignored), then the error is raised."""
        try:
            for request in requests:
                self.add_request(request)
        except BaseException:
            with contextlib.suppress(FrontendError):  # a core gone meanwhile: the first error is the one to raise
                self.abort_requests([r.request_id for r in requests])
            raise

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next step's outputs (the in-process client runs that step)."""

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    def sleep(self, level: int = 1, drain: bool = False) -> None:
        """Put every core to sleep (vLLM's ``sleep``; ``core_svc.sleep_mode``): level 1 drops the KV cache and
        moves the weights to host memory, level 2 drops the weights too. ``drain``: requests in flight finish
        first, else they end with ``EngineDeadError`` (UNAVAILABLE).

        Raises:
            ValidationError: ``level`` not 1 or 2.
            NotSupportedError: a core runs without ``--enable-admin-rpcs``.
            EngineDeadError: no core is reachable.
        """
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake every core: ``tags`` None (everything), or ``"weights"`` and / or ``"kv_cache"``.

        Raises:
            ValidationError: a tag that is neither, naming ``tags[i]``.
            NotSupportedError, EngineDeadError: as ``sleep``.
        """
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def is_sleeping(self) -> bool:
        """Whether a core sleeps (with several cores: any of them)."""
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    async def sleep_async(self, level: int = 1, drain: bool = False) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def wake_up_async(self, tags: list[str] | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def is_sleeping_async(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    @abstractmethod
    def shutdown(self) -> None:
        """Release the core (its memory, for the in-process client). Idempotent."""

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        """Add several requests atomically (n > 1 children): all are added or none. Long batches let the caller's
        event loop run between chunks. A caller cancelled meanwhile aborts them all (``abort_requests_nowait``):
        the abort reaches the core after whatever part of the add did."""
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Abort without waiting, for cancellation paths (asyncio clients)."""
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def reset_prefix_cache_async(self) -> bool:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    def start_profile(self, output_dir: str | None = None) -> None:
        """Record every core's steps with torch.profiler until ``stop_profile`` (vLLM's ``start_profile``);
        ``output_dir``: where the traces go (None: each core's own default, its ``--profile-dir``).

        Raises:
            FailedPreconditionError: a profile runs already.
            NotSupportedError: a core runs without ``--enable-admin-rpcs``.
            EngineDeadError: no core is reachable.
        """
        raise NotImplementedError(f"{type(self).__name__} does not profile")

    def stop_profile(self) -> list[str]:
        """Stop the profile: the Chrome traces written, one per core. Raises as ``start_profile``
        (FailedPreconditionError: none runs)."""
        raise NotImplementedError(f"{type(self).__name__} does not profile")

    async def start_profile_async(self, output_dir: str | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    async def stop_profile_async(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} is a sync client")

    # --- LoRA adapters (the core's AddLora / RemoveLora / ListLoras) ---

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Load a PEFT adapter folder on the core under ``lora_request.lora_name``; returns it as loaded (its int
        id assigned). The same name and folder again returns the adapter as loaded.

        Raises:
            ValidationError: the folder cannot be served (the reason named).
            AlreadyExistsError: the name is loaded from another folder.
            FailedPreconditionError: the core was started without ``--enable-lora``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter; requests using it finish with it. Raises NotFoundError for an unknown name."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    def list_loras(self) -> list[LoRARequest]:
        """The adapters loaded on the core."""
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters")

    async def add_lora_async(self, lora_request: LoRARequest) -> LoRARequest:
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters asynchronously")

    async def remove_lora_async(self, lora_name: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters asynchronously")

    async def list_loras_async(self) -> list[LoRARequest]:
        raise NotImplementedError(f"{type(self).__name__} does not load LoRA adapters asynchronously")
