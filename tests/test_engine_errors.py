"""Bad checkpoints fail at load with a message naming the problem; bad requests fail alone and the engine
keeps serving the others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core_svc.errors import InvalidRequestError, LoRANotFoundError, ModelLoadError, RequestTooLargeError
from core_svc.request import Request
from core_svc.sampling_params import SamplingParams
from tests.helpers import make_engine, run_engine


@pytest.fixture()
def tiny_copy(checkpoint, tmp_path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(checkpoint("llama"), dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_missing_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not a local folder and could not be fetched"):
        make_engine(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        make_engine(tmp_path / "empty")


def test_corrupt_weights(tiny_copy):
    (tiny_copy / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file" * 10)
    with pytest.raises(ModelLoadError, match="cannot read weights from .*model.safetensors"):
        make_engine(tiny_copy)


def test_missing_weight_file(tiny_copy):
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights"):
        make_engine(tiny_copy)


def test_missing_tensor(tiny_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny_copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, tiny_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lacks tensors for: \['model.layers.1.self_attn.qkv_proj.weight'\]"):
        make_engine(tiny_copy)


def test_unsupported_architecture_lists_supported(tiny_copy):
    edit_config(tiny_copy, architectures=["LlamaForSequenceClassification"])
    with pytest.raises(
        ModelLoadError,
        match="LlamaForSequenceClassification.*not supported; supported: "
        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        make_engine(tiny_copy)


def test_unsupported_rope_type(tiny_copy):
    edit_config(tiny_copy, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic' is not supported"):
        make_engine(tiny_copy)


def test_sharded_checkpoint_loads_like_the_single_file(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    src = checkpoint("qwen2")
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, dst / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    prompts = [[5, 6, 7, 8], [9] * 20]
    single, _ = run_engine(make_engine(src), prompts, 8)
    sharded, _ = run_engine(make_engine(dst), prompts, 8)
    assert [r.token_ids for r in sharded] == [r.token_ids for r in single]


def request(request_id: str, prompt: list[int], **params: object) -> Request:
    return Request(request_id, prompt, SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}))


def test_bad_requests_fail_alone(checkpoint):
    engine = make_engine(checkpoint("llama"), max_model_len=64, num_kv_blocks=4)
    vocab = engine.vocab_size
    engine.add_request(request("good", [5, 6, 7], max_tokens=20, ignore_eos=True))
    engine.step()
    cases = [
        (request("empty", []), InvalidRequestError, "prompt_token_ids: is empty"),
        (request("long", [5] * 64), InvalidRequestError, "64 tokens, which leaves no room .* max_model_len=64"),
        (request("oov", [5, vocab, 6]), InvalidRequestError, rf"prompt_token_ids\[1\]: token id {vocab} is outside"),
        (request("neg", [-1]), InvalidRequestError, r"prompt_token_ids\[0\]: token id -1 is outside"),
        (request("temp", [5], temperature=-1.0), InvalidRequestError, "temperature: must be in"),
        (request("topp", [5], top_p=0.0), InvalidRequestError, "top_p: must be in"),
        (request("stop", [5], stop_token_ids=[vocab + 3]), InvalidRequestError, r"stop_token_ids\[0\]"),
        (request("lp", [5], logprobs=21), InvalidRequestError, r"logprobs: must be in \[0, 20\] \(max_logprobs\)"),
        (request("lpall", [5], prompt_logprobs=-1), InvalidRequestError, "prompt_logprobs: must be in"),
        (request("allowed", [5], allowed_token_ids=[]), InvalidRequestError, "allowed_token_ids: must not be empty"),
        (request("good", [5]), InvalidRequestError, "already in use"),
        (
            Request("prio", [5], SamplingParams(max_tokens=2), priority=3),
            InvalidRequestError,
            "priority: 3 needs the priority scheduling policy",
        ),
        (
            Request("lora", [5], SamplingParams(max_tokens=2), lora_name="adapter"),
            LoRANotFoundError,
            "lora_request: adapter 'adapter' is not loaded",
        ),
        (request("huge", [5] * 60, max_tokens=3), RequestTooLargeError, "more than the whole cache holds"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message):
            engine.add_request(bad)
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            assert output.request_id == "good"
            tokens.extend(output.new_token_ids)
    assert len(tokens) == 19  # one came in the first step
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 3
    # And a fresh request is served normally afterwards.
    results, _ = run_engine(engine, [[5, 6, 7]], 8)
    assert len(results[0].token_ids) == 8


def test_abort_frees_blocks_and_is_idempotent(checkpoint):
    engine = make_engine(checkpoint("llama"), num_kv_blocks=33)
    for i in range(3):
        engine.add_request(request(str(i), list(range(10, 60)), max_tokens=30))
    engine.step()
    assert engine.scheduler.kv_cache_manager.num_free_blocks < 32
    engine.abort_requests(["1", "missing"])
    engine.abort_requests(["1"])
    outputs = engine.step()
    assert "1" in outputs.finished_requests and all(o.request_id != "1" for o in outputs.outputs)
    engine.abort_requests(["0", "2"])
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 32
    assert engine.reset_prefix_cache() is True


def test_generation_config_eos_ids_all_stop(checkpoint, tmp_path):
    """With eos_token_id unset, the first generation-config EOS id is the EOS and the others stop too, with
    stop_reason = the id (vLLM's update_from_generation_config); the caller's params are not mutated."""
    src = checkpoint("llama")
    dst = tmp_path / "eos"
    shutil.copytree(src, dst)
    free_run, _ = run_engine(make_engine(src), [[5, 6, 7]], 8)
    second_token = free_run[0].token_ids[1]
    generation_config = json.loads((dst / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [generation_config["eos_token_id"], second_token]
    (dst / "generation_config.json").write_text(json.dumps(generation_config))
    engine = make_engine(dst)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request(Request("r", [5, 6, 7], params))
    outputs = [o for _ in range(8) for o in engine.step().outputs]
    assert [t for o in outputs for t in o.new_token_ids] == free_run[0].token_ids[:2]
    assert outputs[-1].stop_reason == second_token and str(outputs[-1].finish_reason) == "stop"
    assert params.eos_token_id is None and params.stop_token_ids == []


def test_prompt_plus_max_tokens_over_max_model_len_is_refused_not_cut(checkpoint):
    """A client of the core (not only our frontend) asking for more than max_model_len holds gets
    INVALID_ARGUMENT naming max_tokens, as vLLM's servers answer 400; before, 8 prompt ids with max_tokens 61
    in max_model_len 64 returned 56 tokens with finish reason "length"."""
    engine = make_engine(checkpoint("llama"), max_model_len=64, num_kv_blocks=9)
    prompt = list(range(10, 18))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request("over", prompt, max_tokens=61, ignore_eos=True))
    message = str(info.value)
    assert message.startswith("max_tokens: 61 is too large")
    assert "maximum context length is 64 tokens, and 69 were requested (8 in the prompt, 61 in the completion)" in (
        message
    )
    assert not engine.has_unfinished_requests()
    results, _ = run_engine(engine, [prompt], 56)  # 8 + 56 = 64: fits exactly
    assert len(results[0].token_ids) == 56 and results[0].finish_reason == "length"
