"""LoRA adapters through the public APIs of a split stack: one core process (``--enable-lora``) and two frontend
processes, one allowed to load and unload adapters at run time (``--allow-runtime-lora-updating``, with the HTTP
API), one not. The right tokens come from transformers + peft on the same checkpoint and adapter folders."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest

from splitserve.entrypoints import stack
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

PROMPT = "The capital of France is"
MAX_TOKENS = 8
CORE_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "256"]
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter folder for ``model`` with random (non-zero) A and B on every projection."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGET_MODULES, init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():  # large enough to change greedy choices on random weights
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    peft_model.save_pretrained(out)
    return out


def peft_greedy(model: Path, adapter: Path | None, prompt_ids: list[int]) -> list[int]:
    """transformers' (+ peft's) greedy continuation of ``prompt_ids``: ``MAX_TOKENS`` ids, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, adapter)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


@pytest.fixture(scope="module")
def adapters(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Two adapters of different ranks: "a" is loaded at run time, "b" by the core's --lora-modules."""
    root = tmp_path_factory.mktemp("lora")
    model = checkpoint("llama")
    return {"a": make_adapter(model, root / "a", 8, 1), "b": make_adapter(model, root / "b", 4, 2)}


@pytest.fixture(scope="module")
def services(checkpoint, adapters, tmp_path_factory):
    """(core, the frontend allowed to update adapters, its HTTP base URL, a frontend that is not, its URL)."""
    model = str(checkpoint("llama"))
    logs = tmp_path_factory.mktemp("lora-logs")
    lora_args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "4",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"b={adapters['b']}",
        f"{model}={adapters['a']}",  # named as the served model: shadowed by it, no card of its own
    ]
    core = stack.start_core(model, logs, CORE_ARGS + lora_args)
    frontends: list[Any] = []
    try:
        core.wait_serving()
        ports = [stack.free_port(), stack.free_port()]
        updating = ["--allow-runtime-lora-updating", "--http-port", str(ports[0])]
        frontends.append(stack.start_frontend(model, [core.address], logs, updating))
        frontends.append(stack.start_frontend(model, [core.address], logs, ["--http-port", str(ports[1])]))
        for frontend in frontends:
            frontend.wait_serving()
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        yield core, frontends[0], urls[0], frontends[1], urls[1]
    finally:
        running = [process for process in [*frontends, core] if process.process.poll() is None]
        for process in running:  # all drain at once
            process.process.send_signal(signal.SIGTERM)
        for process in running:
            process.stop()


def stub(frontend: Any) -> tuple[grpc.Channel, api_grpc.GenerationStub]:
    channel = grpc.insecure_channel(frontend.address)
    return channel, api_grpc.GenerationStub(channel)


def greedy(frontend: Any, lora_name: str = "") -> list[int]:
    """The frontend's greedy ids for ``PROMPT`` with the adapter ``lora_name`` ("" the base model)."""
    params = api.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    channel, generation = stub(frontend)
    with channel:
        request = api.GenerateRequest(prompt=PROMPT, sampling_params=params, lora_name=lora_name)
        return [t for r in generation.Generate(request, timeout=60) for t in r.outputs[0].token_ids]


def prompt_ids(frontend: Any) -> list[int]:
    channel, generation = stub(frontend)
    with channel:
        return list(generation.Tokenize(api.TokenizeRequest(text=PROMPT), timeout=30).token_ids)


def listed(frontend: Any) -> dict[str, str]:
    """lora_name -> lora_path of ListLoraAdapters."""
    channel, generation = stub(frontend)
    with channel:
        response = generation.ListLoraAdapters(api.ListLoraAdaptersRequest(), timeout=30)
    return {adapter.lora_name: adapter.lora_path for adapter in response.adapters}


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def peft_pooled(model: Path, adapter: Path, prompt_ids: list[int]) -> list[float]:
    """transformers' (+ peft's) last hidden state (after the final norm) of the last prompt token, L2-normalized:
    LAST pooling, the default of a model folder without modules.json."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf: Any = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), adapter)
    with torch.no_grad():
        hidden = hf.base_model.model.model(torch.tensor([prompt_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden.float(), dim=-1).tolist()


def test_unknown_adapter_is_not_found_and_the_base_model_goes_on(services):
    _, frontend, base_url, _, _ = services
    error = rpc_error(lambda: greedy(frontend, "no-such-adapter"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "no-such-adapter" in error.details()
    channel, generation = stub(frontend)
    with channel:
        message = api.ChatMessage(role="user", content=[api.ContentPart(text="hi")])
        chat = api.ChatRequest(messages=[message], lora_name="no-such-adapter")
        error = rpc_error(lambda: list(generation.Chat(chat, timeout=60)))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            client.chat.completions.create(model="no-such-adapter", messages=[{"role": "user", "content": "hi"}])
        assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    assert len(greedy(frontend)) == MAX_TOKENS  # the server goes on


def test_load_and_unload_are_refused_unless_allowed(services, adapters):
    _, _, _, plain, plain_url = services
    channel, generation = stub(plain)
    with channel:
        load = api.LoadLoraAdapterRequest(lora_name="c", lora_path=str(adapters["a"]))
        for call in (
            lambda: generation.LoadLoraAdapter(load, timeout=30),
            lambda: generation.UnloadLoraAdapter(api.UnloadLoraAdapterRequest(lora_name="b"), timeout=30),
        ):
            error = rpc_error(call)
            assert error.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "--allow-runtime-lora-updating" in error.details()
    for path, body in [
        ("load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["a"])}),
        ("unload_lora_adapter", {"lora_name": "b"}),
    ]:
        refused = httpx.post(f"{plain_url}/v1/{path}", json=body, timeout=30)
        assert refused.status_code == 501 and "--allow-runtime-lora-updating" in refused.json()["error"]["message"]
    assert "c" not in listed(plain)


def test_load_requests_name_the_missing_field(services):
    _, frontend, base_url, _, _ = services
    channel, generation = stub(frontend)
    with channel:
        for request, field in [
            (api.LoadLoraAdapterRequest(lora_path="/x"), "lora_name"),
            (api.LoadLoraAdapterRequest(lora_name="x"), "lora_path"),
        ]:
            error = rpc_error(lambda request=request: generation.LoadLoraAdapter(request, timeout=30))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith(f"{field}: ")
    missing = httpx.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "x"}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"


def test_load_generate_list_on_two_frontends_unload_then_not_found(services, adapters, checkpoint):
    _, frontend, _, plain, _ = services
    ids = prompt_ids(frontend)
    model = checkpoint("llama")
    channel, generation = stub(frontend)
    with channel:
        loaded = generation.LoadLoraAdapter(
            api.LoadLoraAdapterRequest(lora_name="a", lora_path=str(adapters["a"])), timeout=60
        )
        assert loaded.adapter.lora_name == "a" and loaded.adapter.lora_int_id >= 1
        for frontend_ in (frontend, plain):  # the core holds the names: every frontend sees them
            assert listed(frontend_) == {
                "a": str(adapters["a"]),
                "b": str(adapters["b"]),
                str(model): str(adapters["a"]),
            }
        expected = peft_greedy(model, adapters["a"], ids)
        assert greedy(frontend, "a") == expected
        assert greedy(plain, "a") == expected  # the other frontend runs it too
        assert expected != peft_greedy(model, None, ids) == greedy(frontend)

        generation.UnloadLoraAdapter(api.UnloadLoraAdapterRequest(lora_name="a"), timeout=30)
        assert "a" not in listed(plain)
        assert rpc_error(lambda: greedy(plain, "a")).code() == grpc.StatusCode.NOT_FOUND
        again = rpc_error(lambda: generation.UnloadLoraAdapter(api.UnloadLoraAdapterRequest(lora_name="a"), timeout=30))
        assert again.code() == grpc.StatusCode.NOT_FOUND


def test_an_adapter_the_core_cannot_read_is_invalid_argument_with_its_reason(services, tmp_path):
    _, frontend, base_url, _, _ = services
    missing = tmp_path / "no-adapter-here"
    channel, generation = stub(frontend)
    with channel:
        request = api.LoadLoraAdapterRequest(lora_name="bad", lora_path=str(missing))
        error = rpc_error(lambda: generation.LoadLoraAdapter(request, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and str(missing) in error.details()
    response = httpx.post(
        f"{base_url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(missing)}, timeout=30
    )
    error_body = response.json()["error"]
    assert response.status_code == 400 and str(missing) in error_body["message"] and error_body["param"] == "lora_path"
    assert "bad" not in listed(frontend)


def test_a_name_loaded_from_another_folder_is_already_exists_and_the_same_again_is_no_error(services, adapters):
    _, frontend, base_url, _, _ = services
    channel, generation = stub(frontend)
    with channel:
        other = api.LoadLoraAdapterRequest(lora_name="b", lora_path=str(adapters["a"]))
        assert rpc_error(lambda: generation.LoadLoraAdapter(other, timeout=60)).code() == grpc.StatusCode.ALREADY_EXISTS
        same = api.LoadLoraAdapterRequest(lora_name="b", lora_path=str(adapters["b"]))
        assert generation.LoadLoraAdapter(same, timeout=60).adapter.lora_path == str(adapters["b"])
    body = {"lora_name": "b", "lora_path": str(adapters["a"])}
    assert httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 400
    assert listed(frontend)["b"] == str(adapters["b"])


def test_http_models_list_adapters_and_a_model_naming_one_runs_it(services, adapters, checkpoint):
    _, frontend, base_url, _, _ = services
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        ids = [card.id for card in client.models.list().data]
        assert sorted(ids) == sorted({str(checkpoint("llama")), "b"})  # one card per id: the shadowed adapter none
        cards = {card.id: card for card in client.models.list().data}
        base_name = next(name for name, card in cards.items() if card.parent is None)
        assert cards["b"].parent == base_name and cards["b"].root == str(adapters["b"])
        completion = client.completions.create(
            model="b", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        expected = peft_greedy(checkpoint("llama"), adapters["b"], prompt_ids(frontend))
        assert greedy(frontend, "b") == expected
        assert expected != greedy(frontend)  # the adapter changes the output (else the comparison proves nothing)
        channel, generation = stub(frontend)
        with channel:
            text = generation.Detokenize(api.DetokenizeRequest(token_ids=expected), timeout=30).text
        assert completion.model == "b" and completion.choices[0].text == text
        with pytest.raises(openai.NotFoundError) as unknown:
            client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
        assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
        # /v1/embeddings with a model naming an adapter pools with it (as vLLM serves LoRA on pooling models)
        embedded = client.embeddings.create(model="b", input=[prompt_ids(frontend)], encoding_format="float")
        assert embedded.model == "b"
        reference = peft_pooled(checkpoint("llama"), adapters["b"], prompt_ids(frontend))
        assert max(abs(a - b) for a, b in zip(embedded.data[0].embedding, reference, strict=True)) < 1e-4
        base = client.embeddings.create(model=base_name, input=[prompt_ids(frontend)], encoding_format="float")
        assert max(abs(a - b) for a, b in zip(base.data[0].embedding, reference, strict=True)) > 1e-3
        with pytest.raises(openai.NotFoundError) as unknown:
            client.embeddings.create(model="no-such-adapter", input=PROMPT)
        assert unknown.value.code == "model_not_found" and unknown.value.param == "model"

    body = {"lora_name": "a2", "lora_path": str(adapters["a"])}
    assert httpx.post(f"{base_url}/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
    assert "a2" in {card["id"] for card in httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]}
    unload = {"lora_name": "a2"}
    assert httpx.post(f"{base_url}/v1/unload_lora_adapter", json=unload, timeout=30).status_code == 200
    gone = httpx.post(f"{base_url}/v1/unload_lora_adapter", json=unload, timeout=30)
    assert gone.status_code == 404
