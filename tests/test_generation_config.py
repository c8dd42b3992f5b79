"""Sampling defaults from the model's generation_config.json (vLLM's ``--generation-config``): read, reported,
applied to unset fields in the Python API and over gRPC, ignored with "vllm"."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest

from frontend_svc import LLM, SamplingParams, ValidationError
from frontend_svc.generation_config import load_default_sampling_params
from splitserve.entrypoints import stack
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.conftest import GENERATION_CONFIG_DEFAULTS

PROMPTS = ["The capital of France is", "Once upon a time"]


def test_defaults_are_read_from_the_model_a_folder_or_not_at_all(generation_config_model, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="frontend_svc.generation_config"):
        assert load_default_sampling_params(generation_config_model) == GENERATION_CONFIG_DEFAULTS
    assert "Default sampling parameters from the model" in caplog.text  # logged at startup, as vLLM does
    assert "'top_k': 1" in caplog.text
    assert load_default_sampling_params(generation_config_model, "vllm") == {}
    folder = tmp_path / "other"
    folder.mkdir()
    # max_new_tokens is vLLM's max_tokens; fields outside vLLM's list (do_sample, num_beams) are not taken.
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.5, "max_new_tokens": 5, "repetition_penalty": 1.2, "num_beams": 4})
    )
    assert load_default_sampling_params(generation_config_model, str(folder)) == {
        "temperature": 0.5,
        "repetition_penalty": 1.2,
        "max_tokens": 5,
    }
    with pytest.raises(ValidationError, match="generation_config: must be 'auto', 'vllm' or a folder"):
        load_default_sampling_params(generation_config_model, str(tmp_path / "missing"))
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValidationError, match="generation_config: .* sets a default that is refused: top_p") as info:
        load_default_sampling_params(generation_config_model, str(folder))
    assert str(info.value).endswith("(--generation-config vllm ignores the model's defaults)")  # the way out


def test_llm_uses_the_models_defaults_when_sampling_params_is_none(generation_config_model):
    with LLM(str(generation_config_model), num_kv_blocks=65) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.7, 0.9, 1)
        # top_k = 1 samples the most likely token: the defaults are greedy.
        with_defaults = llm.generate(PROMPTS, use_tqdm=False)
        greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in with_defaults] == [o.outputs[0].token_ids for o in greedy]
        assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in greedy)
    with LLM(str(generation_config_model), num_kv_blocks=65, generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    folder = generation_config_model.parent / "max-new-tokens"
    folder.mkdir(exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    with LLM(str(generation_config_model), num_kv_blocks=65, generation_config=str(folder)) as llm:
        defaults = llm.get_default_sampling_params()  # vLLM's: the model's max_new_tokens is max_tokens
        assert (defaults.max_tokens, defaults.default_max_tokens) == (7, None)
        (output,) = llm.generate(PROMPTS[:1], use_tqdm=False)
        assert len(output.outputs[0].token_ids) == 7 or output.outputs[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def frontends(generation_config_model, tmp_path_factory):
    """One core; a frontend with the model's defaults ("auto") and one without ("vllm")."""
    model = str(generation_config_model)
    logs = tmp_path_factory.mktemp("generation-config-logs")
    core = stack.start_core(model, logs, ["--num-kv-blocks", "65", "--max-model-len", "256"])
    started = [core]
    try:
        core.wait_serving()
        auto = stack.start_frontend(model, [core.address], logs)
        started.append(auto)
        ignoring = stack.start_frontend(model, [core.address], logs, ["--generation-config", "vllm"])
        started.append(ignoring)
        auto.wait_serving()
        ignoring.wait_serving()
        yield auto.address, ignoring.address
    finally:
        for process in reversed(started):
            process.stop()


def token_ids(address: str, prompt: str, **fields: object) -> list[int]:
    async def call() -> list[int]:
        params = api.SamplingParams(max_tokens=12, output_kind=api.OUTPUT_KIND_FINAL_ONLY, **fields)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = api_grpc.GenerationStub(channel)
            responses = [r async for r in stub.Generate(api.GenerateRequest(prompt=prompt, sampling_params=params))]
        return list(responses[-1].outputs[0].token_ids)

    return asyncio.run(call())


def test_get_model_info_reports_the_defaults(frontends):
    auto, ignoring = frontends
    with grpc.insecure_channel(auto) as channel:
        info = api_grpc.GenerationStub(channel).GetModelInfo(api.GetModelInfoRequest(), timeout=30)
    defaults = info.default_sampling_params
    assert info.generation_config == "auto"
    assert pytest.approx(defaults.temperature) == 0.7 and pytest.approx(defaults.top_p) == 0.9
    assert defaults.top_k == 1
    assert not any(defaults.HasField(name) for name in ("min_p", "repetition_penalty", "max_tokens"))
    with grpc.insecure_channel(ignoring) as channel:
        info = api_grpc.GenerationStub(channel).GetModelInfo(api.GetModelInfoRequest(), timeout=30)
    assert info.generation_config == "vllm" and info.default_sampling_params == api.SamplingParams()


def test_unset_fields_take_the_defaults_and_explicit_fields_override_them(frontends):
    auto, ignoring = frontends
    for prompt in PROMPTS:
        greedy = token_ids(auto, prompt, temperature=0.0, ignore_eos=True)
        assert token_ids(auto, prompt, ignore_eos=True) == greedy  # top_k 1 from the model
        # top_k given: it wins; temperature and top_p still come from the model. The "vllm" frontend, which has
        # no defaults, gets the same request spelled out in full.
        overridden = token_ids(auto, prompt, top_k=0, seed=3, ignore_eos=True)
        spelled_out = token_ids(ignoring, prompt, temperature=0.7, top_p=0.9, top_k=0, seed=3, ignore_eos=True)
        assert overridden == spelled_out
    assert any(
        token_ids(auto, p, top_k=0, seed=3, ignore_eos=True) != token_ids(auto, p, temperature=0.0, ignore_eos=True)
        for p in PROMPTS
    )


def test_generation_config_vllm_ignores_the_models_defaults(frontends):
    auto, ignoring = frontends
    for prompt in PROMPTS:
        # Unset fields on the "vllm" frontend are vLLM's defaults: temperature 1, top_p 1, top_k off.
        unset = token_ids(ignoring, prompt, seed=7, ignore_eos=True)
        assert unset == token_ids(auto, prompt, temperature=1.0, top_p=1.0, top_k=0, seed=7, ignore_eos=True)
    assert any(
        token_ids(ignoring, p, seed=7, ignore_eos=True) != token_ids(auto, p, temperature=0.0, ignore_eos=True)
        for p in PROMPTS
    )
