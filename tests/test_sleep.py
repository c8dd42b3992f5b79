"""Sleep mode (vLLM's sleep / wake_up / is_sleeping): the memory a sleeping core gives back (RSS of the core's
process, measured with psutil), the same greedy outputs after waking, the prefix cache forgotten, requests in flight
ended (or drained) with their blocks returned, refusals while asleep, readiness, the admin gate, and the frontend's
API over both core clients and the HTTP routes.

The in-process ``EngineCore`` carries most of it (fast); one real core process carries the RPCs and readiness.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from core_svc.admin import AdminPolicy
from core_svc.engine_core import EngineCore
from core_svc.engine_loop import EngineLoop
from core_svc.errors import EngineUnavailableError, InvalidRequestError, SleepCancelledError
from core_svc.observability import observe_engine_core
from core_svc.request import FinishReason, Request
from core_svc.sampling_params import SamplingParams
from core_svc.service import CoreServerState, EngineCoreServicer
from splitserve.entrypoints import stack
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as core_grpc
from tests.conftest import builtin_tokenizer_dir
from tests.helpers import make_engine, run_engine

# The tiny preset (4 layers, 2 KV heads of 16) with a wide MLP, so that its weights are tens of MiB: measurable.
INTERMEDIATE_SIZE = 8192
NUM_KV_BLOCKS = 4097  # the null block and 4096 of 16 tokens
BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 16 * 4  # K and V, layers, KV heads, head size, float32: 1 KiB
KV_CACHE_BYTES = NUM_KV_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN  # 64 MiB
CORE_ARGS = ["--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "256"]
PROMPT = list(range(5, 45))  # 40 tokens: two full blocks go to the prefix cache
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from splitserve.entrypoints.test_model import make_test_model

    return make_test_model(
        tmp_path_factory.mktemp("sleep-model"),
        "llama",
        "tiny",
        tokenizer=builtin_tokenizer_dir(),
        config_overrides={"intermediate_size": INTERMEDIATE_SIZE},
    )


@pytest.fixture(scope="module")
def checkpoint_bytes(model: Path) -> int:
    """The bytes of the checkpoint's tensors (float32), read from the safetensors file, not from the core."""
    from safetensors import safe_open

    total = 0
    for file in model.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


@pytest.fixture(scope="module")
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def engine(model: Path, registry: CollectorRegistry) -> EngineCore:
    engine = make_engine(model, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256)
    observe_engine_core(engine, "m", registry, None)
    return engine


def sleep_states(registry: CollectorRegistry) -> dict[str, float | None]:
    """vLLM's engine_sleep_state gauge, by its sleep_state label."""
    return {
        state: registry.get_sample_value(
            "splitserve:engine_sleep_state", {"model_name": "m", "engine": "0", "sleep_state": state}
        )
        for state in ("awake", "weights_offloaded", "discard_all")
    }


@pytest.fixture(scope="module")
def reference(engine: EngineCore) -> list[int]:
    """The greedy tokens of PROMPT before any sleep."""
    tokens, cached = greedy(engine)
    assert cached == 0
    return tokens


def rss(pid: int | None = None) -> int:
    return psutil.Process(pid).memory_info().rss


def greedy(engine: EngineCore) -> tuple[list[int], int]:
    """The greedy tokens of PROMPT and its cached-token count."""
    [result], _ = run_engine(engine, [PROMPT], MAX_TOKENS)
    return result.token_ids, result.num_cached_tokens


def num_prefix_hit_tokens(engine: EngineCore) -> int:
    """The tokens of PROMPT the prefix cache would serve now."""
    request = Request("lookup", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    return engine.scheduler.kv_cache_manager.get_computed_blocks(request)[1]


def assert_no_block_held(engine: EngineCore) -> None:
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == NUM_KV_BLOCKS - 1
    assert not pool.cached_block_hash_to_block  # every hash forgotten
    assert all(block.block_hash is None for block in pool.blocks)


def test_level_1_returns_the_kv_cache_to_the_os_and_wakes_to_the_same_outputs(
    engine: EngineCore, reference: list[int], registry: CollectorRegistry
) -> None:
    assert sleep_states(registry) == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    assert num_prefix_hit_tokens(engine) == 32  # the prefix cache holds the prompt's two full blocks
    assert engine.model_runner.kv_cache_bytes == KV_CACHE_BYTES
    before = rss()
    result, outputs = engine.sleep(1)
    freed = before - rss()
    assert (result.kv_cache_bytes_freed, result.weights_bytes_freed, result.num_aborted_requests) == (
        KV_CACHE_BYTES,
        0,  # on CPU the weights are in host memory already: kept where they are
        0,
    )
    assert not outputs.outputs
    assert freed >= 0.9 * KV_CACHE_BYTES, f"RSS fell by {freed / 2**20:.1f} MiB"
    assert engine.is_sleeping() and engine.sleep_state.sleeping_tags == ["weights", "kv_cache"]
    assert sleep_states(registry) == {"awake": 0.0, "weights_offloaded": 1.0, "discard_all": 0.0}
    assert_no_block_held(engine)
    with pytest.raises(EngineUnavailableError, match="the engine core is sleeping"):
        engine.add_request(Request("refused", PROMPT, SamplingParams(temperature=0.0, max_tokens=1)))
    engine.wake_up()
    assert not engine.is_sleeping()
    assert engine.model_runner.kv_cache_bytes == KV_CACHE_BYTES
    assert num_prefix_hit_tokens(engine) == 0
    assert greedy(engine) == (reference, 0)  # the same outputs; nothing left in the prefix cache


def test_level_2_drops_the_weights_too_and_reloads_them(
    engine: EngineCore, reference: list[int], checkpoint_bytes: int, registry: CollectorRegistry
) -> None:
    before = rss()
    result, _ = engine.sleep(2)
    freed = before - rss()
    assert result.kv_cache_bytes_freed == KV_CACHE_BYTES
    # prepacked layouts are no smaller; memory two tensors view (an AMX Linear's dense_weight) counted once
    assert checkpoint_bytes * 0.99 <= result.weights_bytes_freed <= checkpoint_bytes * 1.1
    # 0.95 of the sum: more than the KV cache and most of the weights (a quarter of it).
    assert freed >= 0.95 * (KV_CACHE_BYTES + checkpoint_bytes), f"RSS fell by {freed / 2**20:.1f} MiB"
    assert sleep_states(registry)["discard_all"] == 1.0
    with pytest.raises(EngineUnavailableError, match="weights are discarded"):
        _ = engine.model_runner.model
    # The KV cache first, while the weights are still off (as vLLM allows): still asleep, still refusing.
    engine.wake_up(["kv_cache"])
    assert engine.is_sleeping() and engine.sleep_state.sleeping_tags == ["weights"]
    assert engine.model_runner.kv_cache_bytes == KV_CACHE_BYTES
    with pytest.raises(EngineUnavailableError, match="sleeping"):
        engine.add_request(Request("refused", PROMPT, SamplingParams(temperature=0.0, max_tokens=1)))
    engine.wake_up(["weights"])
    assert not engine.is_sleeping() and sleep_states(registry)["awake"] == 1.0
    assert engine.dtype == next(engine.model_runner.model.parameters()).dtype
    assert greedy(engine) == (reference, 0)


def test_requests_in_flight_end_with_unavailable_and_give_their_blocks_back(engine: EngineCore) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request(Request("running", PROMPT, params))
    engine.step()
    engine.step()
    engine.add_request(Request("waiting", PROMPT[:20], params))
    assert engine.scheduler.kv_cache_manager.num_free_blocks < NUM_KV_BLOCKS - 1
    result, outputs = engine.sleep(1)
    assert result.num_aborted_requests == 2
    assert sorted(result.aborted_request_ids) == ["running", "waiting"]
    ended = {o.request_id: o for o in outputs.outputs}
    assert set(ended) == {"running", "waiting"}
    for output in ended.values():
        assert output.finish_reason == FinishReason.ERROR
        assert isinstance(output.error, EngineUnavailableError)
        assert "put to sleep" in str(output.error)
    assert not engine.has_unfinished_requests() and not engine.model_runner.requests
    assert_no_block_held(engine)
    engine.wake_up()


def test_bad_level_and_tag_are_refused_naming_the_field(engine: EngineCore) -> None:
    for level in (0, 3, -1):
        with pytest.raises(InvalidRequestError) as refused:
            engine.sleep(level)
        assert refused.value.field == "level"
    with pytest.raises(InvalidRequestError) as refused:
        engine.wake_up(["kv_cache", "gpu"])
    assert refused.value.field == "tags[1]"
    assert not engine.is_sleeping() and engine.model_runner.kv_cache_bytes == KV_CACHE_BYTES


def hold_engine_thread(engine_loop: EngineLoop) -> threading.Event:
    """Block the engine thread on a command until the returned event is set: the commands queued meanwhile are
    then applied together, in order, before the core steps again."""
    gate = threading.Event()
    engine_loop.submit(lambda: gate.wait(timeout=30))  # a failed test does not hold it for ever
    return gate


def applied(engine_loop: EngineLoop) -> None:
    """Return once the engine thread has applied every command queued before."""
    engine_loop.submit(lambda: None).result(timeout=10)


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for something the engine thread does after a command's future is done (the sleep a drain waited
    for runs after the pass's commands), up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_sleep_with_drain_lets_requests_finish_and_refuses_new_ones(checkpoint: Callable[..., Path]) -> None:
    engine = make_engine(checkpoint("llama"), num_kv_blocks=64, max_model_len=256)
    outputs: list = []
    engine_loop = EngineLoop(engine)
    client = engine_loop.register_client(outputs.append)
    engine_loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        # The request, the sleep and a late request reach the core together: the sleep finds it in flight.
        gate = hold_engine_thread(engine_loop)
        added = engine_loop.add_requests(client, [Request("long", PROMPT, params)])
        sleeping = engine_loop.sleep(1, drain=True)
        late = engine_loop.add_requests(client, [Request("late", PROMPT, params)])
        gate.set()
        added.result(timeout=10)
        with pytest.raises(EngineUnavailableError, match="going to sleep"):
            late.result(timeout=10)
        result = sleeping.result(timeout=30)
        assert result.num_aborted_requests == 0
        long_tokens = [t for o in outputs for out in o.outputs if out.request_id == "long" for t in out.new_token_ids]
        finishes = [out.finish_reason for o in outputs for out in o.outputs if out.request_id == "long"]
        assert len(long_tokens) == 60 and finishes[-1] == FinishReason.LENGTH  # drained, not ended
        assert engine.is_sleeping()
        engine_loop.wake_up().result(timeout=30)
        assert not engine.is_sleeping()
        # A wake_up while a drain goes on calls the sleep off; the request runs to its end.
        gate = hold_engine_thread(engine_loop)
        again = engine_loop.add_requests(client, [Request("again", PROMPT, params)])
        sleeping = engine_loop.sleep(2, drain=True)
        woken = engine_loop.wake_up()
        gate.set()
        again.result(timeout=10)
        woken.result(timeout=10)
        with pytest.raises(SleepCancelledError):
            sleeping.result(timeout=10)
        assert not engine.is_sleeping() and engine.refusal is None
    finally:
        engine_loop.stop()


def test_a_drain_goes_on_when_its_caller_gives_up(checkpoint: Callable[..., Path]) -> None:
    """Cancelling the future ``EngineLoop.sleep`` returned (a caller that stops waiting) calls nothing off: once
    the core has drained, it sleeps, and ``on_done`` hears of it."""
    engine = make_engine(checkpoint("llama"), num_kv_blocks=64, max_model_len=256)
    engine_loop = EngineLoop(engine)
    client = engine_loop.register_client(lambda outputs: None)
    engine_loop.start()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gate = hold_engine_thread(engine_loop)  # the request and the sleep reach the core together
        added = engine_loop.add_requests(client, [Request("long", PROMPT, params)])
        done: list[concurrent.futures.Future] = []
        slept = threading.Event()
        sleeping = engine_loop.sleep(1, drain=True, on_done=lambda f: (done.append(f), slept.set()))
        assert sleeping.cancel()
        gate.set()
        added.result(timeout=10)
        applied(engine_loop)
        assert "going to sleep (level 1)" in str(engine.refusal) and not done  # draining
        engine_loop.abort_requests(["long"], client).result(timeout=10)
        assert slept.wait(timeout=10)
        assert engine.is_sleeping() and "the engine core is sleeping" in str(engine.refusal)
        [engine_side] = done
        assert engine_side.result().level == 1 and engine_side.result().num_aborted_requests == 0
        assert sleeping.cancelled()
        engine_loop.wake_up().result(timeout=30)
        assert not engine.is_sleeping() and engine.refusal is None
    finally:
        engine_loop.stop()


def servicer_on(engine_loop: EngineLoop, tmp_path: Path) -> tuple[EngineCoreServicer, list[bool]]:
    """The core's servicer over ``engine_loop``, admin RPCs on; the readiness statuses it sets, in order."""
    readiness: list[bool] = []
    state = CoreServerState(
        engine_loop=engine_loop, admin=AdminPolicy(enabled=True, profile_dir=tmp_path), set_serving=readiness.append
    )
    return EngineCoreServicer(state), readiness


def test_a_cancelled_sleep_rpc_still_sleeps_and_readiness_follows(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """A ``Sleep(drain=True)`` call cancelled (its caller gone, its deadline past) while the core drains: the core
    still sleeps once its requests have finished, and readiness stays NOT_SERVING throughout (never SERVING while
    the sleep waits or after it)."""
    engine = make_engine(checkpoint("llama"), num_kv_blocks=64, max_model_len=256)
    engine_loop = EngineLoop(engine)
    client = engine_loop.register_client(lambda outputs: None)
    engine_loop.start()
    servicer, readiness = servicer_on(engine_loop, tmp_path)
    context: Any = None  # not used unless the call fails

    async def scenario() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gate = hold_engine_thread(engine_loop)  # the request and the sleep reach the core together
        added = engine_loop.add_requests(client, [Request("long", PROMPT, params)])
        call = asyncio.ensure_future(servicer.Sleep(core_pb.SleepRequest(level=1, drain=True), context))
        await asyncio.sleep(0)  # the call runs up to its wait: the sleep is queued
        assert readiness == [False]
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        gate.set()
        added.result(timeout=10)
        applied(engine_loop)
        assert "going to sleep" in str(engine.refusal) and readiness == [False]
        engine_loop.abort_requests(["long"], client).result(timeout=10)
        wait_until(lambda: len(readiness) == 2)  # the sleep's own readiness, from the engine thread
        assert engine.is_sleeping() and readiness == [False, False]
        response = await servicer.IsSleeping(core_pb.IsSleepingRequest(), context)
        assert response.is_sleeping
        await servicer.WakeUp(core_pb.WakeUpRequest(), context)
        assert not engine.is_sleeping() and readiness[-1] is True

    try:
        asyncio.run(scenario())
    finally:
        engine_loop.stop()


def test_a_wake_up_before_a_queued_sleep_leaves_readiness_not_serving(
    checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """``WakeUp`` then ``Sleep``, concurrent: the wake-up's readiness (SERVING) is set before the engine thread
    reaches the sleep; the sleep sets it again (NOT_SERVING) once it has run."""
    engine = make_engine(checkpoint("llama"), num_kv_blocks=64, max_model_len=256)
    engine_loop = EngineLoop(engine)
    engine_loop.start()
    servicer, readiness = servicer_on(engine_loop, tmp_path)
    context: Any = None

    async def scenario() -> None:
        engine_loop.sleep(1).result(timeout=30)
        gate = hold_engine_thread(engine_loop)
        wake = asyncio.ensure_future(servicer.WakeUp(core_pb.WakeUpRequest(), context))
        await asyncio.sleep(0)  # the wake-up is queued
        second_gate = hold_engine_thread(engine_loop)  # holds the sleep back until the wake-up has answered
        sleep = asyncio.ensure_future(servicer.Sleep(core_pb.SleepRequest(level=1), context))
        await asyncio.sleep(0)  # the sleep is queued
        gate.set()
        await wake
        assert not engine.is_sleeping() and readiness == [False, True]
        second_gate.set()
        await sleep
        assert engine.is_sleeping() and readiness[-1] is False

    try:
        asyncio.run(scenario())
    finally:
        engine_loop.stop()


def test_in_process_client_is_unavailable_through_a_drain_its_caller_gave_up_on(
    checkpoint: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """``AsyncInprocClient`` (``serve``'s in-process core): unavailable (readiness NOT_SERVING, HTTP /health 503)
    from the start of a draining sleep, as a core server's readiness, with the core's reason; a caller that gives
    up waiting (``asyncio.wait_for``) leaves the sleep going, and availability follows the core, not the call."""
    from frontend_svc.engine_types import EngineCoreRequest
    from frontend_svc.inproc_client import AsyncInprocClient
    from frontend_svc.sampling_params import SamplingParams as ApiSamplingParams

    client = AsyncInprocClient(str(checkpoint("llama")), num_kv_blocks=64, max_model_len=256)
    availability: list[bool] = []
    client.add_availability_listener(availability.append)
    engine_loop = client._edge()._running_engine_loop()

    async def scenario() -> None:
        params = ApiSamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gate = hold_engine_thread(engine_loop)  # the request and the sleep reach the core together
        added = asyncio.ensure_future(client.add_requests_async([EngineCoreRequest("long", PROMPT, params)]))
        await asyncio.sleep(0)  # the request is queued
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.sleep_async(1, drain=True), 0.05)  # it cannot end: the core is held
        assert not client.is_available() and availability == [False]
        gate.set()
        await added
        assert not await client.is_sleeping_async()  # draining
        assert not client.is_available() and "going to sleep" in client.unavailable_reason()
        await client.abort_requests_async(["long"])
        wait_until(client.engine_core.is_sleeping)
        assert await client.is_sleeping_async()
        assert not client.is_available() and availability == [False]
        assert "the engine core is sleeping" in client.unavailable_reason()
        await client.wake_up_async()
        assert client.is_available() and availability == [False, True]

    try:
        with caplog.at_level(logging.ERROR):
            asyncio.run(scenario())
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no InvalidStateError from a callback
    finally:
        client.shutdown()


@pytest.fixture(scope="module")
def core(model: Path, tmp_path_factory: pytest.TempPathFactory):
    """A core process on the model with a 64 MiB KV cache, admin RPCs on."""
    process = stack.start_core(str(model), tmp_path_factory.mktemp("sleep-logs"), [*CORE_ARGS, "--enable-admin-rpcs"])
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


def wait_health(core: stack.ServiceProcess, status: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while core.health() != status and time.monotonic() < deadline:
        time.sleep(0.02)
    assert core.health() == status


def test_core_rpcs_readiness_refusals_and_memory(core: stack.ServiceProcess) -> None:
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with core.channel() as channel:
        stub = core_grpc.EngineCoreStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Sleep(core_pb.SleepRequest(level=3))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "level" in refused.value.details()
        assert core.health() == SERVING
        before = rss(core.process.pid)
        response = stub.Sleep(core_pb.SleepRequest(level=1))
        freed = before - rss(core.process.pid)
        assert response.kv_cache_bytes_freed == KV_CACHE_BYTES
        assert freed >= 0.9 * KV_CACHE_BYTES, f"the core's RSS fell by {freed / 2**20:.1f} MiB"
        wait_health(core, NOT_SERVING)
        assert stub.IsSleeping(core_pb.IsSleepingRequest()).is_sleeping
        add = core_pb.EngineCoreClientMessage(
            add=core_pb.EngineCoreRequest(
                request_id="r", prompt_token_ids=PROMPT, sampling_params=core_pb.SamplingParams(max_tokens=4)
            )
        )
        [message] = list(stub.Connect(iter([add]), timeout=10))
        [output] = message.outputs
        assert output.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "the engine core is sleeping" in output.error.message
        with pytest.raises(grpc.RpcError) as refused:
            stub.WakeUp(core_pb.WakeUpRequest(tags=["weights", "gpu"]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tags[1]" in refused.value.details()
        stub.WakeUp(core_pb.WakeUpRequest())
        wait_health(core, SERVING)
        assert not stub.IsSleeping(core_pb.IsSleepingRequest()).is_sleeping


def test_llm_over_grpc_sleeps_refuses_and_wakes_to_the_same_text(core: stack.ServiceProcess, model: Path) -> None:
    from frontend_svc import LLM
    from frontend_svc import SamplingParams as ApiSamplingParams
    from frontend_svc.errors import EngineDeadError, ValidationError

    params = ApiSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model), core_address=core.address) as llm:
        [before] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        with pytest.raises(ValidationError) as refused:
            llm.sleep(level=5)
        assert refused.value.field == "level"
        llm.sleep(level=1)
        assert llm.is_sleeping()
        with pytest.raises(EngineDeadError, match="sleeping"):
            llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping()
        deadline = time.monotonic() + 5  # the client sees SERVING again through the core's health watch
        while not llm.llm_engine.engine_core.is_available() and time.monotonic() < deadline:
            time.sleep(0.02)
        [after] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        assert after.num_cached_tokens == 0


def test_llm_in_process_sleeps_and_wakes(checkpoint: Callable[..., Path]) -> None:
    from frontend_svc import LLM
    from frontend_svc import SamplingParams as ApiSamplingParams
    from frontend_svc.errors import EngineDeadError, ValidationError

    params = ApiSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(checkpoint("llama")), num_kv_blocks=64, max_model_len=256) as llm:
        [before] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        llm.sleep(level=2)
        assert llm.is_sleeping()
        with pytest.raises(EngineDeadError, match="sleeping"):
            llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        llm.wake_up(["weights"])
        assert llm.is_sleeping()
        llm.wake_up(["kv_cache"])
        assert not llm.is_sleeping()
        [after] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
        # LLMEngine, stepped by its caller: a request in flight at sleep ends with the next step, naming why.
        engine = llm.llm_engine
        engine.add_request("in-flight", {"prompt_token_ids": PROMPT}, ApiSamplingParams(max_tokens=50))
        engine.step()
        with pytest.raises(ValidationError) as refused:
            engine.sleep(1, drain=True)  # nothing would step it while the call waits
        assert refused.value.field == "drain"
        engine.sleep(1)
        with pytest.raises(EngineDeadError, match="put to sleep") as ended:
            engine.step()
        assert ended.value.request_id == "in-flight" and not engine.has_unfinished_requests()
        engine.wake_up()


def test_http_admin_routes_over_an_in_process_core(checkpoint: Callable[..., Path]) -> None:
    """vLLM's dev routes on the frontend's HTTP API (only with --enable-admin-routes), over ``AsyncLLM`` with its
    core in-process (``splitserve serve``): while it sleeps, /health is 503 and completions UNAVAILABLE (503) with
    the reason, and the availability listeners (``serve``'s readiness) hear of it."""
    import httpx2 as httpx

    from frontend_svc.async_llm import AsyncLLM
    from frontend_svc.openai_api import make_app
    from frontend_svc.service import FrontendServerState

    model = str(checkpoint("llama"))
    completion = {"prompt": "hi", "max_tokens": 2, "temperature": 0}

    async def scenario() -> None:
        engine = AsyncLLM(model, num_kv_blocks=64, max_model_len=256)
        availability: list[bool] = []
        engine.engine_core.add_availability_listener(availability.append)
        try:
            plain = make_app(FrontendServerState(model=model, engine=engine))
            admin = make_app(FrontendServerState(model=model, engine=engine, enable_admin_routes=True))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain), base_url="http://t") as client:
                assert (await client.post("/sleep")).status_code == 404  # no such route without the flag
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=admin), base_url="http://t") as client:
                before = (await client.post("/v1/completions", json=completion)).json()["choices"][0]["text"]
                refused = await client.post("/sleep", params={"level": 7})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "level"
                assert (await client.post("/sleep", params={"level": 2})).status_code == 200
                assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
                assert (await client.get("/health")).status_code == 503
                refused = await client.post("/v1/completions", json=completion)
                assert refused.status_code == 503 and "sleeping" in refused.json()["error"]["message"]
                refused = await client.post("/wake_up", params={"tags": "gpu"})
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "tags[0]"
                woken = await client.post("/wake_up", params=[("tags", "kv_cache"), ("tags", "weights")])
                assert woken.status_code == 200
                assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
                assert (await client.get("/health")).status_code == 200
                after = (await client.post("/v1/completions", json=completion)).json()["choices"][0]["text"]
                assert after == before
            assert availability == [False, True]
        finally:
            engine.close()

    asyncio.run(scenario())


@pytest.mark.cuda
def test_cuda_memory_allocated_drops_at_each_level(model: Path) -> None:
    import torch

    engine = make_engine(model, device="cuda", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=256)
    tokens, _ = greedy(engine)
    weights_bytes = engine.model_runner.weights_bytes()
    allocated = torch.cuda.memory_allocated()
    result, _ = engine.sleep(1)
    assert result.weights_bytes_freed == weights_bytes  # level 1 moves them to host memory
    assert allocated - torch.cuda.memory_allocated() >= KV_CACHE_BYTES + weights_bytes
    engine.wake_up()
    assert greedy(engine) == (tokens, 0)
    allocated = torch.cuda.memory_allocated()
    engine.sleep(2)
    assert allocated - torch.cuda.memory_allocated() >= KV_CACHE_BYTES + weights_bytes
    engine.wake_up()
    assert greedy(engine) == (tokens, 0)


def test_the_grpc_client_routes_around_a_core_that_is_not_serving() -> None:
    """The frontend's gRPC client sends new requests only to cores whose readiness says SERVING: a sleeping core's
    NOT_SERVING (seen through its health watch) takes it out of routing; with no other core, the refusal says
    why. (A request a sleeping core refused before the client saw that goes to another core as from a draining
    one: ``CoreConnection._receive``.)"""
    from frontend_svc.engine_types import EngineCoreRequest
    from frontend_svc.errors import EngineDeadError
    from frontend_svc.grpc_client import CoreConnection, GrpcCoreClient
    from frontend_svc.sampling_params import SamplingParams as ApiSamplingParams

    async def scenario() -> None:
        sleeping, awake = (CoreConnection(a, print, lambda: None, print) for a in ("10.0.0.1:1", "10.0.0.2:1"))
        sleeping.available, sleeping.serving = True, False  # its readiness went NOT_SERVING
        awake.available, awake.serving = True, True
        client = GrpcCoreClient.__new__(GrpcCoreClient)  # its routing only: no transport thread, no connections
        client.connections, client._owner = [sleeping, awake], {}
        for i in range(4):
            request = EngineCoreRequest(f"r{i}", PROMPT, ApiSamplingParams(max_tokens=2))
            await client._add([request])
        assert sorted(awake.in_flight) == ["r0", "r1", "r2", "r3"] and not sleeping.in_flight
        client.connections = [sleeping]
        with pytest.raises(
            EngineDeadError, match=r"10\.0\.0\.1:1 reachable but not serving \(the engine core is sleeping"
        ):
            await client._add([EngineCoreRequest("r4", PROMPT, ApiSamplingParams(max_tokens=2))])

    asyncio.run(scenario())


def _check_trace(paths: list[str], directory: Path | None) -> None:
    """One Chrome trace, in ``directory`` (None: the core's own), with the steps' events."""
    import json

    (path,) = paths
    assert directory is None or Path(path).parent == directory
    events = json.loads(Path(path).read_text())["traceEvents"]
    assert any(event.get("name", "").startswith("aten::") for event in events)


def test_llm_over_grpc_and_in_process_profiles_the_core(
    core: stack.ServiceProcess, model: Path, checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """vLLM's start_profile / stop_profile through each core client: the remote core (admin RPCs on), the
    in-process one stepped by LLM, and the threaded one under AsyncLLM; a second start or a stop with none running
    is FAILED_PRECONDITION. The remote core writes into its own --profile-dir (it refuses others)."""
    import asyncio

    from frontend_svc import LLM, AsyncLLM
    from frontend_svc import SamplingParams as ApiSamplingParams
    from frontend_svc.errors import FailedPreconditionError

    params = ApiSamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, (target, kwargs) in enumerate(
        [(model, {"core_address": core.address}), (checkpoint("llama"), {"num_kv_blocks": 64, "max_model_len": 256})]
    ):
        directory = None if "core_address" in kwargs else tmp_path / f"llm-{i}"
        with LLM(str(target), **kwargs) as llm:
            llm.start_profile(None if directory is None else str(directory))
            with pytest.raises(FailedPreconditionError, match="a profile is already running"):
                llm.start_profile()
            llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
            _check_trace(llm.stop_profile(), directory)
            with pytest.raises(FailedPreconditionError, match="no profile is running"):
                llm.stop_profile()

    async def run_async() -> list[str]:
        engine = AsyncLLM(str(checkpoint("llama")), num_kv_blocks=64, max_model_len=256)
        try:
            await engine.start_profile(str(tmp_path / "async"))
            async for _ in engine.generate({"prompt_token_ids": PROMPT}, params, "r"):
                pass
            return await engine.stop_profile()
        finally:
            engine.shutdown()

    _check_trace(asyncio.run(run_async()), tmp_path / "async")
