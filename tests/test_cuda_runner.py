"""The model runner on a real GPU: KV cache sized from free memory, CUDA graphs against eager, pinned staging
buffers, and sampling without host syncs. Skipped without CUDA."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from core_svc.cuda_graphs import CudaGraphCapturer
from core_svc.input_batch import CachedRequestState, build_sampling_metadata
from core_svc.request import Request
from core_svc.sampler import Sampler
from core_svc.sampling_params import SamplingParams
from tests.helpers import make_engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)"),
]

GIB = 2**30


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int = 12) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 33, 9, 40)]


def test_kv_cache_is_sized_from_free_memory(checkpoint, caplog):
    """With 5% of the GPU requested, the KV cache takes what the weights and the profile run leave of it: torch
    holds at most the requested share afterwards, and no more than the measured non-KV memory less."""
    gc.collect()  # engines of earlier tests
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved()
    free_bytes, total_bytes = torch.cuda.mem_get_info()
    utilization = 0.05
    if free_bytes < total_bytes * utilization:
        pytest.skip(f"only {free_bytes / GIB:.1f} GiB free")
    with caplog.at_level(logging.INFO, logger="core_svc.engine_core"):
        engine = make_engine(
            checkpoint("llama"),
            device="cuda",
            attention_backend="torch_ref",  # any head size; the sizing does not depend on the backend
            gpu_memory_utilization=utilization,
            enforce_eager=True,
        )
    runner = engine.model_runner
    requested = int(total_bytes * utilization)
    kv_bytes = sum(cache.nbytes for cache in runner.kv_caches)
    weights_bytes = sum(p.nbytes for p in runner.model.parameters()) + sum(b.nbytes for b in runner.model.buffers())
    assert kv_bytes <= requested - weights_bytes
    # What is left besides weights and KV: a small model's activations and library workspaces, well under 1 GiB.
    assert kv_bytes > requested - weights_bytes - GIB
    # torch's own growth stays within the share (rounding of the per-layer allocations aside).
    assert torch.cuda.memory_reserved() - reserved_before <= requested + 64 * 2**20
    messages = [record.getMessage() for record in caplog.records]
    available = [m for m in messages if m.startswith("Available KV cache memory: ")]
    assert len(available) == 1
    budget_gib = float(available[0].removeprefix("Available KV cache memory: ").removesuffix(" GiB"))
    bytes_per_block = kv_bytes // engine.num_kv_blocks
    assert engine.num_kv_blocks == pytest.approx(budget_gib * GIB / bytes_per_block, rel=0.01)
    assert any(m.startswith(f"GPU KV cache size: {(engine.num_kv_blocks - 1) * 16:,} tokens") for m in messages)


def test_cuda_graphs_give_the_eager_tokens(checkpoint):
    """Decode graphs captured through the runner's own capture (explicitly: torch_ref declares no graph support
    because it reads the ``*_cpu`` lists, which the runner's replay metadata makes valid for every replay, so it
    replays correctly; the tiny model's head size 16 suits it), 5 requests padded to 8, then fewer as they finish:
    the same greedy tokens as eager steps. The default backend's graphs against --enforce-eager:
    ``tests/test_cuda_engine.py``."""
    path = checkpoint("llama")
    overrides = {"device": "cuda", "attention_backend": "torch_ref", "num_kv_blocks": 64, "max_num_seqs": 8}
    eager = greedy_tokens(make_engine(path, enforce_eager=True, **overrides), PROMPTS)
    engine = make_engine(path, enforce_eager=True, **overrides)
    engine.model_runner.capture_decode_graphs(CudaGraphCapturer(torch.device("cuda")))
    assert engine.model_runner.decode_graphs is not None
    assert greedy_tokens(engine, PROMPTS) == eager


def test_input_buffers_are_pinned_and_copied_to_the_gpu(checkpoint):
    engine = make_engine(
        checkpoint("llama"), device="cuda", attention_backend="torch_ref", num_kv_blocks=32, enforce_eager=True
    )
    buffers = engine.model_runner.buffers
    for buffer in (buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.block_table, buffers.seq_lens):
        assert buffer.host.is_pinned() and buffer.host.device.type == "cpu"
        assert buffer.device.device.type == "cuda"
    assert greedy_tokens(engine, PROMPTS[:2], max_tokens=3)  # a step through them works
    assert buffers.input_ids.device[:2].tolist() == buffers.input_ids.host[:2].tolist()


def test_sampling_does_not_sync_the_host():
    """Sampler inputs with every per-row feature, and the sampler itself, run under torch's sync debug mode set
    to raise on any synchronizing call."""
    vocab_size = 1000
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, min_tokens=4, eos_token_id=2),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.1),
        SamplingParams(temperature=1.0, logit_bias={5: 3.0}, allowed_token_ids=[5, 6, 7]),
    ]
    device = torch.device("cuda")
    states = [
        CachedRequestState(f"r{i}", [1, 2, 3], p, torch.Generator(device).manual_seed(3) if p.seed else None, [], 0)
        for i, p in enumerate(params)
    ]
    for state in states:
        state.token_ids.extend([5, 9])
    logits = torch.randn(len(states), vocab_size, device=device)
    sampler = Sampler(torch.Generator(device).manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        output = sampler(logits, build_sampling_metadata(states, vocab_size, device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sampled = output.sampled_token_ids.tolist()
    assert sampled[0] == logits[0].argmax().item()
    assert sampled[3] in (5, 6, 7)
