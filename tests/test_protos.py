"""The committed stubs (splitserve.stubs) match protos/, and the core's converter round-trips the wire messages."""

from __future__ import annotations

import hashlib
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from core_svc.outputs import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, SchedulerStats
from core_svc.request import EngineCoreEvent, EngineCoreEventType, FinishReason
from core_svc.wire import outputs_to_pb, request_from_pb
from splitserve.stubs.engine.v1 import engine_core_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        generate_protos = importlib.import_module("generate_protos")
    finally:
        sys.path.pop(0)
    for rel in generate_protos.proto_files():
        out = tmp_path / "descriptor.pb"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                *generate_protos.include_args(),
                f"--descriptor_set_out={out}",
                str(rel),
            ],
            check=True,
        )
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
        _drop_json_names(fresh)  # protoc's Python generator leaves them out of the embedded descriptor
        module = importlib.import_module(str(rel.with_suffix("")).replace("/", ".") + "_pb2")
        committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert committed == fresh, f"{rel}: stubs are stale; run python scripts/generate_protos.py"


def _drop_json_names(file: object) -> None:
    def visit(message: object) -> None:
        for field in message.field:
            field.ClearField("json_name")
        for nested in message.nested_type:
            visit(nested)

    for message in file.message_type:
        visit(message)


def test_enum_values_agree_with_the_core():
    for reason in FinishReason:
        assert pb.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason.value
    for event in EngineCoreEventType:
        assert pb.EngineCoreEventType.Value(f"ENGINE_CORE_EVENT_TYPE_{event.name}") == event.value


def test_request_from_pb_applies_vllm_defaults_and_keeps_every_field():
    msg = pb.EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        arrival_time=12.5,
        priority=-1,
        client_index=2,
        cache_salt="s",
        trace_headers={"traceparent": "00-abc-def-01"},
        lora_request=pb.LoRARequest(lora_name="ad", lora_int_id=1, lora_path="/p"),
        mm_features=[pb.MultiModalFeatureSpec(modality="image", identifier="h", offset=1, length=2)],
        sampling_params=pb.SamplingParams(top_k=5, seed=0, stop_token_ids=[7, 7, 9], logit_bias={4: -2.0}),
    )
    request = request_from_pb(msg)
    params = request.sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.repetition_penalty) == (
        1.0,
        1.0,
        5,
        16,
        1.0,
    )
    assert params.seed == 0  # set-to-zero survives thanks to `optional`
    assert params.logprobs is None and params.eos_token_id is None
    assert params.stop_token_ids == [7, 9] and params.logit_bias == {4: -2.0} and params.allowed_token_ids is None
    assert (request.request_id, request.prompt_token_ids, request.arrival_time, request.priority) == (
        "r1",
        [1, 2, 3],
        12.5,
        -1,
    )
    assert (request.client_index, request.cache_salt, request.lora_name) == (2, "s", "ad")
    assert request.trace_headers == {"traceparent": "00-abc-def-01"}
    assert request.mm_features[0].identifier != "h" and request.mm_features[0].offset == 1  # see the next test
    assert request_from_pb(pb.EngineCoreRequest(request_id="x", prompt_token_ids=[1])).cache_salt is None
    # allowed_token_ids index every step's logits: repeats are dropped once, here (a client sent 4M copies).
    repeated = pb.EngineCoreRequest(sampling_params=pb.SamplingParams(allowed_token_ids=[8, 3] * 1000 + [5]))
    assert request_from_pb(repeated).sampling_params.allowed_token_ids == [8, 3, 5]
    # A positive temperature below 0.01 is raised to it, as vLLM's SamplingParams does (0 stays greedy).
    for sent, used in ((0.002, 0.01), (0.0, 0.0), (0.5, 0.5)):
        message = pb.EngineCoreRequest(sampling_params=pb.SamplingParams(temperature=sent))
        assert request_from_pb(message).sampling_params.temperature == used


def test_outputs_to_pb():
    logprobs = LogprobsLists([[5, 5, 9]], [[-0.1, -0.1, -2.5]], [1])
    outputs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput(
                "a",
                [5],
                new_logprobs=logprobs,
                finish_reason=FinishReason.STOP,
                stop_reason=42,
                events=[EngineCoreEvent(EngineCoreEventType.SCHEDULED, 3.0)],
                num_cached_tokens=16,
            ),
            EngineCoreOutput("b", [6]),
        ],
        scheduler_stats=SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25, num_preemptions=2),
        finished_requests={"a", "z"},
        timestamp=99.0,
    )
    msg = pb.EngineCoreOutputs.FromString(outputs_to_pb(outputs).SerializeToString())
    a, b = msg.outputs
    assert a.finish_reason == pb.FINISH_REASON_STOP and a.stop_token_id == 42 and a.num_cached_tokens == 16
    assert list(a.new_logprobs[0].token_ids) == [5, 5, 9] and a.new_logprobs[0].rank == 1
    assert a.new_logprobs[0].logprobs[2] == pytest.approx(-2.5)
    assert a.events[0].type == pb.ENGINE_CORE_EVENT_TYPE_SCHEDULED and a.events[0].timestamp == 3.0
    assert b.finish_reason == pb.FINISH_REASON_UNSPECIFIED and b.WhichOneof("stop_reason") is None
    assert msg.scheduler_stats.num_preemptions == 2 and msg.scheduler_stats.kv_cache_usage == 0.25
    assert list(msg.finished_requests) == ["a", "z"] and msg.timestamp == 99.0


def _identifier(client_identifier: str = "h", modality: str = "image", **tensors: pb.TensorData) -> str:
    spec = pb.MultiModalFeatureSpec(modality=modality, identifier=client_identifier, offset=1, length=2, data=tensors)
    request = request_from_pb(pb.EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3], mm_features=[spec]))
    return request.mm_features[0].identifier


def test_the_core_hashes_each_item_itself() -> None:
    # sha256 over the modality, then each tensor by name: name, dtype, shape, bytes, each length-prefixed.
    pixels = pb.TensorData(dtype="float32", shape=[1, 2], data=bytes(8))
    fields = [b"image", b"pixel_values", b"float32", b"1,2", bytes(8)]
    expected = hashlib.sha256(b"".join(len(f).to_bytes(8, "little") + f for f in fields)).hexdigest()
    assert _identifier("h", pixel_values=pixels) == _identifier("other", pixel_values=pixels) == expected
    grid = pb.TensorData(dtype="int64", shape=[3], data=bytes(24))
    assert _identifier(pixel_values=pixels, grid=grid) == _identifier(grid=grid, pixel_values=pixels)
    different = [
        _identifier(modality="video", pixel_values=pixels),
        _identifier(pixels=pixels),
        _identifier(pixel_values=pb.TensorData(dtype="int32", shape=[1, 2], data=bytes(8))),
        _identifier(pixel_values=pb.TensorData(dtype="float32", shape=[2, 1], data=bytes(8))),
        _identifier(pixel_values=pb.TensorData(dtype="float32", shape=[1, 2], data=bytes(7) + b"\x01")),
    ]
    assert len({expected, *different}) == 1 + len(different)
