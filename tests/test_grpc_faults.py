"""Failures and lifecycles of the split stack as processes: cores killed, hung, restarted and drained; frontends
killed and started first; several cores behind one frontend; the embedded server."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.entrypoints import stack
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as core_grpc
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.faulty_core import FAULT_MESSAGE, POISON_TOKEN_ID
from tests.test_grpc_split import CORE_ARGS, generate, greedy, joined

ROOT = Path(__file__).resolve().parents[1]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
# Runs until max_model_len: a max_tokens past it is refused (it used to be cut short silently).
UNBOUNDED = api.SamplingParams(
    temperature=0.0, ignore_eos=True, max_tokens_unlimited=True, output_kind=api.OUTPUT_KIND_DELTA
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model

    return str(make_test_model(tmp_path_factory.mktemp("fault-model"), "llama", "tiny"))


@pytest.fixture()
def logs(tmp_path):
    return tmp_path / "logs"


@contextlib.contextmanager
def split_stack(
    model: str, logs: Path, num_cores: int = 1, core_args: list[str] = CORE_ARGS, frontend_args: Sequence[str] = ()
) -> Iterator[tuple[list[stack.ServiceProcess], stack.ServiceProcess]]:
    """``num_cores`` cores and one frontend over all of them, SERVING; stopped (SIGTERM) afterwards."""
    cores = [stack.start_core(model, logs, core_args) for _ in range(num_cores)]
    frontend = None
    try:
        for core in cores:
            core.wait_serving()
        frontend = stack.start_frontend(model, [c.address for c in cores], logs, frontend_args)
        frontend.wait_serving()
        yield cores, frontend
    finally:
        for process in [frontend, *cores]:
            if process is not None:
                process.stop()


def stream_then(address: str, action: Callable[[], None]) -> tuple[grpc.StatusCode, float]:
    """Start an unbounded Generate, take its first message, run ``action``; returns how the stream ended and how
    many seconds after ``action`` it did."""

    async def run() -> tuple[grpc.StatusCode, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            call = api_grpc.GenerationStub(channel).Generate(
                api.GenerateRequest(prompt="hello", sampling_params=UNBOUNDED)
            )
            iterator = call.__aiter__()
            await iterator.__anext__()
            action()
            acted = time.monotonic()
            try:
                while True:
                    await iterator.__anext__()
            except grpc.aio.AioRpcError as e:
                return e.code(), time.monotonic() - acted
            except StopAsyncIteration:
                return grpc.StatusCode.OK, time.monotonic() - acted

    return asyncio.run(run())


def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def core_load(core: stack.ServiceProcess) -> core_pb.EngineLoad:
    with grpc.insecure_channel(core.address) as channel:
        return core_grpc.EngineCoreStub(channel).GetLoad(core_pb.GetLoadRequest(), timeout=10)


@contextlib.contextmanager
def faulty_split_stack(
    model: str, logs: Path, mode: str, core_args: list[str]
) -> Iterator[tuple[stack.ServiceProcess, stack.ServiceProcess]]:
    """A core whose forward fails as ``tests/faulty_core.py`` ``mode`` says, and a frontend over it."""
    port = stack.free_port()
    launcher = [sys.executable, str(ROOT / "tests" / "faulty_core.py"), mode]
    core = stack.start_service(
        f"core-{port}",
        ["core", "--model", model, *core_args],
        port,
        logs,
        stack.ENGINE_CORE_GRPC_SERVICE,
        launcher=launcher,
    )
    frontend = None
    try:
        core.wait_serving()
        frontend = stack.start_frontend(model, [core.address], logs)
        frontend.wait_serving()
        yield core, frontend
    finally:
        for process in [frontend, core]:
            if process is not None:
                process.stop()


async def generate_ids(
    address: str, prompt_token_ids: list[int], max_tokens: int, started: asyncio.Event | None = None
) -> tuple[grpc.StatusCode, str, list[int], int]:
    """Greedy ``Generate`` of token ids: (status code, details, generated ids, num_cached_tokens); ``started`` is
    set at the first response."""
    params = greedy(max_tokens=max_tokens)
    async with grpc.aio.insecure_channel(address) as channel:
        call = api_grpc.GenerationStub(channel).Generate(
            api.GenerateRequest(prompt_token_ids=prompt_token_ids, sampling_params=params)
        )
        token_ids, num_cached = [], 0
        try:
            async for response in call:
                if started is not None:
                    started.set()
                token_ids += response.outputs[0].token_ids
                num_cached = max(num_cached, response.num_cached_tokens)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", token_ids, num_cached
        return grpc.StatusCode.OK, "", token_ids, num_cached


def test_a_failed_step_ends_its_requests_with_internal_and_the_core_serves_on(model, logs):
    """The forward of the poison request's step raises (once). It gets INTERNAL with the core's message; a request
    in flight on other steps (max-num-seqs 1) gets the tokens it gets without a fault; the core stays up and
    SERVING with every KV block free; the poison prompt sent again finds nothing cached from the failed forward."""
    survivor_prompt = list(range(20, 51))
    poison_prompt = [POISON_TOKEN_ID, *range(60, 99)]  # 40 tokens: 2 full blocks, cached when allocated
    with faulty_split_stack(model, logs, "poison_once", [*CORE_ARGS, "--max-num-seqs", "1"]) as (core, frontend):
        reference = asyncio.run(generate_ids(frontend.address, survivor_prompt, 30))
        assert reference[0] == grpc.StatusCode.OK and len(reference[2]) == 30

        async def scenario():
            started = asyncio.Event()
            survivor = asyncio.create_task(generate_ids(frontend.address, survivor_prompt, 30, started))
            await started.wait()  # running: the poison request waits behind it (max-num-seqs 1)
            poisoned = await generate_ids(frontend.address, poison_prompt, 5)
            return await survivor, poisoned

        survivor, poisoned = asyncio.run(scenario())
        assert poisoned[:3] == (
            grpc.StatusCode.INTERNAL,
            f"the engine core failed while running this request: {FAULT_MESSAGE}",
            [],
        )
        assert survivor[0] == grpc.StatusCode.OK and survivor[2] == reference[2]
        assert core.process.poll() is None and core.health() == SERVING and frontend.health() == SERVING
        load = core_load(core)
        assert load.num_running_reqs == 0 and load.num_free_kv_blocks == load.num_usable_kv_blocks
        again = asyncio.run(generate_ids(frontend.address, poison_prompt, 5))
        assert again[0] == grpc.StatusCode.OK and len(again[2]) == 5 and again[3] == 0  # not 32
        log = core.log_path.read_text()
        assert "which end with INTERNAL (1 of 3 failed steps in a row" in log and "engine loop died" not in log


def test_a_core_whose_every_step_fails_is_declared_dead(model, logs):
    """Every forward raises. With max-num-seqs 1, three requests fail one step each with INTERNAL; the third
    failed step in a row declares the core dead: the fourth request gets UNAVAILABLE, readiness goes NOT_SERVING,
    and the core exits 1 without claiming a drain."""
    with faulty_split_stack(model, logs, "broken", [*CORE_ARGS, "--max-num-seqs", "1"]) as (core, frontend):

        async def four():
            return await asyncio.gather(*(generate_ids(frontend.address, [5 + i, 6, 7], 5) for i in range(4)))

        results = asyncio.run(four())
        assert sorted(code.name for code, *_ in results) == ["INTERNAL", "INTERNAL", "INTERNAL", "UNAVAILABLE"]
        assert core.process.wait(30) == 1
        assert wait_for(lambda: frontend.health() == NOT_SERVING, 10)
        code, *_ = asyncio.run(generate_ids(frontend.address, [5, 6, 7], 2))
        assert code == grpc.StatusCode.UNAVAILABLE
        log = core.log_path.read_text()
        assert "the engine core is dead: 3 steps in a row failed (the last: injected fault)" in log
        assert "exiting without a drain" in log and "draining" not in log


def test_an_embedded_server_whose_core_is_declared_dead_exits_1(model, logs):
    """``splitserve serve`` with every forward failing: as the split core, three failed steps in a row (one
    request each, max-num-seqs 1) end those requests with INTERNAL, the fourth with UNAVAILABLE, and the core is
    dead. It cannot come back in this process, so the server goes NOT_SERVING and exits 1 once each call has its
    error (it used to stay SERVING, refusing every call, and never exit)."""
    launcher = [sys.executable, str(ROOT / "tests" / "faulty_core.py"), "broken"]
    args = ["serve", "--model", model, *CORE_ARGS, "--max-num-seqs", "1"]
    server = stack.start_service("serve", args, stack.free_port(), logs, launcher=launcher)
    try:
        server.wait_serving()

        async def four():
            return await asyncio.gather(*(generate_ids(server.address, [5 + i, 6, 7], 5) for i in range(4)))

        results = asyncio.run(four())
        assert sorted(code.name for code, *_ in results) == ["INTERNAL", "INTERNAL", "INTERNAL", "UNAVAILABLE"]
        assert server.process.wait(30) == 1
        log = server.log_path.read_text()
        assert "the in-process engine core is down" in log and "call(s) have their errors" in log
        assert "shutting down" not in log and "Traceback" not in log.split("engine loop stopped")[-1]
    finally:
        server.stop()


def test_core_killed_mid_stream_then_restarted(model, logs):
    with split_stack(model, logs) as ([core], frontend):
        code, seconds = stream_then(frontend.address, core.kill)
        assert code == grpc.StatusCode.UNAVAILABLE and seconds < 5  # in-flight streams end with it
        assert frontend.process.poll() is None  # the frontend stays up ...
        assert wait_for(lambda: frontend.health() == NOT_SERVING, 5)  # ... and says it cannot serve
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            asyncio.run(generate(frontend.address, "hi", greedy(max_tokens=2)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - began < 5  # fails fast

        port = int(core.address.rsplit(":", 1)[1])
        restarted = stack.start_core(model, logs, CORE_ARGS, port=port)  # the same address
        try:
            restarted.wait_serving()
            assert wait_for(lambda: frontend.health() == SERVING, 30)
            responses = asyncio.run(generate(frontend.address, "hi", greedy(max_tokens=4)))
            assert len(joined(responses)[1]) == 4 and responses[-1].finished
        finally:
            restarted.stop()


def test_a_hung_core_is_noticed_within_seconds(model, logs):
    """SIGSTOP: no TCP reset, only silence. Keepalive pings end the stream within a few seconds."""
    with split_stack(model, logs) as ([core], frontend):
        try:
            code, seconds = stream_then(frontend.address, lambda: core.process.send_signal(19))  # SIGSTOP
            assert code == grpc.StatusCode.UNAVAILABLE and seconds < 10
            assert wait_for(lambda: frontend.health() == NOT_SERVING, 5)
        finally:
            core.kill()


def test_a_frontend_killed_mid_stream_has_its_requests_aborted_in_the_core(model, logs):
    with split_stack(model, logs) as ([core], frontend):

        async def start_streams():
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                stub = api_grpc.GenerationStub(channel)
                calls = [
                    stub.Generate(api.GenerateRequest(prompt=f"p{i}", sampling_params=UNBOUNDED)) for i in range(3)
                ]
                for call in calls:
                    await call.__aiter__().__anext__()
                frontend.kill()  # its Connect stream breaks: the core must abort all three

        asyncio.run(start_streams())
        assert wait_for(lambda: core_load(core).num_running_reqs == 0, 10)
        load = core_load(core)
        assert load.num_free_kv_blocks == load.num_usable_kv_blocks


def test_sigterm_drains_core_and_frontend(model, logs):
    with split_stack(model, logs) as ([core], frontend):

        async def scenario():
            task = asyncio.create_task(generate(frontend.address, "hello", greedy(max_tokens=60)))
            await asyncio.sleep(0.3)
            core.process.send_signal(15)  # SIGTERM: stop admitting, finish what is running
            return await task

        responses = asyncio.run(scenario())
        assert responses[-1].finished and responses[-1].outputs[0].finish_reason == "length"
        assert len(joined(responses)[1]) == 60  # finished, not aborted
        assert core.process.wait(30) == 0
        assert frontend.stop() == 0


async def _watch(address: str, service: str, serving: asyncio.Event) -> tuple[list[int], grpc.StatusCode]:
    """A health Watch of ``service``: the statuses it got and how it ended; ``serving`` is set at the first."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))
        statuses = []
        while (response := await call.read()) is not grpc.aio.EOF:
            statuses.append(response.status)
            serving.set()
        return statuses, await call.code()


async def _connect(address: str, max_tokens: int, started: asyncio.Event) -> tuple[int, grpc.StatusCode]:
    """One request on a Connect stream of its own, as a frontend sends it: the tokens it got, how the stream ended."""
    request = core_pb.EngineCoreRequest(
        request_id="r",
        prompt_token_ids=list(range(10, 20)),
        sampling_params=core_pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(address) as channel:
        opened = asyncio.Event()

        async def messages() -> AsyncIterator[core_pb.EngineCoreClientMessage]:
            yield core_pb.EngineCoreClientMessage(add=request)
            await opened.wait()  # kept open, as a frontend keeps its stream

        call = core_grpc.EngineCoreStub(channel).Connect(messages())
        num_tokens = 0
        async for outputs in call:
            num_tokens += sum(len(o.new_token_ids) for o in outputs.outputs)
            started.set()
        return num_tokens, await call.code()


def _errors_logged(process: stack.ServiceProcess) -> list[str]:
    """The log's lines at ERROR or above (Python's logging, and grpc's own "E1130 12:00:00..." lines), and its
    tracebacks."""
    lines = process.log_path.read_text().splitlines()
    return [line for line in lines if re.search(r" (ERROR|CRITICAL) |^Traceback|^[EF]\d{4} ", line)]


def test_sigterm_with_watches_and_streams_open_logs_no_error(model, logs):
    """A client watches each server's health and has a stream open on each (a Generate on the frontend, a request on
    a Connect stream of the core, beside the frontend's own stream and Watch there), and both get SIGTERM at once.
    Each server says NOT_SERVING, lets the streams finish, ends the Watch calls with OK, and exits 0, with nothing
    at ERROR and no traceback in its log: grpc used to cancel such calls when it stopped and log a CancelledError
    traceback for each."""
    with split_stack(model, logs) as ([core], frontend):

        async def scenario() -> list[object]:
            watching = [asyncio.Event(), asyncio.Event()]
            on_frontend = asyncio.create_task(_watch(frontend.address, stack.GENERATION_GRPC_SERVICE, watching[0]))
            on_core = asyncio.create_task(_watch(core.address, stack.ENGINE_CORE_GRPC_SERVICE, watching[1]))
            generating, connected = asyncio.Event(), asyncio.Event()
            generated = asyncio.create_task(generate_ids(frontend.address, list(range(10, 30)), 100, generating))
            direct = asyncio.create_task(_connect(core.address, 300, connected))
            for event in (*watching, generating, connected):
                await event.wait()
            frontend.process.send_signal(15)
            core.process.send_signal(15)  # it drains both requests: the frontend's, and the direct one
            return [await generated, await on_frontend, await direct, await on_core]

        (code, _, token_ids, _), frontend_watch, direct, core_watch = asyncio.run(scenario())
        assert (code, len(token_ids)) == (grpc.StatusCode.OK, 100)
        assert direct == (300, grpc.StatusCode.OK)
        assert frontend_watch == core_watch == ([SERVING, NOT_SERVING], grpc.StatusCode.OK)
        assert frontend.process.wait(30) == 0 and core.process.wait(30) == 0
        assert _errors_logged(frontend) == [] and _errors_logged(core) == []


def test_sigterm_of_serve_with_a_watch_and_a_stream_open_logs_no_error(model, logs):
    """The same for ``splitserve serve``: its Watch ends with OK, its Generate finishes, and it exits 0 with nothing
    at ERROR and no traceback in its log."""
    server = stack.start_service("serve", ["serve", "--model", model, *CORE_ARGS], stack.free_port(), logs)
    try:
        server.wait_serving()

        async def scenario() -> list[object]:
            watching, generating = asyncio.Event(), asyncio.Event()
            watch = asyncio.create_task(_watch(server.address, stack.GENERATION_GRPC_SERVICE, watching))
            generated = asyncio.create_task(generate_ids(server.address, list(range(10, 30)), 100, generating))
            await watching.wait()
            await generating.wait()
            server.process.send_signal(15)
            return [await generated, await watch]

        (code, _, token_ids, _), watch = asyncio.run(scenario())
        assert (code, len(token_ids)) == (grpc.StatusCode.OK, 100)
        assert watch == ([SERVING, NOT_SERVING], grpc.StatusCode.OK)
        assert server.process.wait(30) == 0
        assert _errors_logged(server) == []
    finally:
        server.stop()


def test_frontend_spreads_requests_over_several_cores(model, logs):
    with split_stack(model, logs, num_cores=2) as (cores, frontend):
        seen_running = [0, 0]

        async def scenario():
            calls = [
                asyncio.create_task(generate(frontend.address, f"prompt {i}", greedy(max_tokens=60))) for i in range(6)
            ]
            while not all(c.done() for c in calls):
                for i, core in enumerate(cores):
                    async with grpc.aio.insecure_channel(core.address) as channel:
                        load = await core_grpc.EngineCoreStub(channel).GetLoad(core_pb.GetLoadRequest())
                    seen_running[i] = max(seen_running[i], load.num_running_reqs)
                await asyncio.sleep(0.05)
            return [await c for c in calls]

        results = asyncio.run(scenario())
        assert all(r[-1].finished and len(joined(r)[1]) == 60 for r in results)
        assert seen_running[0] >= 2 and seen_running[1] >= 2  # least outstanding requests: 3 and 3


def test_one_draining_core_of_two_takes_no_new_requests(model, logs):
    """SIGTERM to one core: its streams finish there, new requests go to the other core, none is refused."""
    with split_stack(model, logs, num_cores=2, core_args=[*CORE_ARGS, "--shutdown-timeout", "60"]) as (
        cores,
        frontend,
    ):

        async def scenario():
            long = [
                asyncio.create_task(generate(frontend.address, f"long {i}", greedy(max_tokens=150))) for i in range(4)
            ]
            await asyncio.sleep(0.5)
            cores[0].process.send_signal(15)
            await asyncio.sleep(0.3)
            short = await asyncio.gather(
                *(generate(frontend.address, f"short {i}", greedy(max_tokens=3)) for i in range(10))
            )
            return [await t for t in long], short

        long, short = asyncio.run(scenario())
        assert all(len(joined(r)[1]) == 150 for r in long)  # the draining core finished its share
        assert all(len(joined(r)[1]) == 3 for r in short)  # nothing was refused
        assert cores[0].process.wait(60) == 0
        assert frontend.health() == SERVING  # one core still serves


def test_frontend_started_before_its_core(model, logs):
    """It waits NOT_SERVING (tokenizing already works), then serves once the core is up."""
    port = stack.free_port()
    frontend = stack.start_frontend(model, [f"127.0.0.1:{port}"], logs)
    core = None
    try:
        with grpc.insecure_channel(frontend.address) as channel:
            stub = api_grpc.GenerationStub(channel)

            def tokenizes() -> bool:
                try:
                    return len(stub.Tokenize(api.TokenizeRequest(text="hello"), timeout=2).token_ids) > 0
                except grpc.RpcError:
                    return False

            assert wait_for(tokenizes, 120)
            assert frontend.health() == NOT_SERVING
            core = stack.start_core(model, logs, CORE_ARGS, port=port)
            frontend.wait_serving()
            assert asyncio.run(generate(frontend.address, "hi", greedy(max_tokens=3)))[-1].finished
    finally:
        frontend.stop()
        if core is not None:
            core.stop()


def test_embedded_serve_answers_like_the_split_stack(model, logs):
    server = stack.start_service("serve", ["serve", "--model", model, *CORE_ARGS], stack.free_port(), logs)
    try:
        with split_stack(model, logs) as (_, frontend):
            server.wait_serving()
            for prompt in ("The capital of France is", "def fibonacci(n):"):
                embedded = asyncio.run(generate(server.address, prompt, greedy()))
                split = asyncio.run(generate(frontend.address, prompt, greedy()))
                assert joined(embedded) == joined(split) and len(joined(split)[1]) == 20
    finally:
        assert server.stop() == 0


def test_each_direction_has_its_own_message_limit(model, logs):
    """Servers take messages sized for requests (default 16 MiB; this core 1 MiB) and send larger ones. 100 MB of
    junk is refused unread (RESOURCE_EXHAUSTED; before, the core took it under its 256 MiB limit, parsed it and
    kept the memory). A public request that would exceed the core's limit is refused by the frontend alone
    (INVALID_ARGUMENT), never sent: it would have ended the frontend's stream, and every request on it."""
    import psutil

    junk = b"\xff" * (100 * 2**20)
    big_channel = [("grpc.max_send_message_length", 2**30)]
    with split_stack(model, logs, core_args=[*CORE_ARGS, "--max-receive-message-mib", "1"]) as ([core], frontend):
        with grpc.insecure_channel(core.address) as channel:
            info = core_grpc.EngineCoreStub(channel).GetEngineInfo(core_pb.GetEngineInfoRequest(), timeout=10)
        assert info.max_receive_message_bytes == 2**20
        core_rss = psutil.Process(core.process.pid).memory_info().rss
        for address, method in [
            (core.address, "/splitserve.engine.v1.EngineCore/GetLoad"),
            (frontend.address, "/splitserve.frontend.v1.Generation/GetModelInfo"),
        ]:
            with grpc.insecure_channel(address, options=big_channel) as channel:
                with pytest.raises(grpc.RpcError) as info_:
                    channel.unary_unary(method)(junk, timeout=60)
                assert info_.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (address, info_.value.details())
        assert psutil.Process(core.process.pid).memory_info().rss - core_rss < 50 * 2**20
        assert core_load(core).num_running_reqs == 0  # still answering

        async def scenario():
            started = asyncio.Event()
            running = asyncio.create_task(generate_ids(frontend.address, list(range(10, 30)), 40, started))
            await started.wait()
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                big = api.GenerateRequest(prompt="hello", sampling_params=greedy(max_tokens=4), cache_salt="s" * 2**20)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await api_grpc.GenerationStub(channel).Generate(big).read()
            return refused.value, await running

        refused, (code, _, token_ids, _) = asyncio.run(scenario())
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.details().startswith("request: is ") and f"more than the {2**20} bytes" in refused.details()
        assert code == grpc.StatusCode.OK and len(token_ids) == 40  # the stream to the core went on
        assert asyncio.run(generate_ids(frontend.address, list(range(10, 30)), 40))[2] == token_ids


def test_steps_and_aborts_over_the_peers_limit_go_in_pieces_and_the_stream_survives(model, logs):
    """The shared stream carries one message per step (core -> frontend) and one per abort (frontend -> core); one
    over the receiver's limit ends the stream and every request on it. With both core limits at 10 KiB: 30 n-children
    with 1000-character ids make each step's outputs about 31 KB and their abort about 31 KB, which now go in pieces;
    prompt logprobs too large for any message end only their own request, with RESOURCE_EXHAUSTED. A request running
    beside all of it gets every token (before, it got UNAVAILABLE "lost the engine core")."""
    limit_mib = "0.01"  # 10485 bytes
    limit = int(0.01 * 2**20)
    core_args = [*CORE_ARGS, "--max-send-message-mib", limit_mib, "--max-receive-message-mib", limit_mib]
    long_id = "q" * 1000
    sampled = {"temperature": 1.0, "seed": 1, "ignore_eos": True}
    with split_stack(model, logs, core_args=core_args) as ([core], frontend):

        async def scenario():
            started = asyncio.Event()
            beside = asyncio.create_task(generate_ids(frontend.address, list(range(10, 30)), 60, started))
            await started.wait()
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                stub = api_grpc.GenerationStub(channel)
                params = api.SamplingParams(n=30, max_tokens=8, output_kind=api.OUTPUT_KIND_FINAL_ONLY, **sampled)
                request = api.GenerateRequest(prompt_token_ids=list(range(40, 50)), request_id=long_id)
                request.sampling_params.CopyFrom(params)
                fanned_out = [r async for r in stub.Generate(request)]
                # Cancelled mid-stream: the frontend aborts the 30 children in the core.
                request.sampling_params.CopyFrom(api.SamplingParams(n=30, max_tokens=200, **sampled))
                call = stub.Generate(request)
                await call.read()
                call.cancel()
                too_large = api.GenerateRequest(
                    prompt_token_ids=list(range(10, 110)),
                    sampling_params=api.SamplingParams(max_tokens=2, prompt_logprobs=20),
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(too_large).read()
            return fanned_out, refused.value, await beside

        fanned_out, refused, (code, details, token_ids, _) = asyncio.run(scenario())
        assert code == grpc.StatusCode.OK, details
        assert token_ids == asyncio.run(generate_ids(frontend.address, list(range(10, 30)), 60))[2]  # all 60, right
        assert fanned_out[-1].finished and sorted(o.index for o in fanned_out[-1].outputs) == list(range(30))
        assert all(len(o.token_ids) == 8 for o in fanned_out[-1].outputs)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"more than the {limit} bytes the engine core sends in one message" in refused.details()
        # The cancelled children and the refused request were aborted in the core: nothing runs, every block is free.
        assert wait_for(lambda: core_load(core).num_running_reqs == 0)
        load = core_load(core)
        assert load.num_waiting_reqs == 0 and load.num_free_kv_blocks == load.num_usable_kv_blocks
        log = (logs / f"frontend-{frontend.address.rsplit(':', 1)[1]}.log").read_text()
        assert "unreachable" not in log and "RESOURCE_EXHAUSTED" not in log  # the stream never broke


def test_a_frontends_send_limit_bounds_its_own_calls_not_its_stream_to_the_core(model, logs):
    """A frontend's --max-send-message-mib is what it sends its callers. It used to be also the most it took from a
    core, so a step's outputs over it (prompt logprobs here) ended the frontend's stream, every request on it; now
    only the call whose message is too large fails, with RESOURCE_EXHAUSTED."""
    with split_stack(model, logs, frontend_args=["--max-send-message-mib", "0.01"]) as ([core], frontend):

        async def scenario():
            started = asyncio.Event()
            beside = asyncio.create_task(generate_ids(frontend.address, list(range(10, 30)), 60, started))
            await started.wait()
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                large = api.GenerateRequest(
                    prompt_token_ids=list(range(10, 110)),
                    sampling_params=api.SamplingParams(max_tokens=2, prompt_logprobs=20),
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await api_grpc.GenerationStub(channel).Generate(large).read()
            return refused.value, await beside

        refused, (code, details, token_ids, _) = asyncio.run(scenario())
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert code == grpc.StatusCode.OK and len(token_ids) == 60, details
        assert wait_for(lambda: core_load(core).num_running_reqs == 0)
