"""The model runner's device-independent parts on CPU: persistent input buffers and decode-graph padding (with
``EagerCapturer`` standing in for CUDA graphs), capture sizes, and the KV budget arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core_svc.cuda_graphs import DecodeGraphs, EagerCapturer, Forward, cuda_graph_capture_sizes
from core_svc.engine_core import EngineCore
from core_svc.gpu_memory import MemoryProfile, MemorySnapshot, check_free_memory, num_kv_blocks_for_budget
from core_svc.input_buffers import BufferLimits, InputBuffers
from core_svc.request import Request
from core_svc.sampling_params import SamplingParams
from tests.helpers import make_engine

GIB = 2**30
MAX_NUM_SEQS = 8


class CountingCapturer(EagerCapturer):
    """EagerCapturer that counts replays per captured size (capture order too)."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays: dict[int, int] = {}

    def capture(self, forward: Forward) -> Forward:
        size = len(forward())  # hidden [size, hidden_size]
        self.captured.append(size)

        def replay() -> torch.Tensor:
            self.replays[size] = self.replays.get(size, 0) + 1
            return forward()

        return replay


def test_capture_sizes_follow_vllms_list_up_to_the_limit():
    assert cuda_graph_capture_sizes(128, 2048) == [1, 2, 4, *range(8, 129, 8)]
    assert cuda_graph_capture_sizes(5, 2048) == [1, 2, 4, 5]  # the limit itself, so a batch of 5 has a graph
    assert cuda_graph_capture_sizes(20, 2048) == [1, 2, 4, 8, 16, 20]
    assert cuda_graph_capture_sizes(64, 12) == [1, 2, 4, 8, 12]  # no more rows than the token budget
    assert cuda_graph_capture_sizes(1, 2048) == [1]


def test_padded_size_is_the_next_captured_size():
    graphs = DecodeGraphs([1, 2, 4, 8, 16])
    assert [graphs.padded_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, None]


def test_pad_rows_read_and_write_only_the_null_block():
    buffers = InputBuffers(
        BufferLimits(max_num_batched_tokens=16, max_num_seqs=8, max_num_blocks_per_req=4), torch.device("cpu")
    )
    buffers.clear_block_table(3, 2)
    buffers.block_table.np[:3, :2] = [[5, 6], [7, 8], [9, 10]]
    buffers.input_ids.np[:8] = 99  # stale values of an earlier, larger step
    buffers.seq_lens.np[:8] = 50
    buffers.query_start_loc.np[:4] = [0, 1, 2, 3]
    buffers.pad_decode_rows(3, 8)
    assert buffers.input_ids.np[:8].tolist() == [99, 99, 99, 0, 0, 0, 0, 0]
    assert buffers.positions.np[3:8].tolist() == [0] * 5 and buffers.slot_mapping.np[3:8].tolist() == [0] * 5
    assert buffers.seq_lens.np[:8].tolist() == [50, 50, 50, 1, 1, 1, 1, 1]
    assert buffers.query_start_loc.np[:9].tolist() == list(range(9))
    assert not buffers.block_table.np[3:8].any() and buffers.block_table.np[2].tolist() == [9, 10, 0, 0]
    # The next step clears what this one wrote (only the corner it used).
    buffers.clear_block_table(1, 1)
    assert not buffers.block_table.np.any()


def test_cpu_buffers_are_their_own_device_tensors():
    buffers = InputBuffers(BufferLimits(16, 8, 4), torch.device("cpu"))
    buffers.input_ids.np[:3] = [4, 5, 6]
    device_rows = buffers.input_ids.copy_to_device(3)
    assert device_rows.data_ptr() == buffers.input_ids.host.data_ptr() and device_rows.tolist() == [4, 5, 6]
    assert not buffers.input_ids.host.is_pinned()


def graph_engine(checkpoint, **overrides: object) -> EngineCore:
    config: dict[str, object] = {
        "attention_backend": "torch_ref",
        "num_kv_blocks": 48,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_model_len": 96,
        "block_size": 16,
    }
    return make_engine(checkpoint("llama"), **(config | overrides))


def generate(engine: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=p))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def prompts_of(num: int) -> list[list[int]]:
    rng = np.random.default_rng(num)
    return [rng.integers(3, 200, size=int(rng.integers(4, 30))).tolist() for _ in range(num)]


@pytest.mark.parametrize("num_reqs", [3, 5])
def test_padded_decode_replays_give_the_eager_tokens(checkpoint, num_reqs):
    """Greedy and seeded random requests together: the padded replays (3 -> 4, 5 -> 8) give exactly the eager
    unpadded path's tokens, and every decode step of the batch replayed its padded size."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=8, ignore_eos=True)
        for i in range(num_reqs)
    ]
    prompts = prompts_of(num_reqs)
    eager = generate(graph_engine(checkpoint), prompts, params)
    engine = graph_engine(checkpoint)
    capturer = CountingCapturer()
    engine.model_runner.capture_decode_graphs(capturer)
    assert capturer.captured == [8, 4, 2, 1]  # largest first
    graphed = generate(engine, prompts, params)
    assert graphed == eager
    assert all(len(tokens) == 8 for tokens in eager.values())
    padded = 4 if num_reqs == 3 else 8
    # One prefill step samples the first token; the 7 later tokens come from decode steps of the whole batch.
    assert capturer.replays == {padded: 7}


def test_padded_decode_replays_under_the_triton_backend_give_its_eager_tokens(checkpoint):
    """The backend that replays on CUDA (``triton``, interpreted here): reading only device tensors, its padded
    replays (3 -> 4, pad rows on the null block) give the tokens of its own eager, unpadded steps."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
    ]
    prompts = prompts_of(3)
    settings = {"attention_backend": "triton", "max_num_seqs": 4}  # graphs of 1, 2 and 4: fewer interpreted captures
    eager = generate(graph_engine(checkpoint, **settings), prompts, params)
    engine = graph_engine(checkpoint, **settings)
    assert engine.model_runner.model.model.layers[0].self_attn.backend.supports_cuda_graphs
    capturer = CountingCapturer()
    engine.model_runner.capture_decode_graphs(capturer)
    assert generate(engine, prompts, params) == eager
    assert capturer.replays == {4: 3}


def test_pad_rows_leave_real_requests_kv_blocks_alone(checkpoint):
    """In a replayed step of 3 requests padded to 4, the KV cache changes at the 3 requests' new slots and, at
    most, in the null block: nowhere else."""
    engine = graph_engine(checkpoint)
    engine.model_runner.capture_decode_graphs(CountingCapturer())
    for i, prompt in enumerate(prompts_of(3)):
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.add_request(Request(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params))
    engine.step()  # the prefills
    runner = engine.model_runner
    states = [runner.requests[f"r{i}"] for i in range(3)]
    # The decode step computes each request's last sampled token, at position len(tokens) - 1.
    expected_slots = set()
    for state in states:
        position = len(state.token_ids) - 1
        expected_slots.add(state.block_ids[position // 16] * 16 + position % 16)
    before = [cache.clone() for cache in runner.kv_caches]
    engine.step()
    assert runner.buffers.seq_lens.np[3] == 1  # the step was padded
    for old, new in zip(before, runner.kv_caches, strict=True):
        changed = (old != new).flatten(start_dim=3).any(dim=-1).any(dim=0)  # [num_blocks, block_size]
        changed_slots = set(torch.nonzero(changed.flatten()).flatten().tolist())
        assert changed_slots - set(range(16)) == expected_slots  # block 0 holds slots 0..15


def test_prefill_steps_and_batches_above_the_largest_size_run_eagerly(checkpoint):
    """With graphs of sizes 1, 2 and 4 only, a batch of 5 decodes eagerly (same tokens as without graphs), and
    mixed or prefill steps never replay."""
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for _ in range(5)]
    prompts = prompts_of(5)
    eager = generate(graph_engine(checkpoint), prompts, params)
    engine = graph_engine(checkpoint)
    capturer = CountingCapturer()
    runner = engine.model_runner
    graphs = DecodeGraphs([1, 2, 4])
    graphs.capture(runner._decode_graph_forward, capturer)
    runner.decode_graphs = graphs
    assert generate(engine, prompts, params) == eager
    assert capturer.replays == {}
    # Budget 40: step 1 prefills r0 (30) and r1's first 10; step 2 mixes r0's decode with r1's last 20 and r2's
    # 3 (eager); steps 3-6 decode all three (3 -> 4), step 7 r1 and r2 (2), as they finish one step after r0.
    engine = graph_engine(checkpoint, max_num_batched_tokens=40)
    capturer = CountingCapturer()
    engine.model_runner.capture_decode_graphs(capturer)
    long_prompts = [list(range(3, 33)), list(range(40, 70)), list(range(80, 83))]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True) for _ in range(3)]
    reference = generate(graph_engine(checkpoint, max_num_batched_tokens=40), long_prompts, params)
    assert generate(engine, long_prompts, params) == reference
    assert capturer.replays == {4: 4, 2: 1}


def test_kv_budget_follows_vllms_formula():
    """Hand-worked: 80 GiB device, 0.9 of it requested (72 GiB); 16 GiB of weights loaded since the baseline,
    the profile run peaks 3 GiB above what was allocated when it began, and 0.5 GiB appeared outside torch
    (library workspaces): 72 - 16 - 3 - 0.5 = 52.5 GiB for the KV cache."""
    baseline = MemorySnapshot(
        total_bytes=80 * GIB, free_bytes=79 * GIB, torch_allocated_bytes=0, torch_reserved_bytes=0, torch_peak_bytes=0
    )  # 1 GiB used: the CUDA context and another process, outside the budget
    before = MemorySnapshot(80 * GIB, 63 * GIB, 16 * GIB, 16 * GIB, 16 * GIB)
    # After: torch holds 16.25 GiB (some cached), peak 19 GiB; used 18.75 GiB = 16.25 torch + 2.5 non-torch.
    after = MemorySnapshot(80 * GIB, 80 * GIB - 18.75 * GIB, 16 * GIB, 16.25 * GIB, 19 * GIB)
    profile = MemoryProfile.from_snapshots(baseline, before, after, 0.9)
    assert profile.requested_bytes == int(72 * GIB)
    assert profile.weights_bytes == 16 * GIB
    assert profile.peak_activation_bytes == 3 * GIB
    assert profile.non_torch_increase_bytes == 1.5 * GIB  # 2.5 GiB non-torch now, 1 GiB at the baseline
    assert profile.available_kv_cache_bytes == int(72 * GIB - 16 * GIB - 3 * GIB - 1.5 * GIB)
    # Blocks of 16 tokens x 2 (K, V) x 24 layers x 2 KV heads x 64 dims x 2 bytes = 196,608 bytes.
    assert num_kv_blocks_for_budget(profile.available_kv_cache_bytes, 196_608) == int(51.5 * GIB) // 196_608
    assert num_kv_blocks_for_budget(-GIB, 196_608) == 0


def test_a_device_with_less_free_memory_than_requested_is_refused():
    snapshot = MemorySnapshot(80 * GIB, 70 * GIB, 0, 0, 0)
    check_free_memory(snapshot, 0.85)  # 68 GiB requested, 70 free
    with pytest.raises(ValueError, match=r"free memory on the device \(70\.00/80\.00 GiB\).*72\.00 GiB"):
        check_free_memory(snapshot, 0.9)


def test_profile_run_forwards_the_largest_step_and_samples_every_row(checkpoint):
    """max_num_batched_tokens 2048 but 8 requests of at most 96 tokens: 768 tokens in 8 prefills of 96, then the
    sampler on 8 rows with top-k and top-p; without a KV cache the runner allocates none of its own."""
    engine = graph_engine(checkpoint)
    runner = engine.model_runner
    runner.kv_caches = []
    forwarded: list[tuple[int, list[int]]] = []
    sampled_rows: list[tuple[int, bool, bool]] = []

    def record_forward(module, args, output):
        forwarded.append((args[0].shape[0], args[3].seq_lens_cpu))

    sampler = runner.sampler

    def record_sampler(logits, metadata):
        sampled_rows.append((logits.shape[0], metadata.top_k is not None, metadata.top_p is not None))
        return sampler(logits, metadata)

    runner.model.register_forward_hook(record_forward)
    runner.sampler = record_sampler  # type: ignore[assignment]  # a recording stand-in with the same call
    runner.profile_run()
    assert forwarded == [(768, [96] * 8)]
    assert sampled_rows == [(8, True, True)]
    assert runner.kv_caches == []


def test_engine_sizes_the_kv_cache_from_the_measured_profile(checkpoint, monkeypatch, caplog):
    """The CUDA branch of the engine's KV sizing with the measurement stubbed (CPU has no CUDA memory to
    measure): blocks are the budget over a block's bytes, logged as vLLM's line; a budget of no block is refused
    with the numbers."""
    from types import SimpleNamespace

    from core_svc import gpu_memory

    engine = graph_engine(checkpoint, num_kv_blocks=None)
    arch = engine.model_runner.arch
    bytes_per_block = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_size * 4 * 16  # float32
    profile = MemoryProfile(
        total_bytes=10 * GIB,
        gpu_memory_utilization=0.5,
        weights_bytes=GIB,
        peak_activation_bytes=GIB // 2,
        non_torch_increase_bytes=GIB // 4,
    )  # 5 - 1 - 0.5 - 0.25 = 3.25 GiB
    measured: list[object] = []

    def fake_measure(device, profile_run, baseline, utilization):
        measured.append((profile_run, baseline, utilization))
        return profile

    monkeypatch.setattr(gpu_memory, "measure_profile_run", fake_measure)
    baseline = MemorySnapshot(10 * GIB, 10 * GIB, 0, 0, 0)
    loaded = SimpleNamespace(arch=arch)
    with caplog.at_level("INFO", logger="core_svc.engine_core"):
        num_blocks = engine._num_kv_blocks(loaded, baseline)  # type: ignore[arg-type]  # only .arch is read
    assert num_blocks == int(3.25 * GIB) // bytes_per_block
    assert measured == [(engine.model_runner.profile_run, baseline, 0.9)]
    assert "Available KV cache memory: 3.25 GiB" in caplog.messages
    profile = MemoryProfile(10 * GIB, 0.5, 5 * GIB, GIB, 0)
    with pytest.raises(ValueError, match=r"weights 5\.00 GiB, peak activations 1\.00 GiB.*KV cache -1\.00 GiB"):
        engine._num_kv_blocks(loaded, baseline)  # type: ignore[arg-type]  # only .arch is read
