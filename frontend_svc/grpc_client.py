"""The gRPC engine-core client: one ``Connect`` stream per core, reconnecting with backoff, requests spread
over several cores by least outstanding requests.

The transport runs on its own event-loop thread, so one implementation serves sync callers (``LLMEngine``) and
asyncio callers (``AsyncLLM``, the frontend server) alike: outputs are handed to the caller's loop the way the
in-process client does it. While no core is reachable, new requests fail at once with ``EngineDeadError``
(UNAVAILABLE); requests in flight on a core that goes away end with it within a few seconds (keepalive).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from frontend_svc.core_client import EngineCoreClient
from frontend_svc.core_discovery import CoreTarget, resolve
from frontend_svc.engine_types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    FinishReason,
    LoRARequest,
)
from frontend_svc.errors import EngineDeadError, FrontendError, NotFoundError, ValidationError, error_from_core
from frontend_svc.wire import (
    abort_messages,
    engine_info_from_pb,
    lora_request_from_pb,
    lora_request_to_pb,
    outputs_from_pb,
    request_to_pb,
)
from splitserve.base import grpc_runtime, tracing
from splitserve.base.grpc_status import field_violation
from splitserve.base.thread_handoff import ThreadToLoopQueue
from splitserve.base.tls import ClientTLS
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
T = TypeVar("T")
INITIAL_BACKOFF_S, MAX_BACKOFF_S = 0.1, 2.0
LOG_INTERVAL_S = 30.0  # while a core stays unreachable, say so this often
WAIT_LOG_INTERVAL_S = 10.0  # while the constructor waits for a first core, say so this often
ENGINE_CORE_GRPC_SERVICE = pb.DESCRIPTOR.services_by_name["EngineCore"].full_name
# Requests converted to protobuf between yields to the event loop (about 1 ms of work).
CONVERT_CHUNK_SIZE = 128


@dataclass(frozen=True)
class ChannelTLS:
    """A core connection's TLS: the credentials (read once for every core) and its channel options (the name the
    core's certificate must carry)."""

    credentials: grpc.ChannelCredentials
    options: list[tuple[str, str]]


class CoreConnection:
    """One core: a channel, a ``Connect`` stream and a health watch, re-established with exponential backoff,
    and the requests in flight on it. Runs on the client's transport loop.

    A core takes new requests (``accepting``) while its stream is up and its health says SERVING; a draining
    core refuses adds it got before the frontend saw NOT_SERVING, and those go back to ``reroute``.
    """

    def __init__(
        self,
        address: str,
        deliver: Callable[[EngineCoreOutputs], None],
        on_change: Callable[[], None],
        reroute: Callable[[CoreConnection, EngineCoreRequest, EngineCoreOutput], None],
        interceptors: list[grpc.aio.ClientInterceptor] | None = None,
        tls: ChannelTLS | None = None,
    ) -> None:
        self.address = address
        self.closing = False  # the client is shutting down: losing the stream is expected
        self.retired = False  # its name no longer resolves to it: no new requests; dropped once idle
        self.available = False  # the Connect stream is up
        self.serving = False  # the core's health says SERVING
        self.info: EngineInfo | None = None
        # The LoRA adapters this core has loaded, by name, as last seen (ListLoras when the stream comes up, when
        # a request names one not here, after this client's loads, and when the core answers NOT_FOUND for a
        # request's adapter, which then goes to a core that lists it): where requests for them go.
        self.lora_names: set[str] = set()
        self.last_error: str | None = None  # why the latest attempt to reach it failed (a gRPC status and details)
        # request_id -> the request until its first output (so a refused add can go elsewhere), then None
        self.in_flight: dict[str, EngineCoreRequest | None] = {}
        self.stub: pb_grpc.EngineCoreStub | None = None
        self._deliver = deliver
        self._on_change = on_change
        self._reroute = reroute
        # No channel limit of its own either way: one message over it would fail the whole stream. The core keeps
        # each message it sends within its --max-send-message-mib (in pieces); what the frontend sends is checked
        # per message against the core's receive limit (``send_add``, ``abort_messages``).
        limits = grpc_runtime.MessageLimits(grpc_runtime.MAX_MESSAGE_BYTES, grpc_runtime.MAX_MESSAGE_BYTES)
        self._options = limits.options() + grpc_runtime.KEEPALIVE_OPTIONS
        self._interceptors = interceptors or None  # tracing: the stream's context goes in its metadata
        self._tls = tls  # None: plaintext
        self._outbox: asyncio.Queue[pb.EngineCoreClientMessage | None] = asyncio.Queue()

    @property
    def accepting(self) -> bool:
        return self.available and self.serving and not self.retired

    async def run(self) -> None:
        backoff = INITIAL_BACKOFF_S
        last_logged = 0.0
        while True:
            async with self._channel() as channel:
                try:
                    await self._serve_stream(channel)
                    backoff = INITIAL_BACKOFF_S  # it was up; retry soon
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # never let one bad event end the reconnect loop
                    now = time.monotonic()
                    if self.available or now - last_logged > LOG_INTERVAL_S:
                        last_logged = now
                        logger.warning("engine core %s: %s; retrying", self.address, _describe(e))
                    self.last_error = _describe(e)
                finally:
                    self._mark_down()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _channel(self) -> grpc.aio.Channel:
        if self._tls is None:
            return grpc.aio.insecure_channel(
                self.address,
                options=self._options,
                interceptors=self._interceptors,
            )
        return grpc.aio.secure_channel(
            self.address,
            self._tls.credentials,
            options=[*self._options, *self._tls.options],
            interceptors=self._interceptors,
        )

    def send_add(self, requests: list[EngineCoreRequest], messages: list[pb.EngineCoreClientMessage]) -> None:
        """Queue the requests, as ``messages`` (``add_messages``), on the stream, all or none.

        Raises:
            ValidationError: a request larger on the wire than the core takes (it would end the stream, and every
                other request on it, with RESOURCE_EXHAUSTED).
        """
        limit = self.info.max_receive_message_bytes if self.info is not None else 0
        for message in messages:
            if limit and message.ByteSize() > limit:
                raise ValidationError(
                    "request",
                    f"is {message.ByteSize()} bytes on the wire to the engine core, more than the "
                    f"{limit} bytes it takes (its receive limit, --max-receive-message-mib); shorten the prompt, "
                    "allowed_token_ids, logit_bias, cache_salt or request_id, or send fewer or smaller images "
                    "(their pixel tensors go with the request)",
                )
        for request, message in zip(requests, messages, strict=True):
            self._outbox.put_nowait(message)
            self.in_flight[request.request_id] = request

    def send_abort(self, request_ids: list[str]) -> None:
        if self.available:
            limit = self.info.max_receive_message_bytes if self.info is not None else 0
            for message in abort_messages(request_ids, limit):  # each within the core's receive limit
                self._outbox.put_nowait(message)
        for request_id in request_ids:
            self.in_flight.pop(request_id, None)

    async def _serve_stream(self, channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.EngineCoreStub(channel)
        self.info = engine_info_from_pb(await stub.GetEngineInfo(pb.GetEngineInfoRequest(), timeout=5.0))
        self.stub = stub
        await self.refresh_loras()
        self._outbox = asyncio.Queue()
        call = stub.Connect(self._messages())
        await call.wait_for_connection()
        self.stub, self.available, self.serving = stub, True, True
        logger.info("connected to engine core %s (%s)", self.address, self.info.model)
        self._on_change()
        watch = asyncio.get_running_loop().create_task(self._watch_health(channel))
        try:
            async for message in call:
                self._receive(outputs_from_pb(message))
        finally:
            watch.cancel()

    async def _watch_health(self, channel: grpc.aio.Channel) -> None:
        """Follow the core's grpc.health.v1 status: NOT_SERVING (draining) takes it out of routing."""
        try:
            request = health_pb2.HealthCheckRequest(service=ENGINE_CORE_GRPC_SERVICE)  # readiness: loaded, not draining
            async for response in health_pb2_grpc.HealthStub(channel).Watch(request):
                serving = response.status == health_pb2.HealthCheckResponse.SERVING
                if serving != self.serving:
                    self.serving = serving
                    self._on_change()
        except grpc.aio.AioRpcError as e:
            if self.available and e.code() != grpc.StatusCode.CANCELLED:
                logger.warning("engine core %s: health watch failed (%s %s)", self.address, e.code().name, e.details())
            # otherwise the stream's own failure handling takes over

    async def refresh_loras(self) -> None:
        """Learn which adapters the core has loaded (``lora_names``); a core without LoRA has none. A failure
        leaves what was known: the core itself answers NOT_FOUND for an adapter it lacks."""
        stub = self.stub
        if stub is None or self.info is None or not self.info.supports_lora:
            self.lora_names = set()
            return
        try:
            response = await stub.ListLoras(pb.ListLorasRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as e:
            logger.warning("engine core %s: ListLoras failed (%s %s)", self.address, e.code().name, e.details())
            return
        self.lora_names = {lora.lora_name for lora in response.lora_requests}

    def _receive(self, outputs: EngineCoreOutputs) -> None:
        delivered = []
        for output in outputs.outputs:
            request = self.in_flight.get(output.request_id)
            if isinstance(output.error, EngineDeadError) and request is not None:
                # Refused before it ran (the core is draining): nothing happened, so another core can take it.
                self.in_flight.pop(output.request_id, None)
                if self.serving:
                    self.serving = False
                    self._on_change()
                self._reroute(self, request, output)
                continue
            if isinstance(output.error, NotFoundError) and request is not None and request.lora_request is not None:
                # Its adapter is not here (unloaded since this frontend last looked): another core may have it.
                self.in_flight.pop(output.request_id, None)
                self.lora_names.discard(request.lora_request.lora_name)
                self._reroute(self, request, output)
                continue
            if output.finished:
                self.in_flight.pop(output.request_id, None)
            elif request is not None:
                self.in_flight[output.request_id] = None  # started: no longer movable
            delivered.append(output)
        for request_id in outputs.finished_requests:
            self.in_flight.pop(request_id, None)
        outputs.outputs = delivered
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats = dataclasses.replace(outputs.scheduler_stats, engine_id=self.address)
        self._deliver(outputs)

    async def _messages(self) -> AsyncIterator[pb.EngineCoreClientMessage]:
        outbox = self._outbox
        while (message := await outbox.get()) is not None:
            yield message

    def _mark_down(self) -> None:
        was_available, self.available, self.serving, self.stub = self.available, False, False, None
        self._outbox.put_nowait(None)
        if self.in_flight:
            lost = [
                EngineCoreOutput(
                    request_id,
                    [],
                    finish_reason=FinishReason.ERROR,
                    error=EngineDeadError(f"lost the engine core at {self.address}"),
                )
                for request_id in sorted(self.in_flight)
            ]
            self.in_flight.clear()
            self._deliver(EngineCoreOutputs(outputs=lost))
        if was_available and not self.closing:
            logger.warning("engine core %s is unreachable; reconnecting", self.address)
        if was_available:
            self._on_change()


async def add_messages(requests: list[EngineCoreRequest]) -> list[pb.EngineCoreClientMessage]:
    """The stream messages that add ``requests``, converted ``CONVERT_CHUNK_SIZE`` at a time with a yield to
    the event loop between chunks.

    Raises:
        ValidationError: a field the wire cannot carry (``request_to_pb``).
    """
    messages = []
    for start in range(0, len(requests), CONVERT_CHUNK_SIZE):
        if start:
            await asyncio.sleep(0)
        chunk = requests[start : start + CONVERT_CHUNK_SIZE]
        messages += [pb.EngineCoreClientMessage(add=request_to_pb(request)) for request in chunk]
    return messages


class GrpcCoreClient(EngineCoreClient):
    """Engine-core client over gRPC to one or more cores (``addresses``), sync and asyncio.

    Args:
        addresses: each core's "host:port", or "dns:///name:port" for every address the name resolves to,
            resolved again every ``refresh_s`` seconds (``core_discovery``): a core that appears gets requests,
            one that disappears gets no new ones and is dropped once its requests are done.
        wait_ready_s: how long the constructor waits for a first core; None waits as long as it takes.
        tracer_provider: trace the calls to the cores (OpenTelemetry's gRPC client instrumentation puts each
            call's context, the ``Connect`` stream's included, in its metadata); None: no tracing.
        tls: speak TLS to the cores, checking their certificates (against ``tls.server_name`` when set, else the
            ``dns:///`` name for the addresses a name resolves to, else the host), and present ``tls``'s client
            certificate (a core with ``--ssl-ca-certs`` requires one); None: plaintext.

    Raises:
        EngineDeadError: from the constructor, when no core answered within ``wait_ready_s`` (a core that refuses
            the TLS handshake is one that does not answer; the log says why).
        ValueError: from the constructor, for a bad address or a TLS file that cannot be read.
    """

    def __init__(
        self,
        addresses: list[str],
        wait_ready_s: float | None = 60.0,
        tracer_provider: TracerProvider | None = None,
        refresh_s: float = 5.0,
        tls: ClientTLS | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("at least one engine-core address is needed")
        targets = [CoreTarget.parse(a) for a in addresses]  # ValueError names a bad one
        self._tls = tls
        self._credentials = tls.credentials() if tls is not None else None
        self._transport_loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._transport_loop.run_forever, name="splitserve-grpc-client", daemon=True
        )
        self._thread.start()
        self._ready = threading.Event()
        self._availability_listeners: list[Callable[[bool], None]] = []
        self._owner: dict[str, CoreConnection] = {}
        self._background: set[asyncio.Task[None]] = set()
        # Outputs for the event loop of the async caller (AsyncLLM); a sync caller (LLMEngine) never binds it.
        self._outputs: ThreadToLoopQueue[EngineCoreOutputs] = ThreadToLoopQueue()
        self._pending_sync: list[EngineCoreOutputs] = []
        self._sync_event = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._interceptors = tracing.grpc_client_interceptors(tracer_provider)
        self._refresh_s = refresh_s
        self._tasks: dict[CoreConnection, asyncio.Task[None]] = {}
        self._discovery: list[asyncio.Task[None]] = []
        # Replaced, never changed in place (other threads read it); changed on the transport thread only.
        self.connections: list[CoreConnection] = []
        self._on_transport(self._start(targets)).result()
        self._wait_ready(", ".join(addresses), wait_ready_s)

    def _wait_ready(self, where: str, wait_ready_s: float | None) -> None:
        """Block until some core takes requests, saying so in the log at once and every ``WAIT_LOG_INTERVAL_S``.

        Raises:
            EngineDeadError: none did within ``wait_ready_s`` seconds (None: no limit); the message says what was
                waited for, how long, and the last error of each core.
        """
        limit = "no time limit" if wait_ready_s is None else f"up to {wait_ready_s:g} s"
        logger.info("waiting for the engine core at %s (%s) ...", where, limit)
        start = time.monotonic()
        while True:
            left = None if wait_ready_s is None else wait_ready_s - (time.monotonic() - start)
            interval = WAIT_LOG_INTERVAL_S if left is None else max(0.0, min(WAIT_LOG_INTERVAL_S, left))
            if self._ready.wait(interval):
                return
            waited_s = time.monotonic() - start
            errors = "; ".join(f"{c.address}: {c.last_error}" for c in self.connections if c.last_error)
            if wait_ready_s is not None and waited_s >= wait_ready_s:
                self.shutdown()
                raise EngineDeadError(
                    f"no engine core answered at {where} within {wait_ready_s:g} s (waited for a Connect stream to "
                    f"it and its health to say SERVING; is `splitserve core` running there?)"
                    + (f"; latest attempt: {errors}" if errors else "")
                )
            logger.warning(
                "still waiting for the engine core at %s: %.0f s so far (%s)%s",
                where,
                waited_s,
                limit,
                f"; latest attempt: {errors}" if errors else "",
            )

    # --- state ---

    def is_available(self) -> bool:
        """Some core takes new requests."""
        return any(c.accepting for c in self.connections)

    def add_availability_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(available)`` on every change (called on the transport thread)."""
        self._availability_listeners.append(listener)

    def get_engine_info(self) -> EngineInfo:
        for connection in sorted(self.connections, key=lambda c: not c.available):
            if connection.info is not None:
                return connection.info
        raise EngineDeadError("no engine core has been reached yet")

    # --- requests ---

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """All or none, in one call to the transport (not one per n > 1 child)."""
        try:
            self._on_transport(self._add(requests)).result()
        except BaseException:  # interrupted while the transport may still be sending them: take them back
            self.abort_requests_nowait([r.request_id for r in requests])
            raise

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([request])

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        self._outputs.bind()
        await asyncio.wrap_future(self._on_transport(self._add(requests)))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._on_transport(self._abort(request_ids)).result()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids:
            await asyncio.shield(asyncio.wrap_future(self._on_transport(self._abort(request_ids))))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        if request_ids and not self._closed:
            self._on_transport(self._abort(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        """Blocks until some core sends outputs (sync callers)."""
        while True:
            with self._lock:
                if self._pending_sync:
                    return self._pending_sync.pop(0)
                self._sync_event.clear()
            if self._closed:
                raise EngineDeadError("the engine-core client is closed")
            self._sync_event.wait(0.5)

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    def reset_prefix_cache(self) -> bool:
        return self._on_transport(self._reset_prefix_cache()).result()

    def sleep(self, level: int = 1, drain: bool = False) -> None:
        self._on_transport(self._sleep(level, drain)).result()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._on_transport(self._wake_up(tags)).result()

    def is_sleeping(self) -> bool:
        return self._on_transport(self._is_sleeping()).result()

    async def sleep_async(self, level: int = 1, drain: bool = False) -> None:
        await asyncio.wrap_future(self._on_transport(self._sleep(level, drain)))

    async def wake_up_async(self, tags: list[str] | None = None) -> None:
        await asyncio.wrap_future(self._on_transport(self._wake_up(tags)))

    async def is_sleeping_async(self) -> bool:
        return await asyncio.wrap_future(self._on_transport(self._is_sleeping()))

    async def reset_prefix_cache_async(self) -> bool:
        return await asyncio.wrap_future(self._on_transport(self._reset_prefix_cache()))

    def start_profile(self, output_dir: str | None = None) -> None:
        self._on_transport(self._start_profile(output_dir)).result()

    def stop_profile(self) -> list[str]:
        return self._on_transport(self._stop_profile()).result()

    async def start_profile_async(self, output_dir: str | None = None) -> None:
        await asyncio.wrap_future(self._on_transport(self._start_profile(output_dir)))

    async def stop_profile_async(self) -> list[str]:
        return await asyncio.wrap_future(self._on_transport(self._stop_profile()))

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        return self._on_transport(self._add_lora(lora_request)).result()

    async def add_lora_async(self, lora_request: LoRARequest) -> LoRARequest:
        return await asyncio.wrap_future(self._on_transport(self._add_lora(lora_request)))

    def remove_lora(self, lora_name: str) -> None:
        self._on_transport(self._remove_lora(lora_name)).result()

    async def remove_lora_async(self, lora_name: str) -> None:
        await asyncio.wrap_future(self._on_transport(self._remove_lora(lora_name)))

    def list_loras(self) -> list[LoRARequest]:
        return self._on_transport(self._list_loras()).result()

    async def list_loras_async(self) -> list[LoRARequest]:
        return await asyncio.wrap_future(self._on_transport(self._list_loras()))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._post(EngineDeadError("the engine-core client is closed"))
        self._sync_event.set()
        if self._transport_loop.is_running():
            self._on_transport(self._stop()).result(timeout=10)
            self._transport_loop.call_soon_threadsafe(self._transport_loop.stop)
        self._thread.join(timeout=10)

    # --- transport thread ---

    def _on_transport(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._transport_loop)

    async def _start(self, targets: list[CoreTarget]) -> None:
        for target in targets:
            if target.dns:
                self._discovery.append(asyncio.get_running_loop().create_task(self._discover(target)))
            else:
                self._connect(target.address)

    def _connect(self, address: str, server_name: str | None = None) -> CoreConnection:
        """A connection to the core at ``address``; with TLS, its certificate must name ``server_name`` (None: the
        address's host), unless the client's ``ClientTLS.server_name`` says otherwise."""
        tls = None
        if self._tls is not None and self._credentials is not None:
            tls = ChannelTLS(self._credentials, self._tls.options(server_name))
        connection = CoreConnection(
            address,
            self._deliver,
            self._availability_changed,
            self._reroute,
            self._interceptors,
            tls,
        )
        self.connections = [*self.connections, connection]
        self._tasks[connection] = asyncio.get_running_loop().create_task(connection.run())
        return connection

    async def _discover(self, target: CoreTarget) -> None:
        """Resolve ``target`` every ``refresh_s``: connect to new addresses, retire vanished ones, drop retired
        ones once they have nothing in flight."""
        known: dict[str, CoreConnection] = {}
        last_logged = 0.0
        while True:
            try:
                addresses = set(await resolve(target))
            except Exception as e:  # NXDOMAIN, a name getaddrinfo cannot encode, ...: try again later
                addresses = None
                if time.monotonic() - last_logged > LOG_INTERVAL_S:
                    last_logged = time.monotonic()
                    logger.warning("engine cores %s: %s; retrying", target.host, e)
            if addresses is not None:
                for address in sorted(addresses - known.keys()):
                    logger.info("engine core %s found at %s", target.host, address)
                    known[address] = self._connect(address, target.host)  # its IP; the certificate names the name
                for address, connection in known.items():
                    retired = address not in addresses
                    if retired != connection.retired:
                        logger.info("engine core %s %s %s", address, "left" if retired else "is back in", target.host)
                        connection.retired = retired
                        self._availability_changed()
            for address, connection in list(known.items()):
                if connection.retired and not connection.in_flight:
                    del known[address]
                    await self._drop(connection)
            await asyncio.sleep(self._refresh_s)

    async def _drop(self, connection: CoreConnection) -> None:
        connection.closing = True
        self.connections = [c for c in self.connections if c is not connection]
        task = self._tasks.pop(connection)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _stop(self) -> None:
        for task in self._discovery:
            task.cancel()
        for connection in self.connections:
            connection.closing = True
        tasks = [*self._discovery, *self._tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _add(self, requests: list[EngineCoreRequest], exclude: CoreConnection | None = None) -> None:
        """Send ``requests`` to one core, all or none. Converting them (16384 children) yields to this loop
        between chunks; they are queued on the stream, and become abortable (``_owner``), together at the end."""
        if not any(c.accepting and c is not exclude for c in self.connections):
            raise EngineDeadError(self._none_accepting())
        messages = await add_messages(requests)
        accepting = [c for c in self.connections if c.accepting and c is not exclude]
        if not accepting:
            raise EngineDeadError(self._none_accepting())
        lora = requests[0].lora_request  # the same for every n > 1 child
        if lora is not None:
            accepting = await self._with_lora(accepting, lora.lora_name)
        connection = min(accepting, key=lambda c: len(c.in_flight))  # least outstanding requests
        connection.send_add(requests, messages)
        for request in requests:
            self._owner[request.request_id] = connection

    def unavailable_reason(self) -> str:
        """Why no core takes requests now (for the servers' UNAVAILABLE while ``is_available`` is False)."""
        return self._none_accepting()

    def _none_accepting(self) -> str:
        """Why no core takes a request: none reachable, or those reachable are not ready (readiness
        NOT_SERVING: sleeping, or shutting down)."""
        not_ready = [c.address for c in self.connections if c.available and not c.serving]
        if not_ready:
            return (
                f"no engine core is ready to take requests: {', '.join(not_ready)} reachable but not serving (the "
                "engine core is sleeping, or shutting down)"
            )
        return "no engine core is reachable"

    async def _with_lora(self, connections: list[CoreConnection], lora_name: str) -> list[CoreConnection]:
        """Of ``connections``, those whose core has the adapter ``lora_name`` loaded; when none is known to, asked
        again (another frontend may have loaded it since); when still none has it, all of them (the core then
        answers NOT_FOUND, the one source of truth)."""
        having = [c for c in connections if lora_name in c.lora_names]
        if not having:
            await asyncio.gather(*(c.refresh_loras() for c in connections))
            having = [c for c in connections if lora_name in c.lora_names and c.accepting]
        return having or connections

    def _reachable(self) -> list[CoreConnection]:
        """The connected cores (whether or not they take new requests: a draining core still gets unary calls).

        Raises:
            EngineDeadError: none is.
        """
        reachable = [c for c in self.connections if c.available and c.stub is not None]
        if not reachable:
            raise EngineDeadError("no engine core is reachable")
        return reachable

    add_lora_timeout_s = 60.0  # per core; one that times out is sent RemoveLora, as the others that loaded it

    async def _add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """AddLora on every connected core, all or none: when one refuses, the cores that loaded it in this call
        unload it again, and its error is raised (``_unary_error``). The same name and folder again is no error
        (the core answers the adapter as loaded)."""
        loaded: list[CoreConnection] = []
        result: LoRARequest | None = None
        message = pb.AddLoraRequest(lora_request=lora_request_to_pb(lora_request))
        reachable = self._reachable()
        # A core that has it already answers it as loaded (the same folder): not one to unload it from again.
        await asyncio.gather(*(c.refresh_loras() for c in reachable))
        had = {c for c in reachable if lora_request.lora_name in c.lora_names}
        for connection in reachable:
            stub = connection.stub
            if stub is None:
                continue
            try:
                # reading the adapter's weights takes time
                response = await stub.AddLora(message, timeout=self.add_lora_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and connection not in had:
                    loaded.append(connection)  # it may still load it after the deadline: unload it there too
                for done in loaded:
                    await self._undo_add(done, lora_request.lora_name)
                raise _unary_error(e, "lora_path") from e
            if connection not in had:
                loaded.append(connection)
            connection.lora_names.add(lora_request.lora_name)
            result = result or lora_request_from_pb(response.lora_request)
        if result is None:
            raise EngineDeadError("no engine core is reachable")
        await asyncio.gather(*(c.refresh_loras() for c in reachable))  # what else changed there meanwhile
        return result

    @staticmethod
    async def _undo_add(connection: CoreConnection, lora_name: str) -> None:
        connection.lora_names.discard(lora_name)
        if connection.stub is None:
            return
        try:
            await connection.stub.RemoveLora(pb.RemoveLoraRequest(lora_name=lora_name), timeout=10.0)
        except grpc.aio.AioRpcError as e:
            logger.warning(
                "engine core %s: could not unload LoRA %r again (%s %s)",
                connection.address,
                lora_name,
                e.code().name,
                e.details(),
            )

    async def _remove_lora(self, lora_name: str) -> None:
        """RemoveLora on every connected core; NOT_FOUND only when no core had it."""
        removed = False
        not_found: FrontendError | None = None
        for connection in self._reachable():
            stub = connection.stub
            if stub is None:
                continue
            connection.lora_names.discard(lora_name)
            try:
                await stub.RemoveLora(pb.RemoveLoraRequest(lora_name=lora_name), timeout=10.0)
                removed = True
            except grpc.aio.AioRpcError as e:
                error = _unary_error(e, "lora_name")
                if not isinstance(error, NotFoundError):
                    raise error from e
                not_found = error
        if not removed:
            raise not_found or NotFoundError(f"lora_name: no LoRA adapter named {lora_name!r} is loaded")

    async def _list_loras(self) -> list[LoRARequest]:
        """ListLoras of every connected core (a core without LoRA has none), each name once, in the first core's
        order; it also refreshes where requests for each adapter go."""
        by_name: dict[str, LoRARequest] = {}
        for connection in self._reachable():
            stub = connection.stub
            if stub is None or connection.info is None or not connection.info.supports_lora:
                continue
            try:
                response = await stub.ListLoras(pb.ListLorasRequest(), timeout=10.0)
            except grpc.aio.AioRpcError as e:
                raise _unary_error(e, "") from e
            loras = [lora_request_from_pb(msg) for msg in response.lora_requests]
            connection.lora_names = {lora.lora_name for lora in loras}
            for lora in loras:
                by_name.setdefault(lora.lora_name, lora)
        return list(by_name.values())

    def _reroute(self, refused_by: CoreConnection, request: EngineCoreRequest, refusal: EngineCoreOutput) -> None:
        """A core refused an add before running it: draining, or (NOT_FOUND) without the request's adapter. Send it
        to another core (for an adapter, one that lists it when asked again), or pass the refusal on."""
        self._owner.pop(request.request_id, None)
        lora = request.lora_request if isinstance(refusal.error, NotFoundError) else None

        async def readd() -> None:
            try:
                if lora is not None:
                    await self._add_with_lora(request, lora.lora_name, refused_by, refusal)
                else:
                    await self._add([request], exclude=refused_by)
            except EngineDeadError:
                self._deliver(EngineCoreOutputs(outputs=[refusal]))
            except ValidationError as e:  # the other core takes smaller messages
                self._deliver(EngineCoreOutputs(outputs=[dataclasses.replace(refusal, error=e)]))

        task = asyncio.get_running_loop().create_task(readd())
        self._background.add(task)  # keep a reference until it is done
        task.add_done_callback(self._background.discard)

    async def _add_with_lora(
        self, request: EngineCoreRequest, lora_name: str, refused_by: CoreConnection, refusal: EngineCoreOutput
    ) -> None:
        """Send ``request`` to a core other than ``refused_by`` that lists ``lora_name`` when asked again; with
        none, pass ``refusal`` (NOT_FOUND) on. Only to a core that listed it, so NOT_FOUND answers cannot bounce
        it between cores that lack it."""
        others = [c for c in self.connections if c.accepting and c is not refused_by]
        await asyncio.gather(*(c.refresh_loras() for c in others))
        having = [c for c in others if c.accepting and lora_name in c.lora_names]
        if not having:
            self._deliver(EngineCoreOutputs(outputs=[refusal]))
            return
        messages = await add_messages([request])
        connection = min(having, key=lambda c: len(c.in_flight))
        connection.send_add([request], messages)
        self._owner[request.request_id] = connection

    async def _abort(self, request_ids: list[str]) -> None:
        by_connection: dict[CoreConnection, list[str]] = {}
        for request_id in request_ids:
            connection = self._owner.pop(request_id, None)
            if connection is not None:
                by_connection.setdefault(connection, []).append(request_id)
        for connection, ids in by_connection.items():
            connection.send_abort(ids)

    async def _reset_prefix_cache(self) -> bool:
        """ResetPrefixCache on every connected core: whether all of them reset.

        Raises:
            EngineDeadError: no core is reachable, or one stopped meanwhile (UNAVAILABLE).
            NotSupportedError: a core runs without ``--enable-admin-rpcs`` (UNIMPLEMENTED); the cores before it in
                the list have reset. A core's other failures come as ``error_from_core`` maps their codes, never as
                a raw ``grpc.RpcError``.
        """
        results = []
        for connection in self.connections:
            if connection.available and connection.stub is not None:
                try:
                    results.append(await connection.stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=10.0))
                except grpc.aio.AioRpcError as e:
                    raise _unary_error(e, "") from e
        if not results:
            raise EngineDeadError("no engine core is reachable")
        return all(r.success for r in results)

    async def _start_profile(self, output_dir: str | None) -> None:
        """StartProfile on every connected core (raises as ``_reset_prefix_cache``; FAILED_PRECONDITION: one runs
        a profile already)."""
        request = pb.StartProfileRequest(output_dir=output_dir or "")
        if not await self._on_every_core(lambda stub: stub.StartProfile(request, timeout=10.0)):
            raise EngineDeadError("no engine core is reachable")

    async def _stop_profile(self) -> list[str]:
        """StopProfile on every connected core: the traces they wrote."""
        responses = await self._on_every_core(lambda stub: stub.StopProfile(pb.StopProfileRequest(), timeout=60.0))
        if not responses:
            raise EngineDeadError("no engine core is reachable")
        return [response.trace_path for response in responses]

    async def _on_every_core(self, call: Any) -> list[Any]:
        """``call(stub)`` on every connected core in turn: their answers; a core's failure as the frontend's error."""
        results = []
        for connection in self.connections:
            if connection.available and connection.stub is not None:
                try:
                    results.append(await call(connection.stub))
                except grpc.aio.AioRpcError as e:
                    raise _unary_error(e, "") from e
        return results

    async def _sleep(self, level: int, drain: bool) -> None:
        """Sleep on every core connected now, together (a drain may take a while on each); a core not connected
        at the call (starting, reconnecting) is skipped and stays awake. Not atomic: when one core refuses (e.g.
        UNIMPLEMENTED, ``NotSupportedError``), the others may already be asleep (``_is_sleeping`` tells; a
        ``wake_up`` brings them back). A call given up on (cancelled) goes on in the cores it reached.

        Raises:
            EngineDeadError, NotSupportedError, ValidationError: as ``_call_every_core``.
        """
        request = pb.SleepRequest(level=level, drain=drain)
        await self._call_every_core(lambda stub: stub.Sleep(request))

    async def _wake_up(self, tags: list[str] | None) -> None:
        request = pb.WakeUpRequest(tags=tags or [])
        await self._call_every_core(lambda stub: stub.WakeUp(request))

    async def _is_sleeping(self) -> bool:
        responses = await self._call_every_core(lambda stub: stub.IsSleeping(pb.IsSleepingRequest(), timeout=10.0))
        return any(r.is_sleeping for r in responses)

    async def _call_every_core(self, call: Callable[[pb_grpc.EngineCoreStub], Awaitable[T]]) -> list[T]:
        """``call`` on every core with its stream up, sleeping ones included, at once; their answers.

        Raises:
            EngineDeadError: no core is reachable, or one stopped meanwhile (UNAVAILABLE).
            NotSupportedError: a core runs without ``--enable-admin-rpcs`` (UNIMPLEMENTED).
            ValidationError: a core refused an argument (INVALID_ARGUMENT, naming it). A core's other failures
                come as ``error_from_core`` maps their codes, never as a raw ``grpc.RpcError``.
        """
        stubs = [c.stub for c in self.connections if c.available and c.stub is not None]
        if not stubs:
            raise EngineDeadError("no engine core is reachable")
        results = await asyncio.gather(*(call(stub) for stub in stubs), return_exceptions=True)
        for result in results:
            if isinstance(result, grpc.aio.AioRpcError):
                field = violation.field if (violation := field_violation(result)) else ""
                raise error_from_core(result.code().value[0], result.details() or "", field) from result
            if isinstance(result, BaseException):
                raise result
        return [r for r in results if not isinstance(r, BaseException)]

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        for output in outputs.outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)
        for request_id in outputs.finished_requests:
            self._owner.pop(request_id, None)
        self._post(outputs)

    def _availability_changed(self) -> None:
        available = self.is_available()
        if available:
            self._ready.set()
        for listener in self._availability_listeners:
            listener(available)

    def _post(self, item: EngineCoreOutputs | BaseException) -> None:
        """To the async caller's event loop; else (a sync caller) outputs to ``get_output``."""
        if self._outputs.is_bound:
            self._outputs.put_threadsafe(item)
        elif isinstance(item, EngineCoreOutputs):
            with self._lock:
                self._pending_sync.append(item)
            self._sync_event.set()


def _unary_error(error: grpc.aio.AioRpcError, default_field: str) -> FrontendError:
    """The frontend error of a core's failed unary call (``error_from_core``); an INVALID_ARGUMENT that names no
    field (its ``google.rpc.BadRequest``) names ``default_field`` when given."""
    field = violation.field if (violation := field_violation(error)) else ""
    return error_from_core(error.code().value[0], error.details() or "", field or default_field)


def _describe(error: Exception) -> str:
    """A failed attempt to reach a core, in one line: its gRPC status and details, else the exception."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name} {error.details()}"
    return repr(error)
