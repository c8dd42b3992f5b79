"""Bad checkpoints fail at load with a message naming the problem; bad requests fail alone and the engine
keeps serving the others."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

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
    with pytest.raises(ModelLoadError) as missing:
        make_engine(tmp_path / "does-not-exist")
    assert str(missing.value) == f"no such folder: {tmp_path / 'does-not-exist'}"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError) as empty:
        make_engine(tmp_path / "empty")
    assert str(empty.value) == f"{tmp_path / 'empty'} is not a model folder: no config.json"


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
        (request("empty", []), InvalidRequestError, "prompt_token_ids: cannot be empty"),
        (request("long", [5] * 64), InvalidRequestError, "64 tokens, which leaves no room .* max_model_len=64"),
        (
            request("oov", [5, vocab, 6]),
            InvalidRequestError,
            rf"prompt_token_ids\[1\]: token id {vocab} is out of vocabulary",
        ),
        (request("neg", [-1]), InvalidRequestError, r"prompt_token_ids\[0\]: token id -1 is out of vocabulary"),
        (request("temp", [5], temperature=-1.0), InvalidRequestError, r"temperature: must be a finite number in \[0"),
        (request("topp", [5], top_p=0.0), InvalidRequestError, "top_p: must be in"),
        (request("stop", [5], stop_token_ids=[vocab + 3]), InvalidRequestError, r"stop_token_ids\[0\]"),
        (
            request("lp", [5], logprobs=21),
            InvalidRequestError,
            r"logprobs: asked for 21; the engine core allows at most 20",
        ),
        (request("lpall", [5], prompt_logprobs=-1), InvalidRequestError, r"prompt_logprobs: asked for the whole vocab"),
        (request("allowed", [5], allowed_token_ids=[]), InvalidRequestError, "allowed_token_ids: must not be empty"),
        (request("good", [5]), InvalidRequestError, "already in use"),
        (
            Request("prio", [5], SamplingParams(max_tokens=2), priority=3),
            InvalidRequestError,
            "priority: got 3 but Priority scheduling is not enabled",
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
    # ignore_eos: that id stops nothing, but min_tokens still masks it (vLLM's all_stop_token_ids hold every
    # generation-config EOS id): allowed only it and another, greedy with a bias towards it, the first two
    # tokens are the other one.
    other = free_run[0].token_ids[0] if free_run[0].token_ids[0] != second_token else 9
    masked = SamplingParams(
        temperature=0.0,
        max_tokens=4,
        ignore_eos=True,
        min_tokens=2,
        allowed_token_ids=[second_token, other],
        logit_bias={second_token: 50.0},
    )
    engine.add_request(Request("m", [5, 6, 7], masked))
    tokens = [t for _ in range(6) for o in engine.step().outputs for t in o.new_token_ids]
    assert tokens == [other, other, second_token, second_token]


# --- a step whose model runner raises -------------------------------------------------------------------------

GREEDY = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}


def inject_fault(monkeypatch, engine, where: str, mode: str = "poison") -> None:
    """Make the forward (``where="forward"``) or the sampling (``"sampler"``: the runner's ``_sample``, the
    sampler or, for plain greedy rows, the argmax) raise for batches with a poison request (a prompt starting
    with POISON_TOKEN_ID), or for every batch (``mode="broken"``)."""
    from core_svc.model_runner import ModelRunner
    from core_svc.models.llama import LlamaForCausalLM
    from tests.faulty_core import FAULT_MESSAGE, POISON_TOKEN_ID, faulty_forward

    if where == "forward":
        monkeypatch.setattr(LlamaForCausalLM, "forward", faulty_forward(mode, LlamaForCausalLM.forward))
        return
    sample = ModelRunner._sample

    def faulty_sample(self, *args, **kwargs):
        states = engine.model_runner.requests.values()
        if mode == "broken" or any(s.prompt_token_ids[0] == POISON_TOKEN_ID and not s.output_token_ids for s in states):
            raise RuntimeError(FAULT_MESSAGE)
        return sample(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "_sample", faulty_sample)


def generate_alone(engine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one request run alone to its end, and its num_cached_tokens."""
    engine.add_request(request(request_id, prompt, **GREEDY))
    tokens, num_cached = [], -1
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens += output.new_token_ids
            num_cached = output.num_cached_tokens
    return tokens, num_cached


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failed_step_fails_its_requests_alone_and_the_core_goes_on(checkpoint, monkeypatch, where):
    from core_svc.errors import EngineStepError
    from splitserve.base.grpc_status import grpc_status_code as status_code
    from tests.faulty_core import POISON_TOKEN_ID

    a_prompt = list(range(20, 51))  # 31 tokens: block 0 full after its prefill, block 1 full with its first output
    p_prompt = [POISON_TOKEN_ID, *range(60, 99)]  # 40 tokens: blocks 0-1 full (cached at allocation)
    c_prompt = list(range(100, 120))
    reference = make_engine(checkpoint("llama"), num_kv_blocks=33)
    generate_alone(reference, "a0", a_prompt)
    a_again, a_cached = generate_alone(reference, "a1", a_prompt)  # as it runs later here: block 0 is a hit
    c_alone, _ = generate_alone(reference, "c", c_prompt)
    assert a_cached == 16

    engine = make_engine(checkpoint("llama"), num_kv_blocks=33, max_num_seqs=2)
    kv = engine.scheduler.kv_cache_manager
    inject_fault(monkeypatch, engine, where)
    engine.add_request(request("a", a_prompt, **GREEDY))
    (first,) = engine.step().outputs  # a's prefill: fine
    engine.add_request(request("p", p_prompt, **GREEDY))
    engine.add_request(request("c", c_prompt, **GREEDY))  # waits: max_num_seqs=2
    failed = engine.step()  # a's decode (filling its block 1) and p's prefill, in one batch that raises
    assert {o.request_id for o in failed.outputs} == {"a", "p"} == failed.finished_requests
    for output in failed.outputs:
        assert str(output.finish_reason) == "error" and output.new_token_ids == []
        assert isinstance(output.error, EngineStepError) and status_code(output.error).name == "INTERNAL"
        assert str(output.error) == "the engine core failed while running this request: injected fault"
    assert engine.dead_error is None and engine.num_consecutive_failed_steps == 1
    # Every block back; the runner forgot both; the cache keeps only what a finished forward wrote: a's block 0.
    assert kv.num_free_blocks == 32
    assert set(engine.model_runner.requests) == set()
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    a_tokens = a_prompt + first.new_token_ids + [0]  # positions 0-31 (block 1 holds a's first output) and one more
    assert kv.get_computed_blocks(request("probe-a", a_tokens))[1] == 16  # not 32: block 1 was never written
    assert kv.get_computed_blocks(request("probe-p", [*p_prompt, 0]))[1] == 0  # not 32

    # c, which waited, runs as if nothing had happened; a later request is served, with a's block 0 as a hit.
    c_tokens = []
    while engine.has_unfinished_requests():
        c_tokens += [t for o in engine.step().outputs for t in o.new_token_ids]
    assert c_tokens == c_alone and engine.num_consecutive_failed_steps == 0
    assert generate_alone(engine, "later", a_prompt) == (a_again, 16)
    assert kv.num_free_blocks == 32


def test_failed_steps_in_a_row_declare_the_core_dead(checkpoint, monkeypatch):
    """A success between failures starts the count again; max_consecutive_failed_steps in a row end it: the
    step's own requests get INTERNAL, every other one UNAVAILABLE, and the core refuses from then on."""
    from core_svc.errors import EngineUnavailableError
    from splitserve.base.grpc_status import grpc_status_code as status_code
    from tests.faulty_core import POISON_TOKEN_ID

    engine = make_engine(checkpoint("llama"), num_kv_blocks=33, max_num_seqs=1, max_consecutive_failed_steps=2)
    inject_fault(monkeypatch, engine, "forward")
    engine.add_request(request("p1", [POISON_TOKEN_ID, 5, 6], **GREEDY))
    engine.add_request(request("ok", [5, 6, 7], **{**GREEDY, "max_tokens": 2}))
    engine.add_request(request("p2", [POISON_TOKEN_ID, 8, 9], **GREEDY))
    engine.add_request(request("ok2", [5, 6, 7], **{**GREEDY, "max_tokens": 1}))
    codes = []
    while engine.has_unfinished_requests():  # one request per step (max_num_seqs=1): p1, ok, ok, p2, ok2
        outputs = engine.step()
        codes += [(o.request_id, status_code(o.error).name) for o in outputs.outputs if o.error is not None]
    assert codes == [("p1", "INTERNAL"), ("p2", "INTERNAL")] and engine.dead_error is None
    assert engine.num_consecutive_failed_steps == 0

    inject_fault(monkeypatch, engine, "forward", mode="broken")
    for request_id in ("r1", "r2", "r3"):
        engine.add_request(request(request_id, [5, 6, 7], **GREEDY))
    first, second = engine.step(), engine.step()
    assert [(o.request_id, status_code(o.error).name) for o in first.outputs] == [("r1", "INTERNAL")]
    assert [(o.request_id, status_code(o.error).name) for o in second.outputs] == [
        ("r2", "INTERNAL"),
        ("r3", "UNAVAILABLE"),
    ]
    assert str(engine.dead_error) == ("the engine core is dead: 2 steps in a row failed (the last: injected fault)")
    assert not engine.has_unfinished_requests() and not engine.model_runner.requests
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 32
    with pytest.raises(EngineUnavailableError, match="the engine core is dead"):
        engine.add_request(request("late", [5, 6, 7]))
    with pytest.raises(EngineUnavailableError):
        engine.step()


def test_server_faults_map_to_internal_and_only_a_stopped_core_to_unavailable():
    """A router replays UNAVAILABLE on another core: only a core that cannot serve may answer it."""
    from core_svc.errors import EngineStepError, EngineUnavailableError, ProfileStateError
    from frontend_svc.errors import EngineDeadError, InternalError, error_from_core
    from splitserve.base.grpc_status import grpc_status_code as status_code

    assert status_code(RuntimeError("CUDA error: an illegal memory access was encountered")).name == "INTERNAL"
    assert status_code(EngineStepError("x")).name == "INTERNAL"
    assert status_code(EngineUnavailableError("the engine loop has stopped")).name == "UNAVAILABLE"
    assert status_code(ProfileStateError("a profile is already running")).name == "FAILED_PRECONDITION"
    internal = error_from_core(13, "the engine core failed while running this request: boom")
    assert isinstance(internal, InternalError) and status_code(internal).name == "INTERNAL"
    assert str(internal) == "the engine core failed while running this request: boom"
    unavailable = error_from_core(14, "the engine core is dead")
    assert isinstance(unavailable, EngineDeadError) and status_code(unavailable).name == "UNAVAILABLE"


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
    # Worded as the frontend words it (splitserve/base/request_rules.py), without the frontend's Python-API hint.
    assert message == (
        "max_tokens: 61 is too large: this model's maximum context length is 64 tokens, and 69 were requested (8 in "
        "the prompt, 61 in the completion); at most 56 fit after this prompt"
    )
    assert not engine.has_unfinished_requests()
    results, _ = run_engine(engine, [prompt], 56)  # 8 + 56 = 64: fits exactly
    assert len(results[0].token_ids) == 56 and results[0].finish_reason == "length"


def fail_forward_number(monkeypatch, number: int) -> None:
    """Make the ``number``-th forward from now (1-based) raise, and only that one."""
    from core_svc.models.llama import LlamaForCausalLM
    from tests.faulty_core import FAULT_MESSAGE

    forward = LlamaForCausalLM.forward
    calls = [0]

    def patched(self, *args):
        calls[0] += 1
        if calls[0] == number:
            raise RuntimeError(FAULT_MESSAGE)
        return forward(self, *args)

    monkeypatch.setattr(LlamaForCausalLM, "forward", patched)


def run_to_end(engine, requests: list[Request]) -> tuple[dict[str, list[int]], dict[str, str], dict[str, object]]:
    """Add ``requests``, step until done: (tokens, error messages, prompt logprobs) by request id."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors: dict[str, str] = {}
    prompt_logprobs: dict[str, object] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.error is not None:
                errors[output.request_id] = str(output.error)
            if output.new_prompt_logprobs is not None:
                prompt_logprobs[output.request_id] = output.new_prompt_logprobs
    return tokens, errors, prompt_logprobs


def test_a_fault_in_a_chunked_prefill_keeps_only_the_chunks_written_before(checkpoint, monkeypatch):
    """A 100-token prompt with prompt logprobs, max_num_batched_tokens 32, block_size 16, by hand: forward 1
    computes tokens 0-31 (blocks 0-1, cached at allocation), forward 2 tokens 32-63 (blocks 2-3) and raises. The
    request fails; blocks 0-1, which forward 1 wrote, stay cached (a probe finds 32 tokens), blocks 2-3 do not.
    The same request run again gets the tokens and prompt logprobs of a run without the fault (the runner kept
    nothing of the failed one's prompt-logprob chunks)."""
    prompt = list(range(200, 300))

    def make(name: str) -> Request:
        return request(name, prompt, **{**GREEDY, "max_tokens": 4, "prompt_logprobs": 2})

    reference = make_engine(checkpoint("llama"), num_kv_blocks=40, max_num_batched_tokens=32)
    ref_tokens, _, ref_prompt_logprobs = run_to_end(reference, [make("L")])

    engine = make_engine(checkpoint("llama"), num_kv_blocks=40, max_num_batched_tokens=32)
    kv = engine.scheduler.kv_cache_manager
    fail_forward_number(monkeypatch, 2)
    tokens, errors, _ = run_to_end(engine, [make("L")])
    assert tokens == {"L": []} and errors == {"L": "the engine core failed while running this request: injected fault"}
    assert kv.num_free_blocks == 39 and not engine.model_runner.requests
    assert kv.get_computed_blocks(request("probe", [*prompt, 0]))[1] == 32
    again_tokens, again_errors, again_prompt_logprobs = run_to_end(engine, [make("L2")])
    assert again_errors == {} and again_tokens["L2"] == ref_tokens["L"] and len(ref_tokens["L"]) == 4
    assert again_prompt_logprobs["L2"] == ref_prompt_logprobs["L"]


def test_a_request_preempted_in_the_failed_step_goes_on(checkpoint, monkeypatch):
    """7 KV blocks (6 usable), three 20-token prompts, max_tokens 20, by hand: step 1 prefills all three (2
    blocks each: every block taken); step k >= 2 decodes position 18 + k, so step 14 (position 32) needs a third
    block for each: "0" finds none and preempts "2" (the last running), then "0" and "1" take its two blocks.
    That step's forward raises: "0" and "1" fail, "2", preempted, is not in it. "2" then runs alone to its 20
    tokens, the same as in a run without the fault, and every block comes back."""

    def requests() -> list[Request]:
        return [
            request(str(i), list(range(30 + 40 * i, 50 + 40 * i)), **{**GREEDY, "max_tokens": 20}) for i in range(3)
        ]

    reference = make_engine(checkpoint("llama"), num_kv_blocks=7)
    ref_tokens, _, _ = run_to_end(reference, requests())
    engine = make_engine(checkpoint("llama"), num_kv_blocks=7)
    fail_forward_number(monkeypatch, 14)
    preempted_at = []
    original_preempt = engine.scheduler._preempt

    def preempt(victim: Request) -> None:
        preempted_at.append((victim.request_id, victim.num_output_tokens))
        original_preempt(victim)

    monkeypatch.setattr(engine.scheduler, "_preempt", preempt)
    tokens, errors, _ = run_to_end(engine, requests())
    assert preempted_at[0] == ("2", 13)  # at step 14: 13 outputs (one per step 1-13)
    assert sorted(errors) == ["0", "1"] and all(len(tokens[i]) == 13 for i in "01")
    assert tokens["2"] == ref_tokens["2"] and len(tokens["2"]) == 20
    assert engine.scheduler.kv_cache_manager.num_free_blocks == 6


def test_a_fault_is_described_by_its_message_not_its_class():
    """Statuses carry the fault's message; its Python class stays in the log, with the traceback."""
    from core_svc.errors import fault_message

    assert fault_message(RuntimeError("CUDA error: an illegal memory access")) == "CUDA error: an illegal memory access"
    assert fault_message(AssertionError()) == "an error without a message; the core's log has its traceback"


# --- the device -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only build of torch")
def test_device_cuda_with_a_cpu_build_of_torch_fails_first(tmp_path):
    """Before anything slow: the model is not even looked for (a missing one would raise ModelLoadError)."""
    from core_svc.errors import DeviceUnavailableError

    with pytest.raises(DeviceUnavailableError) as info:
        make_engine(tmp_path / "not-looked-for", device="cuda")
    assert str(info.value) == (
        f"--device cuda: this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None); install "
        'torch\'s CUDA build for your driver (README.md, "Running on a GPU"), e.g. pip install torch --index-url '
        "https://download.pytorch.org/whl/cu128"
    )


def test_device_cuda_with_no_gpu_visible_says_where_to_look(tmp_path, monkeypatch):
    """A CUDA build that sees no GPU; which torch is installed and whether a GPU is visible can only be mocked."""
    from core_svc.errors import DeviceUnavailableError

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceUnavailableError) as info:
        make_engine(tmp_path / "not-looked-for", device="cuda")
    message = str(info.value)
    assert message.startswith(
        f"--device cuda: torch {torch.__version__} is built for CUDA 12.8 but sees no GPU (CUDA_VISIBLE_DEVICES is "
        "''). Check that nvidia-smi lists a GPU"
    )
    assert "docker run --gpus all" in message and "nvidia.com/gpu" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_splitserve_core_on_cuda_without_cuda_is_a_one_line_error(checkpoint):
    """The real command, on this machine: exit 2, one line on stderr, no traceback, nothing started."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "splitserve.entrypoints.cli", "core", str(checkpoint("llama")), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    reason = "a CPU-only build" if torch.version.cuda is None else "sees no GPU"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: ") and reason in lines[0], result.stderr
    assert result.stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"]])
def test_serve_and_generate_on_cuda_without_cuda_fail_before_the_model(tmp_path, capsys, command):
    """The in-process core's commands check the device before looking for the model (which does not exist)."""
    from splitserve.entrypoints.cli import main

    assert main([*command, "--model", str(tmp_path / "missing"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: ") and err.count("\n") == 1 and "missing" not in err


# --- running out of device memory in a step --------------------------------------------------------------------


def out_of_memory_for_poisoned_batches(monkeypatch) -> None:
    """Every forward whose batch holds a request whose prompt starts with POISON_TOKEN_ID raises
    ``torch.OutOfMemoryError``, as the CUDA caching allocator does."""
    from core_svc.models.llama import LlamaForCausalLM
    from tests.faulty_core import POISON_TOKEN_ID

    forward = LlamaForCausalLM.forward

    def patched(self, input_ids, positions, *args):
        if bool((input_ids[positions == 0] == POISON_TOKEN_ID).any()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return forward(self, input_ids, positions, *args)

    monkeypatch.setattr(LlamaForCausalLM, "forward", patched)


def test_out_of_memory_fails_only_its_step_with_resource_exhausted_and_never_kills_the_core(checkpoint, monkeypatch):
    """A step that runs out of memory ends its own requests with RESOURCE_EXHAUSTED naming the settings to lower;
    their blocks come back; a request waiting meanwhile and later ones run as without the fault; and more such
    steps in a row than max_consecutive_failed_steps leave the core alive."""
    from splitserve.base.grpc_status import grpc_status_code as status_code
    from tests.faulty_core import POISON_TOKEN_ID

    a_prompt, c_prompt = list(range(20, 51)), list(range(100, 120))
    p_prompt = [POISON_TOKEN_ID, *range(60, 99)]  # 40 tokens
    reference = make_engine(checkpoint("llama"), num_kv_blocks=33)
    c_alone, _ = generate_alone(reference, "c", c_prompt)
    later_alone, _ = generate_alone(reference, "later", list(range(200, 230)))

    engine = make_engine(checkpoint("llama"), num_kv_blocks=33, max_num_seqs=2, max_consecutive_failed_steps=2)
    kv = engine.scheduler.kv_cache_manager
    out_of_memory_for_poisoned_batches(monkeypatch)
    engine.add_request(request("a", a_prompt, **GREEDY))
    engine.step()  # a's prefill
    engine.add_request(request("p", p_prompt, **GREEDY))
    engine.add_request(request("c", c_prompt, **GREEDY))  # waits: max_num_seqs=2
    failed = engine.step()  # a's decode (1 token) and p's prefill (40) in one batch, out of memory
    assert {o.request_id for o in failed.outputs} == {"a", "p"} == failed.finished_requests
    for output in failed.outputs:
        assert str(output.finish_reason) == "error" and output.new_token_ids == []
        assert status_code(output.error).name == "RESOURCE_EXHAUSTED"
        assert str(output.error) == (
            "the engine core ran out of device memory running a step of 2 request(s) and 41 tokens with this one; "
            "to avoid it, lower --max-num-batched-tokens (now 2048), --max-num-seqs (now 2) or "
            "--gpu-memory-utilization (now 0.9) of the core"
        )
    assert engine.dead_error is None and engine.num_consecutive_failed_steps == 0
    assert kv.num_free_blocks == 32 and not engine.model_runner.requests

    c_tokens = []
    while engine.has_unfinished_requests():
        c_tokens += [t for o in engine.step().outputs for t in o.new_token_ids]
    assert c_tokens == c_alone

    # Three such steps in a row ((p0, p1), (p2, p3), p4: max_num_seqs=2), where two failed steps of another kind
    # would end the core.
    for i in range(5):
        engine.add_request(request(f"p{i}", [POISON_TOKEN_ID, 5 + i, 6], **GREEDY))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(sorted((o.request_id, status_code(o.error).name) for o in engine.step().outputs))
    assert steps == [
        [("p0", "RESOURCE_EXHAUSTED"), ("p1", "RESOURCE_EXHAUSTED")],
        [("p2", "RESOURCE_EXHAUSTED"), ("p3", "RESOURCE_EXHAUSTED")],
        [("p4", "RESOURCE_EXHAUSTED")],
    ]
    assert engine.dead_error is None and engine.num_consecutive_failed_steps == 0 and kv.num_free_blocks == 32
    assert generate_alone(engine, "later", list(range(200, 230)))[0] == later_alone


def test_out_of_memory_empties_the_allocators_cache_on_cuda_only(monkeypatch):
    """torch.cuda.empty_cache can only be observed, on a machine without CUDA, by replacing it."""
    from core_svc.device import release_cached_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    release_cached_memory(torch.device("cpu"))
    assert calls == []
    release_cached_memory(torch.device("cuda"))
    assert calls == ["empty_cache"]
