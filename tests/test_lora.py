"""LoRA adapters in the engine core against transformers + peft on the same seeded checkpoint, float32: each
adapter's greedy ids and logprobs, a batch mixing adapters and the base model, prefix-cache isolation between
adapters (also one name loaded again with other weights), removal while requests run, the refusals, more adapters
in flight than device slots, the Python API, and the core's gRPC AddLora / ListLoras / RemoveLora."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import grpc
import pytest
import torch

from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.errors import InvalidRequestError, LoRADisabledError, LoRAExistsError, LoRANotFoundError
from core_svc.lora.adapter import LoRARequest, load_lora_model, max_weights_bytes
from core_svc.models.arch import ModelArchConfig
from core_svc.request import Request
from core_svc.sampling_params import SamplingParams
from tests.factories import make_request, make_scheduler
from tests.helpers import TOP_K, hf_model

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
MAX_LORAS = 3
MAX_LORA_RANK = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, rsLoRA, seed): ranks up to the maximum, each module kind, both scalings
ADAPTERS = {
    "all": (8, 16, ATTENTION + MLP, False, 1),
    "attn": (4, 8, ATTENTION, False, 2),
    "mlp": (2, 4, MLP, True, 3),
    "qv": (3, 6, ["q_proj", "v_proj"], False, 4),
}


def make_adapter(
    model: torch.nn.Module, out: Path, rank: int, alpha: float, targets: list[str], rslora: bool, seed: int
):
    """A PEFT adapter of random A and B (``init_lora_weights=False``: B is not zero, so outputs change), saved to
    ``out``; returns the PeftModel (the reference)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0
    )
    peft_model = peft.get_peft_model(copy.deepcopy(model), config).eval()
    with torch.no_grad():  # large enough to change greedy choices on random weights
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    peft_model.save_pretrained(out)
    return peft_model


def greedy_reference(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float().log_softmax(-1) for step in out.logits]


@pytest.fixture(scope="module")
def model_path(checkpoint) -> Path:
    return checkpoint("llama")


def random_prompt(model_path: Path, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, hf_model(model_path).config.vocab_size, (length,), generator=generator).tolist()


@pytest.fixture(scope="module")
def prompt(model_path) -> list[int]:
    """The prompt every output is compared on: 21 tokens, a full block and a partial one."""
    return random_prompt(model_path, 21, seed=0)


@pytest.fixture(scope="module")
def adapters(model_path, prompt, tmp_path_factory) -> dict[str, tuple[Path, list[int], list[torch.Tensor]]]:
    """name -> (folder, greedy ids, logprobs per step) on ``prompt`` from transformers + peft; "base": none."""
    base = hf_model(model_path)
    root = tmp_path_factory.mktemp("lora-adapters")
    result = {}
    for name, (rank, alpha, targets, rslora, seed) in ADAPTERS.items():
        peft_model = make_adapter(base, root / name, rank, alpha, targets, rslora, seed)
        result[name] = (root / name, *greedy_reference(peft_model, prompt))
    result["base"] = (root, *greedy_reference(base, prompt))
    return result


@pytest.fixture(scope="module")
def engine(model_path, adapters) -> EngineCore:
    config = CoreConfig(
        model=str(model_path),
        enable_lora=True,
        max_loras=MAX_LORAS,
        max_lora_rank=MAX_LORA_RANK,
        max_cpu_loras=8,
        num_kv_blocks=256,
        lora_modules=(f"all={adapters['all'][0]}",),
    )
    return EngineCore(config)


def run(engine: EngineCore, jobs: list[tuple[list[int], str | None]], check=None) -> list[tuple[list[int], list, int]]:
    """Greedy-generate MAX_TOKENS for each (prompt, adapter name) at once; returns per job (ids, logprobs per
    step {id: logprob}, num_cached_tokens). ``check(engine)`` runs after each step."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP_K)
    prefix = f"run{id(jobs)}-"
    for i, (prompt, name) in enumerate(jobs):
        engine.add_request(Request(f"{prefix}{i}", list(prompt), params, lora_name=name))
    results: list[tuple[list[int], list, int]] = [([], [], 0) for _ in jobs]
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if check is not None:
            check(engine)
        for output in outputs.outputs:
            assert output.error is None, output.error
            ids, logprobs, _ = results[int(output.request_id.removeprefix(prefix))]
            ids.extend(output.new_token_ids)
            if output.new_logprobs is not None:
                for top_ids, values in zip(
                    output.new_logprobs.logprob_token_ids, output.new_logprobs.logprobs, strict=True
                ):
                    logprobs.append(dict(zip(top_ids, values, strict=True)))
            results[int(output.request_id.removeprefix(prefix))] = (ids, logprobs, output.num_cached_tokens)
    return results


def ensure(engine: EngineCore, adapters, name: str) -> None:
    engine.add_lora(LoRARequest(name, 0, str(adapters[name][0])))


def test_each_adapter_alone_matches_transformers_peft(engine, adapters, prompt):
    for name in ADAPTERS:
        ensure(engine, adapters, name)
        _, want, want_logprobs = adapters[name]
        [(ids, logprobs, _)] = run(engine, [(prompt, name)])
        assert ids == want, name
        for step, (token, ours) in enumerate(zip(ids, logprobs, strict=True)):
            assert ours[token] == pytest.approx(want_logprobs[step][token].item(), abs=1e-3), (name, step)
    # The adapters do change the outputs (else the comparison proves nothing).
    assert all(adapters[name][1] != adapters["base"][1] for name in ADAPTERS)


def test_qwen3_adapter_matches_transformers_peft(checkpoint, tmp_path):
    """Qwen3 (explicit head_dim, per-head q/k norm): an adapter on every projection, against peft, with the base
    model's request in the same batches, the prompts prefilled in chunks of 8 tokens (steps that mix one request's
    chunk with the other's decode)."""
    path = checkpoint("qwen3")
    base = hf_model(path)
    peft_model = make_adapter(base, tmp_path / "qwen3", 4, 8, ATTENTION + MLP, False, 6)
    prompt = random_prompt(path, 19, seed=3)
    want, _ = greedy_reference(peft_model, prompt)
    want_base, _ = greedy_reference(base, prompt)
    core = EngineCore(
        CoreConfig(model=str(path), enable_lora=True, max_lora_rank=4, num_kv_blocks=16, max_num_batched_tokens=8)
    )
    core.add_lora(LoRARequest("q3", 0, str(tmp_path / "qwen3")))
    assert [ids for ids, _, _ in run(core, [(prompt, "q3"), (prompt, None)])] == [want, want_base]
    assert want != want_base


def test_mixed_batch_gives_each_request_its_solo_output(engine, adapters, prompt):
    for name in ADAPTERS:
        ensure(engine, adapters, name)
    names = ["all", None, "attn", "mlp"]  # three adapters and the base model, one forward
    running: list[int] = []
    results = run(engine, [(prompt, name) for name in names], check=lambda e: running.append(len(e.scheduler.running)))
    assert running[0] == len(names)  # all of them in the first step
    assert [ids for ids, _, _ in results] == [adapters[name or "base"][1] for name in names]


def test_more_adapters_than_slots_all_finish_with_their_own_outputs(engine, adapters, prompt):
    for name in ADAPTERS:
        ensure(engine, adapters, name)
    names = ["qv", "all", "attn", "mlp", None, "qv"]
    most: list[int] = []
    results = run(
        engine,
        [(prompt, name) for name in names],
        check=lambda e: most.append(len({r.lora_int_id for r in e.scheduler.running} - {0})),
    )
    assert max(most) == MAX_LORAS  # never more adapters at once than --max-loras
    assert [ids for ids, _, _ in results] == [adapters[name or "base"][1] for name in names]


def test_prefix_cache_is_per_adapter(engine, adapters, model_path):
    for name in ("attn", "mlp"):
        ensure(engine, adapters, name)
    long_prompt = random_prompt(model_path, 40, seed=7)  # two full blocks of 16, not seen by other tests
    cached = [run(engine, [(long_prompt, name)])[0][2] for name in ("attn", "mlp", "attn", None, "mlp")]
    assert cached == [0, 0, 32, 0, 32]


def test_same_name_loaded_again_with_other_weights_gets_no_cache_hit(engine, adapters, prompt):
    engine.add_lora(LoRARequest("swap", 0, str(adapters["attn"][0])))
    [(first, _, _)] = run(engine, [(prompt, "swap")])
    engine.remove_lora("swap")
    engine.add_lora(LoRARequest("swap", 0, str(adapters["mlp"][0])))
    [(second, _, cached)] = run(engine, [(prompt, "swap")])
    assert cached == 0  # the same name and tokens, other weights: its KV is not the first one's
    assert (first, second) == (adapters["attn"][1], adapters["mlp"][1])


def test_remove_while_running_finishes_them_and_refuses_later_ones(engine, adapters, prompt):
    loaded = engine.add_lora(LoRARequest("gone", 0, str(adapters["mlp"][0])))
    assert loaded.lora_int_id >= 1 and loaded in engine.list_loras()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("gone-1", list(prompt), params, lora_name="gone"))
    outputs = engine.step()
    ids = [t for o in outputs.outputs for t in o.new_token_ids]
    engine.remove_lora("gone")
    assert all(r.lora_name != "gone" for r in engine.list_loras())
    with pytest.raises(LoRANotFoundError, match="gone"):
        engine.add_request(Request("gone-2", list(prompt), params, lora_name="gone"))
    while engine.has_unfinished_requests():
        ids += [t for o in engine.step().outputs for t in o.new_token_ids]
    assert ids == adapters["mlp"][1]
    assert loaded.lora_int_id not in engine.lora_manager.held  # dropped once its last request finished
    with pytest.raises(LoRANotFoundError):
        engine.remove_lora("gone")


def test_refusals(engine, adapters, model_path, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(LoRANotFoundError, match="nope"):
        engine.add_request(Request("unknown", [1, 2, 3], params, lora_name="nope"))
    ensure(engine, adapters, "attn")
    with pytest.raises(LoRAExistsError, match="already loaded"):
        engine.add_lora(LoRARequest("attn", 0, str(adapters["mlp"][0])))
    assert engine.add_lora(LoRARequest("attn", 0, str(adapters["attn"][0]))).lora_name == "attn"  # idempotent
    again = engine.add_lora(LoRARequest("attn", 0, f"{adapters['attn'][0]}/"))  # the same folder, written otherwise
    assert again == engine.add_lora(LoRARequest("attn", 0, str(adapters["attn"][0])))
    base = hf_model(model_path)
    make_adapter(base, tmp_path / "r16", 16, 16, ATTENTION, False, 5)
    with pytest.raises(InvalidRequestError, match="rank r=16 is above .*--max-lora-rank 8") as info:
        engine.add_lora(LoRARequest("r16", 0, str(tmp_path / "r16")))
    assert info.value.field == "lora_request.lora_path"
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((adapters["attn"][0] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(InvalidRequestError, match="not a readable safetensors file"):
        engine.add_lora(LoRARequest("corrupt", 0, str(corrupt)))
    with pytest.raises(InvalidRequestError, match="is not a folder"):
        engine.add_lora(LoRARequest("missing", 0, str(tmp_path / "missing")))
    assert {r.lora_name for r in engine.list_loras()}.isdisjoint({"r16", "corrupt", "missing"})


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "trains biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "not LoRA"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens"),
        ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication"),
        ({"use_qalora": True}, "use_qalora"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"a_future_peft_feature": {"on": True}}, "a_future_peft_feature"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_reason(model_path, adapters, tmp_path, change, reason):
    folder = tmp_path / "adapter"
    folder.mkdir()
    config = json.loads((adapters["attn"][0] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (folder / "adapter_model.safetensors").write_bytes((adapters["attn"][0] / "adapter_model.safetensors").read_bytes())
    arch = ModelArchConfig.from_hf_config(hf_model(model_path).config)
    with pytest.raises(InvalidRequestError, match=reason):
        load_lora_model(LoRARequest("x", 0, str(folder)), arch, MAX_LORA_RANK)


@pytest.mark.parametrize(
    "change",
    [
        # Modules the weights do not hold (another architecture's name; one left out): vLLM judges by the weights.
        {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "query_key_value"]},
        {"exclude_modules": ["gate_proj"]},
        # Initializations that choose A and B only (the base weights unchanged), in any case, as vLLM's.
        {"init_lora_weights": "orthogonal"},
        {"init_lora_weights": "EVA", "eva_config": {"rho": 2.0}},
    ],
)
def test_configs_of_plain_loras_vllm_serves_are_served_with_the_same_weights(model_path, adapters, tmp_path, change):
    folder = tmp_path / "adapter"
    folder.mkdir()
    source = adapters["attn"][0]
    config = json.loads((source / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
    (folder / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    arch = ModelArchConfig.from_hf_config(hf_model(model_path).config)
    served = load_lora_model(LoRARequest("x", 0, str(folder)), arch, MAX_LORA_RANK)
    plain = load_lora_model(LoRARequest("y", 0, str(source)), arch, MAX_LORA_RANK)
    assert served.scaling == plain.scaling and served.weights.keys() == plain.weights.keys()
    for key, slices in plain.weights.items():
        for mine, theirs in zip(served.weights[key], slices, strict=True):
            assert (mine is None) == (theirs is None)
            if theirs is not None:
                assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_files_are_checked_before_they_are_read(model_path, adapters, tmp_path):
    """A weights file larger than any adapter at --max-lora-rank is refused from its size; a missing folder and a
    folder without a config get the same answer."""
    arch = ModelArchConfig.from_hf_config(hf_model(model_path).config)
    folder = tmp_path / "huge"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes((adapters["attn"][0] / "adapter_config.json").read_bytes())
    with (folder / "adapter_model.safetensors").open("wb") as f:
        f.truncate(max_weights_bytes(arch, MAX_LORA_RANK) + 1)  # sparse: nothing written
    with pytest.raises(InvalidRequestError, match="adapter_model.safetensors is larger than any adapter"):
        load_lora_model(LoRARequest("x", 0, str(folder)), arch, MAX_LORA_RANK)
    real = (adapters["all"][0] / "adapter_model.safetensors").stat().st_size  # rank 8, every module, float32
    assert real < max_weights_bytes(arch, MAX_LORA_RANK)  # the largest servable one passes
    messages = []
    for path in (tmp_path / "no-such-folder", tmp_path):  # tmp_path: a folder without adapter_config.json
        with pytest.raises(InvalidRequestError) as info:
            load_lora_model(LoRARequest("x", 0, str(path)), arch, MAX_LORA_RANK)
        messages.append(str(info.value).replace(str(path), "P"))
    assert messages[0] == messages[1] and "is not a folder" in messages[0]


def test_scaling_and_shapes_of_a_loaded_adapter(model_path, adapters):
    """rsLoRA: lora_alpha / sqrt(r); q/k/v land in qkv_proj's slices 0..2, gate/up in gate_up_proj's."""
    arch = ModelArchConfig.from_hf_config(hf_model(model_path).config)
    mlp = load_lora_model(LoRARequest("mlp", 0, str(adapters["mlp"][0])), arch, MAX_LORA_RANK)
    assert mlp.scaling == pytest.approx(4 / 2**0.5)
    gate, up = mlp.weights[(0, "gate_up_proj")]
    assert gate is not None and up is not None and gate[0].shape == (2, arch.hidden_size)
    qv = load_lora_model(LoRARequest("qv", 0, str(adapters["qv"][0])), arch, MAX_LORA_RANK)
    q, k, v = qv.weights[(1, "qkv_proj")]
    assert k is None and q is not None and v is not None and qv.scaling == 2.0
    assert (0, "o_proj") not in qv.weights and (0, "down_proj") not in qv.weights


def test_scheduler_admits_no_more_than_max_loras_adapters():
    scheduler = make_scheduler(max_loras=2)
    requests = [make_request(f"r{i}", 8) for i in range(5)]
    for request, lora in zip(requests, (1, 2, 3, 0, 2), strict=True):
        request.lora_int_id = lora
        scheduler.add_request(request)
    output = scheduler.schedule()
    # r2 (a third adapter) waits; r3 (base) and r4 (adapter 2, already running) go ahead of it, as vLLM's skip
    assert list(output.num_scheduled_tokens) == ["r0", "r1", "r3", "r4"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_lora_calls_on_a_core_without_lora(model_path):
    core = EngineCore(CoreConfig(model=str(model_path), num_kv_blocks=8))
    assert not core.get_engine_info().supports_lora
    with pytest.raises(LoRADisabledError, match="--enable-lora"):
        core.list_loras()
    with pytest.raises(LoRANotFoundError, match="--enable-lora"):
        core.add_request(Request("r", [1, 2], SamplingParams(max_tokens=1), lora_name="a"))


def test_llm_generate_with_lora_requests(model_path, adapters, prompt):
    from frontend_svc import LLM
    from frontend_svc import LoRARequest as ApiLoRARequest
    from frontend_svc import SamplingParams as ApiSamplingParams
    from frontend_svc.errors import NotFoundError

    # max_loras (and so the host cache, --max-cpu-loras) 1: two adapters in one call, each stays loaded
    with LLM(str(model_path), enable_lora=True, max_lora_rank=MAX_LORA_RANK, num_kv_blocks=64) as llm:
        requests = [
            ApiLoRARequest("attn", 1, str(adapters["attn"][0])),
            None,
            ApiLoRARequest("mlp", 2, str(adapters["mlp"][0])),
        ]
        params = ApiSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outputs = llm.generate([prompt] * 3, params, lora_request=requests, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [adapters[n][1] for n in ("attn", "base", "mlp")]
        # Each output names the adapter it ran with, as vLLM's RequestOutput.lora_request.
        assert [o.lora_request.lora_name if o.lora_request else None for o in outputs] == ["attn", None, "mlp"]
        engine = llm.llm_engine
        assert engine.list_loras() == {1, 2}  # loaded on demand from their paths, under the ids given
        assert engine.remove_lora(1) and not engine.remove_lora(1)
        with pytest.raises(NotFoundError, match="attn"):
            llm.generate([prompt], params, lora_request=ApiLoRARequest("attn"), use_tqdm=False)


def test_async_llm_loads_adapters_off_the_engine_thread(model_path, adapters, prompt):
    """AsyncLLM (the servers' engine): add_lora reads the folder on the core's loader thread and joins between
    steps; a request's adapter is loaded on demand; remove and list go through the engine loop."""
    from frontend_svc import AsyncLLM
    from frontend_svc import LoRARequest as ApiLoRARequest
    from frontend_svc import SamplingParams as ApiSamplingParams
    from frontend_svc.errors import AlreadyExistsError, ValidationError

    async def scenario() -> None:
        engine = AsyncLLM(str(model_path), enable_lora=True, max_loras=2, max_lora_rank=MAX_LORA_RANK, num_kv_blocks=64)
        try:
            assert engine.engine_info.supports_lora and engine.engine_info.max_loras == 2
            assert await engine.add_lora(ApiLoRARequest("all", 0, str(adapters["all"][0])))
            with pytest.raises(AlreadyExistsError):
                await engine.add_lora(ApiLoRARequest("all", 0, str(adapters["qv"][0])))
            with pytest.raises(ValidationError, match="not a folder") as info:
                await engine.add_lora(ApiLoRARequest("bad", 0, "/no/such/adapter"))
            assert info.value.field == "lora_request.lora_path"
            params = ApiSamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            qv = ApiLoRARequest("qv", 0, str(adapters["qv"][0]))  # loaded on demand

            async def ids(request_id: str, lora: ApiLoRARequest | None) -> list[int]:
                outputs = [o async for o in engine.generate(prompt, params, request_id, lora_request=lora)]
                return outputs[-1].outputs[0].token_ids

            got = await asyncio.gather(ids("a", ApiLoRARequest("all")), ids("b", qv), ids("c", None))
            assert got == [adapters["all"][1], adapters["qv"][1], adapters["base"][1]]
            assert len(await engine.list_loras()) == 2
            assert await engine.remove_lora("qv") and not await engine.remove_lora("qv")
        finally:
            engine.close()

    asyncio.run(scenario())


def test_core_grpc_lora_rpcs(model_path, adapters, tmp_path):
    from splitserve.entrypoints import stack
    from splitserve.stubs.engine.v1 import engine_core_pb2 as pb
    from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as pb_grpc

    core = stack.start_core(
        str(model_path), tmp_path, ["--num-kv-blocks", "16", "--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK)]
    )
    try:
        core.wait_serving()

        async def calls() -> None:
            async with grpc.aio.insecure_channel(core.address) as channel:
                stub = pb_grpc.EngineCoreStub(channel)
                info = await stub.GetEngineInfo(pb.GetEngineInfoRequest())
                assert (info.supports_lora, info.max_loras, info.max_lora_rank) == (True, 1, MAX_LORA_RANK)
                added = await stub.AddLora(
                    pb.AddLoraRequest(lora_request=pb.LoRARequest(lora_name="a", lora_path=str(adapters["attn"][0])))
                )
                assert added.lora_request.lora_int_id >= 1
                listed = await stub.ListLoras(pb.ListLorasRequest())
                assert [r.lora_name for r in listed.lora_requests] == ["a"]
                with pytest.raises(grpc.aio.AioRpcError) as exists:
                    await stub.AddLora(
                        pb.AddLoraRequest(lora_request=pb.LoRARequest(lora_name="a", lora_path=str(adapters["mlp"][0])))
                    )
                assert exists.value.code() == grpc.StatusCode.ALREADY_EXISTS
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.AddLora(pb.AddLoraRequest(lora_request=pb.LoRARequest(lora_name="b", lora_path="/nope")))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a folder" in bad.value.details()
                await stub.RemoveLora(pb.RemoveLoraRequest(lora_name="a"))
                with pytest.raises(grpc.aio.AioRpcError) as missing:
                    await stub.RemoveLora(pb.RemoveLoraRequest(lora_name="a"))
                assert missing.value.code() == grpc.StatusCode.NOT_FOUND
                assert not (await stub.ListLoras(pb.ListLorasRequest())).lora_requests

        asyncio.run(calls())
    finally:
        core.stop()


def test_benchmark_adapters_are_servable(model_path, tmp_path):
    """``splitserve bench throughput --loras`` writes its adapters without peft: the core reads every projection."""
    from benchmarks.lora import make_random_adapters

    [folder] = make_random_adapters(model_path, tmp_path, num_loras=1, rank=4)
    arch = ModelArchConfig.from_hf_config(hf_model(model_path).config)
    model = load_lora_model(LoRARequest("bench", 0, str(folder)), arch, MAX_LORA_RANK)
    assert (model.rank, model.scaling) == (4, 2.0)
    assert set(model.weights) == {
        (i, m) for i in range(arch.num_hidden_layers) for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    }
    assert all(s is not None for slices in model.weights.values() for s in slices)


@pytest.mark.cuda
def test_mixed_adapters_on_the_gpu_match_peft(checkpoint, tmp_path):
    """The same torch code on CUDA tensors (no LoRA kernel): two adapters and the base model in one batch, float32,
    against peft on the host; then the base model alone, whose decode steps replay CUDA graphs."""
    path = checkpoint("llama", config_overrides={"head_dim": 64})  # head size the GPU attention backends take
    base = hf_model(path)
    prompt = random_prompt(path, 21, seed=0)
    peft_models = {name: make_adapter(base, tmp_path / name, *ADAPTERS[name]) for name in ("all", "attn")}
    want = {name: greedy_reference(model, prompt)[0] for name, model in peft_models.items()}
    want[None] = greedy_reference(base, prompt)[0]
    core = EngineCore(
        CoreConfig(
            model=str(path),
            device="cuda",
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            max_lora_rank=MAX_LORA_RANK,
            num_kv_blocks=64,
            max_num_seqs=16,
        )
    )
    for name in peft_models:
        core.add_lora(LoRARequest(name, 0, str(tmp_path / name)))
    names = ["all", None, "attn"]
    assert [ids for ids, _, _ in run(core, [(prompt, name) for name in names])] == [want[n] for n in names]
    assert run(core, [(prompt, None)])[0][0] == want[None]


def test_adapters_survive_sleep_level_2(engine, adapters, prompt):
    """Sleep level 2 drops the weights and wake_up reloads them: the reloaded projections get adapter slots, and
    an adapter's output is what it was before (not the base model's)."""
    ensure(engine, adapters, "attn")
    [(before, _, _)] = run(engine, [(prompt, "attn")])
    engine.sleep(2)
    engine.wake_up()
    [(after, _, _)] = run(engine, [(prompt, "attn")])
    assert before == after == adapters["attn"][1]
    assert after != adapters["base"][1]


def test_max_cpu_loras_is_a_cache_every_adapter_stays_loaded(model_path, adapters, prompt, tmp_path):
    """With room for one adapter's weights, every adapter registered stays listed and servable: one whose weights
    were dropped is read again when a request names it (two in flight at once too); files changed meanwhile fail
    the request rather than serve other weights under the adapter's identity."""
    import shutil

    changing = tmp_path / "changing"
    shutil.copytree(adapters["qv"][0], changing)
    core = EngineCore(
        CoreConfig(
            model=str(model_path),
            enable_lora=True,
            max_lora_rank=MAX_LORA_RANK,
            num_kv_blocks=64,
            lora_modules=(f"a={adapters['attn'][0]}", f"m={adapters['mlp'][0]}", f"c={changing}"),
        )
    )
    assert [r.lora_name for r in core.list_loras()] == ["a", "m", "c"]
    assert list(core.lora_manager.loaded) == ["c"]  # max_cpu_loras defaults to max_loras: 1
    # An id asked for by an adapter whose weights are dropped is still its own: never given to another.
    asked = core.add_lora(LoRARequest("asked", 4, str(adapters["qv"][0])))  # the ids given so far: 1, 2, 3
    run(core, [(prompt[:4], "a")])  # drops asked's weights
    assert asked.lora_int_id == 4 and asked.lora_int_id not in core.lora_manager.held
    assert core.add_lora(LoRARequest("next", 0, str(adapters["qv"][0]))).lora_int_id == 5
    with pytest.raises(LoRAExistsError, match="4 is the id of adapter 'asked'"):
        core.add_lora(LoRARequest("again", 4, str(adapters["qv"][0])))
    for name in ("asked", "next"):
        core.remove_lora(name)
    results = run(core, [(prompt, "a"), (prompt, "m"), (prompt, None)])
    assert [ids for ids, _, _ in results] == [adapters[n][1] for n in ("attn", "mlp", "base")]
    assert [ids for ids, _, _ in run(core, [(prompt, "c")])] == [adapters["qv"][1]]
    run(core, [(prompt, "a")])  # drops c's weights
    config = changing / "adapter_config.json"
    config.write_text(config.read_text() + "\n")  # servable still, but not the files it was loaded from
    with pytest.raises(InvalidRequestError, match="files of LoRA adapter 'c' .* changed"):
        core.add_request(Request("changed", list(prompt), SamplingParams(max_tokens=1), lora_name="c"))
    assert [r.lora_name for r in core.list_loras()] == ["a", "m", "c"]


def test_an_adapter_removed_while_in_use_is_freed_when_its_last_request_is_aborted(engine, adapters, prompt):
    loaded = engine.add_lora(LoRARequest("aborted", 0, str(adapters["qv"][0])))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request(Request("aborted-1", list(prompt), params, lora_name="aborted"))
    engine.step()
    engine.remove_lora("aborted")
    assert loaded.lora_int_id in engine.lora_manager.held  # its request still runs with it
    engine.abort_requests(["aborted-1"])
    assert loaded.lora_int_id not in engine.lora_manager.held
    assert not engine.has_unfinished_requests()


def test_preempted_adapter_requests_resume_with_their_adapters(model_path, engine, adapters, prompt):
    """Two adapters' requests in a KV cache too small for both to decode: one is preempted and recomputed; each
    still ends with its own adapter's output."""
    short = prompt[:16]  # one full block each; the first decode step needs a second block for both
    for name in ("attn", "mlp"):
        ensure(engine, adapters, name)
    want = [ids for ids, _, _ in run(engine, [(short, "attn"), (short, "mlp")])]
    core = EngineCore(
        CoreConfig(
            model=str(model_path),
            enable_lora=True,
            max_loras=2,
            max_lora_rank=MAX_LORA_RANK,
            num_kv_blocks=4,  # the null block and 3 more: not 4 for two requests of 2 blocks
            enable_prefix_caching=False,
            lora_modules=(f"attn={adapters['attn'][0]}", f"mlp={adapters['mlp'][0]}"),
        )
    )
    preempted: list[int] = []
    got = run(
        core,
        [(short, "attn"), (short, "mlp")],
        check=lambda e: preempted.extend(r.num_preemptions for r in e.scheduler.requests.values()),
    )
    assert any(preempted)
    assert [ids for ids, _, _ in got] == want and want[0] != want[1]


def test_pooling_request_with_a_lora_request_pools_with_the_adapter(model_path, adapters, prompt):
    """``LLMEngine.add_request`` with PoolingParams and a ``lora_request`` pools with that adapter: transformers +
    peft's last hidden state (LAST, normalized), not the base model's, which the same prompt without it gets."""
    from frontend_svc import LLMEngine, PoolingParams
    from frontend_svc import LoRARequest as ApiLoRARequest

    path = adapters["attn"][0]
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model(model_path)), path).eval()
        hidden = peft_model.base_model.model.model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
        base_hidden = hf_model(model_path).model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
    expected, base = (torch.nn.functional.normalize(h, dim=-1) for h in (hidden, base_hidden))
    engine = LLMEngine(str(model_path), enable_lora=True, max_loras=1, max_lora_rank=MAX_LORA_RANK, num_kv_blocks=64)
    try:
        params = PoolingParams(pooling_type="LAST", normalize=True)
        engine.add_request("lora", prompt, params, lora_request=ApiLoRARequest("attn", 1, str(path)))
        engine.add_request("base", prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
    finally:
        engine.close()
    torch.testing.assert_close(torch.tensor(outputs["lora"].outputs.data), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(outputs["base"].outputs.data), base, atol=1e-4, rtol=0)
    assert (expected - base).abs().max() > 1e-3  # the adapter changes the vector
