"""The gRPC core client's LoRA calls over several cores, against scripted cores (no model): a load goes to every
core, all or none; an unload to every core, NOT_FOUND only when none had it; the list is each name once; a request
with an adapter goes to a core that has it, and to none that lacks it while one has it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from frontend_svc.engine_types import EngineCoreRequest, LoRARequest
from frontend_svc.errors import NotFoundError, ValidationError
from frontend_svc.grpc_client import ENGINE_CORE_GRPC_SERVICE, GrpcCoreClient
from frontend_svc.sampling_params import SamplingParams
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as pb_grpc


class ScriptedLoraCore(pb_grpc.EngineCoreServicer):
    """A core that holds adapters by name and answers each request with one token: its own ``index``, or
    NOT_FOUND for an adapter it lacks. AddLora of a path in ``unreadable`` is INVALID_ARGUMENT, as a real core's."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.address = ""  # host:port, once served
        self.loras: dict[str, pb.LoRARequest] = {}
        self.unreadable: set[str] = set()
        self.slow: set[str] = set()  # AddLora of these paths loads, then answers after 1 s

    def GetEngineInfo(self, request: Any, context: Any) -> pb.EngineInfo:
        return pb.EngineInfo(
            model="m", max_model_len=64, block_size=16, num_kv_blocks=8, kv_cache_tokens=112, vocab_size=100,
            max_num_seqs=4, max_num_batched_tokens=64, max_logprobs=20, supports_lora=True,
        )  # fmt: skip

    def AddLora(self, request: pb.AddLoraRequest, context: grpc.ServicerContext) -> pb.AddLoraResponse:
        lora = pb.LoRARequest()
        lora.CopyFrom(request.lora_request)
        if lora.lora_path in self.unreadable:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: no adapter_config.json in {lora.lora_path}")
        lora.lora_int_id = len(self.loras) + 1
        self.loras[lora.lora_name] = lora
        if lora.lora_path in self.slow:
            time.sleep(1.0)
        return pb.AddLoraResponse(lora_request=lora)

    def RemoveLora(self, request: pb.RemoveLoraRequest, context: grpc.ServicerContext) -> pb.RemoveLoraResponse:
        if self.loras.pop(request.lora_name, None) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"lora_name: no adapter {request.lora_name!r}")
        return pb.RemoveLoraResponse()

    def ListLoras(self, request: Any, context: Any) -> pb.ListLorasResponse:
        return pb.ListLorasResponse(lora_requests=list(self.loras.values()))

    def Connect(self, messages: Iterator[pb.EngineCoreClientMessage], context: Any) -> Iterator[pb.EngineCoreOutputs]:
        for message in messages:
            if not message.HasField("add"):
                continue
            request = message.add
            output = pb.EngineCoreOutput(request_id=request.request_id)
            name = request.lora_request.lora_name if request.HasField("lora_request") else None
            if name is not None and name not in self.loras:
                output.finish_reason = pb.FINISH_REASON_ERROR
                output.error.CopyFrom(pb.RequestError(code=grpc.StatusCode.NOT_FOUND.value[0], message=f"no {name}"))
            else:
                output.new_token_ids.append(self.index)
                output.finish_reason = pb.FINISH_REASON_LENGTH
            yield pb.EngineCoreOutputs(outputs=[output])


@pytest.fixture(scope="module")
def cores() -> Iterator[list[ScriptedLoraCore]]:
    servicers = [ScriptedLoraCore(0), ScriptedLoraCore(1)]
    servers = []
    for servicer in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_EngineCoreServicer_to_server(servicer, server)
        health_servicer = health.HealthServicer()
        health_servicer.set(ENGINE_CORE_GRPC_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append(server)
    yield servicers
    for server in servers:
        server.stop(None)


@pytest.fixture
def client(cores: list[ScriptedLoraCore]) -> Iterator[GrpcCoreClient]:
    for core in cores:
        core.loras.clear()
        core.unreadable.clear()
        core.slow.clear()
    client = GrpcCoreClient([core.address for core in cores], wait_ready_s=30)
    deadline = time.monotonic() + 30
    while not all(c.accepting for c in client.connections) and time.monotonic() < deadline:
        time.sleep(0.02)  # both streams up (the constructor returns once the first is)
    yield client
    client.shutdown()


def run(client: GrpcCoreClient, name: str | None) -> tuple[list[int], Exception | None]:
    """One request with the adapter ``name``: the token (the core's index) or the error it ended with."""
    lora = LoRARequest(name) if name is not None else None
    request = EngineCoreRequest(f"r-{name}-{id(lora)}", [1, 2], SamplingParams(max_tokens=1), lora_request=lora)
    client.add_request(request)
    while True:
        for output in client.get_output().outputs:
            if output.request_id == request.request_id and output.finished:
                return output.new_token_ids, output.error


def test_load_goes_to_every_core_and_list_names_each_once(client, cores):
    loaded = client.add_lora(LoRARequest("sql", lora_path="/a/sql"))
    assert (loaded.lora_name, loaded.lora_path, loaded.lora_int_id) == ("sql", "/a/sql", 1)
    assert [set(core.loras) for core in cores] == [{"sql"}, {"sql"}]
    assert [lora.lora_name for lora in client.list_loras()] == ["sql"]


def test_a_core_that_refuses_a_load_leaves_it_on_none(client, cores):
    cores[1].unreadable.add("/a/bad")
    with pytest.raises(ValidationError) as refused:
        client.add_lora(LoRARequest("bad", lora_path="/a/bad"))
    assert refused.value.field == "lora_path" and "no adapter_config.json in /a/bad" in str(refused.value)
    assert [core.loras for core in cores] == [{}, {}]  # the first core unloaded it again


def test_a_core_that_times_out_loading_is_sent_an_unload_too(client, cores, monkeypatch):
    monkeypatch.setattr(client, "add_lora_timeout_s", 0.3)
    cores[1].slow.add("/a/slow")
    with pytest.raises(Exception, match="(?i)deadline"):
        client.add_lora(LoRARequest("slow", lora_path="/a/slow"))
    assert [core.loras for core in cores] == [{}, {}]  # the first core's load undone, and the one that timed out


def test_unload_is_not_found_only_when_no_core_has_it(client, cores):
    cores[0].loras["only-0"] = pb.LoRARequest(lora_name="only-0", lora_int_id=1, lora_path="/p")
    client.remove_lora("only-0")
    assert cores[0].loras == {}
    with pytest.raises(NotFoundError):
        client.remove_lora("only-0")


def test_a_request_goes_to_a_core_that_has_its_adapter(client, cores):
    # Loaded behind this client's back (another frontend, the core's --lora-modules): found by asking again.
    cores[1].loras["b"] = pb.LoRARequest(lora_name="b", lora_int_id=1, lora_path="/b")
    for _ in range(4):  # least outstanding requests alone would alternate
        assert run(client, "b") == ([1], None)
    token_ids, error = run(client, "missing")
    assert token_ids == [] and isinstance(error, NotFoundError)  # the core's answer
    # Without an adapter: not limited to the cores holding one (core 0 holds none; ties go to the first core).
    assert [run(client, None)[0] for _ in range(2)] == [[0], [0]]


def test_a_core_that_dropped_an_adapter_sends_its_requests_to_one_that_has_it(client, cores):
    """The frontend's list of a core's adapters goes stale (unloaded behind its back): the core's NOT_FOUND sends
    the request on to a core that lists the adapter, and the stale name is forgotten."""
    client.add_lora(LoRARequest("x", lora_path="/x"))
    del cores[0].loras["x"]
    assert [run(client, "x") for _ in range(6)] == [([1], None)] * 6
    assert "x" not in client.connections[0].lora_names
    del cores[1].loras["x"]  # gone everywhere: the core's NOT_FOUND reaches the caller
    token_ids, error = run(client, "x")
    assert token_ids == [] and isinstance(error, NotFoundError)
