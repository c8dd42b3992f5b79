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
    params = [PoolingParams(pooling_type=t, normalize=n) for t, n in COMBOS for _ in PROMPTS]  # type: ignore[arg-type]  # COMBOS holds the literal pooling types
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
        (PoolingParams(pooling_type="MAX"), "pooling_type"),  # type: ignore[arg-type]  # an unknown pooling type on purpose
        (PoolingParams(dimensions=8), "dimensions"),  # the tiny Llama is no Matryoshka model
        (PoolingParams(dimensions=0), "dimensions"),
        (PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (PoolingParams(truncate_prompt_tokens=257), "truncate_prompt_tokens"),  # above max_model_len (vLLM's rule)
        (SamplingParams(), "pooling_params"),
    ]
    for params, field in cases:
        with pytest.raises(ValidationError) as info:
            llama_llm.encode([PROMPTS[0]], params, use_tqdm=False)  # type: ignore[arg-type]  # the wrong params type on purpose
        assert info.value.field == field, params
    with pytest.raises(ValidationError) as info:
        llama_llm.encode([[]], use_tqdm=False)
    assert info.value.field == "prompt"
    # truncate_prompt_tokens keeps the last tokens, as vLLM's; also as embed's keyword (vLLM's LLM.embed)
    [truncated] = llama_llm.encode([PROMPTS[1]], PoolingParams(truncate_prompt_tokens=5), use_tqdm=False)
    assert truncated.prompt_token_ids == PROMPTS[1][-5:]
    [keyword] = llama_llm.embed([PROMPTS[1]], truncate_prompt_tokens=5, use_tqdm=False)
    assert keyword.prompt_token_ids == PROMPTS[1][-5:] and keyword.outputs.embedding == truncated.outputs.data
    # tokenization_kwargs, as vLLM's: a text without the tokenizer's BOS
    tokenizer = llama_llm.get_tokenizer()
    [bare] = llama_llm.embed(["Hello there"], tokenization_kwargs={"add_special_tokens": False}, use_tqdm=False)
    assert bare.prompt_token_ids == tokenizer("Hello there", add_special_tokens=False).input_ids
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
        pooling_params=core_pb.PoolingParams(pooling_type=9),  # type: ignore[arg-type]  # an enum value the proto does not define, on purpose
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


def test_pooler_accumulators_hold_copies_not_views_of_the_step_output():
    """CLS keeps a copy of the first row and LAST pools a copy of the last one, for a float32 model too (where
    ``.to(torch.float32)`` alone returns the step output's own row): writing the step output afterwards (a CUDA
    graph replay reuses its static output buffer) changes nothing pooled, and no accumulator keeps it alive."""
    from types import SimpleNamespace

    from core_svc import pooler
    from splitserve.base.pooling_params import PoolingParams as CorePoolingParams

    for pooling_type in ("LAST", "MEAN", "CLS"):
        hidden = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        state: Any = SimpleNamespace(
            request_id="r",
            pooling_params=CorePoolingParams(pooling_type, False),
            num_prompt_tokens=3,
            pooling_sum=None,
            pooling_first=None,
        )
        pooler.accumulate(state, hidden, 0)
        for kept in (state.pooling_first, state.pooling_sum):
            assert kept is None or kept.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr()
        expected = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type].clone()
        pooled = pooler.finish(state, hidden[-1])
        assert pooled.untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr(), pooling_type
        hidden.fill_(-1.0)  # the next step (graph replay) overwrites the buffer
        torch.testing.assert_close(pooled, expected)


def test_a_list_of_the_wrong_params_is_refused_before_any_request_is_added(llama_llm):
    """Every element of a params list is checked first: the wrong kind (or anything else) is refused naming
    ``pooling_params[i]`` / ``sampling_params[i]``, nothing is left in the core; the same call with the right kind
    then runs."""
    cases = [
        (lambda: llama_llm.encode([PROMPTS[0]], [SamplingParams(max_tokens=2)], use_tqdm=False), "pooling_params[0]"),
        (lambda: llama_llm.encode(PROMPTS[:2], [PoolingParams(), "MEAN"], use_tqdm=False), "pooling_params[1]"),
        (lambda: llama_llm.generate([PROMPTS[0]], [PoolingParams()], use_tqdm=False), "sampling_params[0]"),
        (
            lambda: llama_llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2), PoolingParams()], use_tqdm=False),
            "sampling_params[1]",
        ),
    ]
    for call, field in cases:
        with pytest.raises(ValidationError) as info:
            call()
        assert info.value.field == field
        assert not llama_llm.llm_engine.has_unfinished_requests()
    assert free_blocks(llama_llm) == 63
    [output] = llama_llm.encode([PROMPTS[0]], [PoolingParams(pooling_type="MEAN")], use_tqdm=False)
    assert len(output.outputs.data) == 64


def test_async_llm_refuses_pooling_params_for_generation_before_queueing(llama):
    """``AsyncLLM.add_request`` / ``generate`` given a PoolingParams: ValidationError naming sampling_params (not
    an AttributeError), nothing registered; ``encode`` then runs."""
    from frontend_svc import AsyncLLM

    async def scenario() -> None:
        engine = AsyncLLM(str(llama), num_kv_blocks=64)
        try:
            with pytest.raises(ValidationError) as info:
                await engine.add_request("a", PROMPTS[0], PoolingParams())  # type: ignore[arg-type]  # PoolingParams where SamplingParams belong, on purpose
            assert info.value.field == "sampling_params"
            with pytest.raises(ValidationError) as info:
                async for _ in engine.generate(PROMPTS[0], PoolingParams(), "b"):  # type: ignore[arg-type]  # PoolingParams where SamplingParams belong, on purpose
                    pass
            assert info.value.field == "sampling_params"
            assert not engine.output_processor.request_states
            async for output in engine.encode(PROMPTS[0], PoolingParams(pooling_type="MEAN"), "c"):
                assert_close(output.outputs.data, reference(llama, tuple(PROMPTS[0]), "MEAN", True))
        finally:
            engine.close()

    asyncio.run(scenario())


def _pooling_processor(queue: Any = None) -> Any:
    from frontend_svc.output_processor import OutputProcessor

    processor = OutputProcessor(None)
    processor.add_pooling_request("p-1", "p", PoolingParams(), None, [5, 6, 7], queue=queue, arrival_time=100.0)
    return processor


def test_wire_pooling_output_of_a_bad_length_fails_only_that_request():
    """A pooling vector whose byte length is not a multiple of 4 is that request's InternalError (finish reason
    error), and the other outputs of the message decode; a well-formed vector decodes to its floats."""
    from frontend_svc.engine_types import FinishReason as FrontendFinishReason
    from frontend_svc.errors import InternalError
    from frontend_svc.wire import outputs_from_pb

    vector = np.array([0.5, -1.0], dtype="<f4").tobytes()
    message = core_pb.EngineCoreOutputs(
        outputs=[
            core_pb.EngineCoreOutput(request_id="bad", finish_reason=1, pooling_output=vector[:7]),
            core_pb.EngineCoreOutput(request_id="good", finish_reason=1, pooling_output=vector),
        ]
    )
    bad, good = outputs_from_pb(message).outputs
    assert isinstance(bad.error, InternalError) and "7 bytes" in str(bad.error)
    assert bad.finish_reason == FrontendFinishReason.ERROR and bad.pooling_output is None
    assert good.error is None and good.pooling_output == [0.5, -1.0]


def test_a_finished_pooling_output_without_a_vector_fails_that_request():
    """The core finishing a pooling request with no vector fails it (InternalError naming it), never a successful
    empty embedding."""
    from frontend_svc.engine_types import EngineCoreOutput
    from frontend_svc.engine_types import FinishReason as FrontendFinishReason
    from frontend_svc.errors import InternalError
    from frontend_svc.output_processor import PoolingOutputCollector

    queue = PoolingOutputCollector("p-1")
    processor = _pooling_processor(queue)
    result = processor.process_outputs([EngineCoreOutput("p-1", [], finish_reason=FrontendFinishReason.STOP)])
    assert not result.request_outputs and not processor.has_unfinished_requests()
    with pytest.raises(InternalError, match="p-1.*without its vector"):
        asyncio.run(queue.get())
    unqueued = _pooling_processor()
    result = unqueued.process_outputs([EngineCoreOutput("p-1", [], finish_reason=FrontendFinishReason.STOP)])
    [error] = result.errors
    assert isinstance(error, InternalError) and error.request_id == "p"


def test_a_pooling_request_aborted_by_another_caller_gets_an_abort_error():
    """An abort from elsewhere (``AsyncLLM.abort``) ends a waiting ``encode`` with RequestAbortedError, not an empty
    vector that would read as a result."""
    from frontend_svc.errors import RequestAbortedError
    from frontend_svc.output_processor import PoolingOutputCollector

    queue = PoolingOutputCollector("p-1")
    processor = _pooling_processor(queue)
    assert processor.abort_requests(["p"]) == ["p-1"]
    with pytest.raises(RequestAbortedError, match="aborted") as info:
        asyncio.run(queue.get())
    assert info.value.request_id == "p"


def test_a_pooling_request_counts_its_prompt_and_ttft_in_the_metrics():
    """Its one output counts its prompt tokens (as vLLM counts a pooling request's prompt) and records TTFT and
    the prefill time; the finished stats have no max_tokens."""
    from frontend_svc.engine_types import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput
    from frontend_svc.engine_types import FinishReason as FrontendFinishReason
    from frontend_svc.stats import IterationStats

    processor = _pooling_processor()
    stats = IterationStats(iteration_timestamp=100.25)
    events = [EngineCoreEvent(EngineCoreEventType.QUEUED, 10.0), EngineCoreEvent(EngineCoreEventType.SCHEDULED, 10.5)]
    output = EngineCoreOutput("p-1", [], finish_reason=FrontendFinishReason.STOP, events=events, pooling_output=[1.0])
    [pooled] = processor.process_outputs([output], engine_core_timestamp=11.0, iteration_stats=stats).request_outputs
    assert pooled.outputs.data == [1.0]
    assert stats.num_prompt_tokens == 3 and stats.num_generation_tokens == 0
    assert stats.time_to_first_tokens_iter == [0.25]
    [finished] = stats.finished_requests
    assert finished.num_prompt_tokens == 3 and finished.max_tokens_param is None
    assert finished.first_token_latency == 0.25 and finished.prefill_time == 0.5 and finished.queued_time == 0.5


def test_a_generate_core_with_an_unsupported_pooling_mode_starts_and_refuses_only_what_needs_it(qwen3, tmp_path):
    """modules.json naming a pooling mode the core does not run (max tokens): a generate-runner core starts and
    generates; a pooling request leaving pooling_type unset is refused naming it, one that sets pooling_type and
    normalize runs; ``--runner pooling`` does not start."""
    from core_svc.config import CoreConfig
    from core_svc.errors import ModelLoadError

    path = tmp_path / "model"
    shutil.copytree(qwen3, path)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with LLM(str(path), max_num_batched_tokens=STEP_TOKENS, num_kv_blocks=32) as llm:
        [generated] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(generated.outputs[0].token_ids) == 2
        for params, field in ((PoolingParams(), "pooling_type"), (PoolingParams(pooling_type="MEAN"), "normalize")):
            with pytest.raises(ValidationError, match="pooling_mode_max_tokens") as info:
                llm.encode([PROMPTS[0]], params, use_tqdm=False)
            assert info.value.field == field
        [pooled] = llm.encode([PROMPTS[0]], PoolingParams(pooling_type="MEAN", normalize=True), use_tqdm=False)
        assert_close(pooled.outputs.data, reference(qwen3, tuple(PROMPTS[0]), "MEAN", True))
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        EngineCore(CoreConfig(model=str(path), runner="pooling", num_kv_blocks=32))


def test_a_pooling_prompt_of_max_model_len_tokens_is_refused_in_pooling_words(llama_llm):
    """A pooling prompt has at most max_model_len - 1 tokens here: the refusal (frontend and core) says so, with no
    word of an output token; max_model_len - 1 tokens run."""
    with pytest.raises(ValidationError, match=r"256 tokens, more than the 255 \(max_model_len - 1") as info:
        llama_llm.encode([[7] * 256], use_tqdm=False)
    assert info.value.field == "prompt" and "output token" not in str(info.value)
    core: EngineCore = llama_llm.llm_engine.engine_core.engine_core
    message = core_pb.EngineCoreRequest(
        request_id="long", prompt_token_ids=[7] * 256, pooling_params=core_pb.PoolingParams()
    )
    with pytest.raises(InvalidRequestError, match="a pooling prompt may have") as core_info:
        core.add_request(request_from_pb(message))
    assert core_info.value.field == "prompt_token_ids"
    [output] = llama_llm.encode([[7] * 255], PoolingParams(pooling_type="MEAN"), use_tqdm=False)
    assert len(output.outputs.data) == 64 and free_blocks(llama_llm) == 63


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ("dense", r"modules \['sentence_transformers.models.Dense'\] are not run"),
        ("lowercase", "do_lower_case is not implemented"),
    ],
)
def test_sentence_transformers_steps_the_core_does_not_run_are_refused(tmp_path, extra, words):
    """A Dense projection after the pooling, or lowercasing before tokenizing: the vectors would differ from the
    model's, so the pooling config is refused (a pooling-runner core does not start; a generate one refuses
    pooling requests that leave it to the model)."""
    from splitserve.base.pooling_params import load_pooler_config

    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if extra == "dense":
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    else:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16, "do_lower_case": True}))
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match=words):
        load_pooler_config(tmp_path)
    (tmp_path / "sentence_bert_config.json").unlink(missing_ok=True)
    (tmp_path / "modules.json").write_text(json.dumps(modules[:2]))  # without them: MEAN, as configured
    assert load_pooler_config(tmp_path).pooling_type == "MEAN"
