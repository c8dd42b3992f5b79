"""Pooling (embedding) requests: vLLM's ``PoolingParams`` through the same scheduler as generation, prefill only.

The right vectors come from transformers' ``AutoModel`` on the same checkpoint: its ``last_hidden_state`` (after
the final norm) pooled by hand (LAST, MEAN, CLS; Matryoshka truncation, then L2 normalization), float32.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from core_svc.engine_core import EngineCore
from core_svc.errors import InvalidRequestError
from core_svc.wire import request_from_pb
from frontend_svc import LLM, PoolingParams, PoolingRequestOutput, RequestOutput, SamplingParams
from frontend_svc.errors import ValidationError
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

# Mixed lengths; with a 32-token step budget the longer prompts are computed in several chunks.
PROMPTS = [list(range(3, 8)), list(range(10, 40)), [7, 7, 9] * 17]
STEP_TOKENS = 32
COMBOS = [(t, n) for t in ("LAST", "MEAN", "CLS") for n in (True, False)]


@cache
def reference(path: Path, prompt: tuple[int, ...], pooling_type: str, normalize: bool, dims: int = 0) -> torch.Tensor:
    """transformers' pooled vector [hidden_size or dims] float32 of one prompt (alone: no padding)."""
    hidden = _hf_hidden(path, prompt)
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    if dims:
        pooled = pooled[:dims]
    return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


@cache
def _hf_hidden(path: Path, prompt: tuple[int, ...]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(path)(torch.tensor([prompt])).last_hidden_state[0].float()


@cache
def _hf_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def assert_close(ours: list[float], ref: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(ours), ref, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def llama(checkpoint):
    return checkpoint("llama", "tiny")


@pytest.fixture(scope="module")
def qwen3(checkpoint, tmp_path_factory):
    """A tiny Qwen3 as an embedding model, laid out as Qwen3-Embedding (base-model tensor names), with
    sentence-transformers MEAN pooling and Normalize, and Matryoshka."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("qwen3-embedding") / "model"
    shutil.copytree(checkpoint("qwen3", "tiny"), path)
    # Qwen3-Embedding's layout: the base model's tensor names (no "model." prefix), no lm_head (tied).
    weights = load_file(path / "model.safetensors")
    base = {k.removeprefix("model."): v for k, v in weights.items() if not k.startswith("lm_head.")}
    save_file(base, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


@pytest.fixture(scope="module")
def llama_llm(llama):
    with LLM(str(llama), max_num_batched_tokens=STEP_TOKENS, num_kv_blocks=64, max_model_len=256) as llm:
        yield llm


def free_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.num_free_blocks


def test_embeddings_equal_transformers_llama(llama_llm, llama):
    """Every pooling type, normalize on and off, all prompts of mixed lengths in one batch, chunked prefill; the
    repeated prompts of LAST pooling hit the prefix cache and still give transformers' vector."""
    params = [PoolingParams(pooling_type=t, normalize=n) for t, n in COMBOS for _ in PROMPTS]  # type: ignore[arg-type]
    prompts = [prompt for _ in COMBOS for prompt in PROMPTS]
    outputs = llama_llm.encode(prompts, params, use_tqdm=False)
    for output, prompt, p in zip(outputs, prompts, params, strict=True):
        assert isinstance(output, PoolingRequestOutput) and output.finished
        assert output.prompt_token_ids == prompt
        assert_close(output.outputs.data, reference(llama, tuple(prompt), p.pooling_type, p.normalize))
    cached = [o.num_cached_tokens for o, p in zip(outputs, params, strict=True) if p.pooling_type == "LAST"]
    assert max(cached) > 0  # a LAST request read blocks the first LAST run of its prompt computed
    assert all(o.num_cached_tokens == 0 for o, p in zip(outputs, params, strict=True) if p.pooling_type != "LAST")
    assert free_blocks(llama_llm) == 63  # every block back (the null block aside)


def test_embed_defaults_and_dimensions_qwen3(qwen3):
    """A Qwen3 served with --runner pooling: modules.json's MEAN + Normalize are the defaults, Matryoshka
    ``dimensions`` truncates before normalizing; generation is refused naming sampling_params."""
    with LLM(str(qwen3), runner="pooling", max_num_batched_tokens=STEP_TOKENS, num_kv_blocks=64) as llm:
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        for output, prompt in zip(outputs, PROMPTS, strict=True):
            assert len(output.outputs.embedding) == 64
            assert_close(output.outputs.embedding, reference(qwen3, tuple(prompt), "MEAN", True))
        params = [PoolingParams(pooling_type="LAST", dimensions=16), PoolingParams(pooling_type="CLS", normalize=False)]
        short, cls = llm.embed(PROMPTS[1:], params, use_tqdm=False)
        assert_close(short.outputs.embedding, reference(qwen3, tuple(PROMPTS[1]), "LAST", True, 16))
        assert_close(cls.outputs.embedding, reference(qwen3, tuple(PROMPTS[2]), "CLS", False))
        with pytest.raises(ValidationError) as info:
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert info.value.field == "sampling_params"


def test_pooling_beside_generation_in_one_step(llama, llama_llm):
    """Generation requests and a pooling request in one core, all three in the first step (23 tokens under the
    budget of 32): each gets what it gets alone (generation ids unchanged, the vector transformers');
    ``LLMEngine.step()`` yields a PoolingRequestOutput beside the RequestOutputs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    gen_prompts, pool_prompt = [PROMPTS[0], list(range(50, 58))], list(range(60, 70))
    alone = [o.outputs[0].token_ids for o in llama_llm.generate(gen_prompts, greedy, use_tqdm=False)]
    engine = llama_llm.llm_engine
    engine.add_request("gen-0", gen_prompts[0], greedy)
    engine.add_request("pool", pool_prompt, PoolingParams(pooling_type="MEAN"))
    engine.add_request("gen-1", gen_prompts[1], greedy)
    first_step = engine.step()
    assert {o.request_id for o in first_step} == {"gen-0", "gen-1", "pool"}  # one step computed all three
    outputs: dict[str, Any] = {o.request_id: o for o in first_step}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    assert isinstance(outputs["pool"], PoolingRequestOutput)
    assert_close(outputs["pool"].outputs.data, reference(llama, tuple(pool_prompt), "MEAN", True))
    for i in range(2):
        generated = outputs[f"gen-{i}"]
        assert isinstance(generated, RequestOutput) and generated.outputs[0].token_ids == alone[i]
    assert free_blocks(llama_llm) == 63


def test_bad_pooling_requests(llama_llm):
    """Refused with the field named, and nothing else lost: the next request runs and every block is free."""
    cases = [
        (PoolingParams(pooling_type="MAX"), "pooling_type"),  # type: ignore[arg-type]
        (PoolingParams(dimensions=8), "dimensions"),  # the tiny Llama is no Matryoshka model
        (PoolingParams(dimensions=0), "dimensions"),
        (PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (SamplingParams(), "pooling_params"),
    ]
    for params, field in cases:
        with pytest.raises(ValidationError) as info:
            llama_llm.encode([PROMPTS[0]], params, use_tqdm=False)  # type: ignore[arg-type]
        assert info.value.field == field, params
    with pytest.raises(ValidationError) as info:
        llama_llm.encode([[]], use_tqdm=False)
    assert info.value.field == "prompt"
    # truncate_prompt_tokens keeps the last tokens, as vLLM's
    [truncated] = llama_llm.encode([PROMPTS[1]], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    assert truncated.prompt_token_ids == PROMPTS[1][-5:]
    assert free_blocks(llama_llm) == 63


def test_core_refuses_both_params(llama_llm):
    """A core request carrying sampling and pooling params (or neither) is refused naming the field."""
    core: EngineCore = llama_llm.llm_engine.engine_core.engine_core
    both = core_pb.EngineCoreRequest(
        request_id="both",
        prompt_token_ids=[1, 2],
        sampling_params=core_pb.SamplingParams(),
        pooling_params=core_pb.PoolingParams(),
    )
    neither = core_pb.EngineCoreRequest(request_id="neither", prompt_token_ids=[1, 2])
    unknown = core_pb.EngineCoreRequest(
        request_id="unknown",
        prompt_token_ids=[1, 2],
        pooling_params=core_pb.PoolingParams(pooling_type=9),  # type: ignore[arg-type]
    )
    for message, field in ((both, "pooling_params"), (neither, "sampling_params"), (unknown, "pooling_type")):
        with pytest.raises(InvalidRequestError) as info:
            core.add_request(request_from_pb(message))
        assert info.value.field == field
    assert not core.has_unfinished_requests()


def embed(address: str, request: api.EmbedRequest) -> api.EmbedResponse:
    """One ``Generation.Embed`` call (the split stack's tests: ``tests/test_openai_http.py``, which reuses that
    module's stack)."""

    async def call() -> api.EmbedResponse:
        async with grpc.aio.insecure_channel(address) as channel:
            return await api_grpc.GenerationStub(channel).Embed(request, timeout=60)

    return asyncio.run(call())


def test_scheduler_emits_a_pooling_request_once_when_its_last_chunk_is_computed():
    """Scheduler with fake runner output: a 40-token pooling request beside a generation request under a 16-token
    budget emits nothing while its prefill is partial (as vLLM), then one finished output with its vector and no
    token; its blocks go back at once. MEAN never reads the prefix cache, LAST does."""
    from core_svc.outputs import ModelRunnerOutput
    from core_svc.request import FinishReason, Request
    from splitserve.base.pooling_params import PoolingParams as CorePoolingParams
    from tests.factories import make_request, make_scheduler

    scheduler = make_scheduler(max_num_batched_tokens=16, num_blocks=40, block_size=4)
    pooling = Request("p", list(range(1000, 1040)), None, pooling_params=CorePoolingParams("MEAN", True))
    assert pooling.skip_reading_prefix_cache
    assert not Request("q", [1, 2], None, pooling_params=CorePoolingParams("LAST", True)).skip_reading_prefix_cache
    scheduler.add_request(make_request("g", 6, max_tokens=3))
    scheduler.add_request(pooling)
    vector = np.arange(4, dtype="<f4").tobytes()
    pooled_outputs = []
    for _ in range(10):
        scheduler_output = scheduler.schedule()
        runner_output = ModelRunnerOutput(sampled_token_ids={})
        for request_id in scheduler_output.num_scheduled_tokens:
            request = scheduler.requests[request_id]
            done = request.num_computed_tokens >= request.num_tokens
            if request.pooling_params is not None and done:
                runner_output.pooler_output[request_id] = vector
            runner_output.sampled_token_ids[request_id] = [5] if done and request.pooling_params is None else []
        outputs = scheduler.update_from_output(scheduler_output, runner_output)
        pooled_outputs += [o for o in outputs.outputs if o.request_id == "p"]
        if not scheduler.has_unfinished_requests():
            break
    [output] = pooled_outputs  # one output, the last chunk's: none for the partial prefills
    assert output.finish_reason == FinishReason.STOP and output.new_token_ids == []
    assert output.pooling_output == vector and pooling.output_token_ids == []
    assert scheduler.kv_cache_manager.num_free_blocks == 39


def test_a_preempted_pooling_request_pools_its_recomputed_prompt(llama):
    """A MEAN pooling request preempted mid-prefill (6 usable KV blocks; the generation request admitted first
    holds 3 and grows) is recomputed from its first token when resumed, and still pools to transformers' vector: the
    runner drops what its first chunks accumulated."""
    from frontend_svc import LLMEngine

    engine = LLMEngine(str(llama), num_kv_blocks=7, max_num_batched_tokens=STEP_TOKENS, max_model_len=96)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        engine.add_request("gen", list(range(100, 140)), greedy)  # 3 blocks, then 4
        pool_prompt = [11, 12, 13] * 23  # 5 blocks: preempted at its third chunk, resumed once "gen" ends
        engine.add_request("pool", pool_prompt, PoolingParams(pooling_type="MEAN"))
        outputs: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
        assert engine.num_preemptions >= 1
        assert_close(outputs["pool"].outputs.data, reference(llama, tuple(pool_prompt), "MEAN", True))
        assert len(outputs["gen"].outputs[0].token_ids) == 10
        assert engine.engine_core.engine_core.scheduler.kv_cache_manager.num_free_blocks == 6
    finally:
        engine.close()
