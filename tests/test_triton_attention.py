"""The triton attention backend against the torch reference backend (the oracle): mixed batches of decodes, a fresh
prefill and a chunk after a cached prefix ending mid-block, GQA, sliding windows, each head size, block size and
dtype; small decode batches through split-KV; the KV write bit for bit; padding rows of a CUDA-graph batch; the
kernels compiled for a GPU; the selector's rules; and the whole engine core token-exact with ``torch_ref``.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set by conftest.py
before anything imports triton), which runs every program in Python: shapes stay tiny.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():  # a driver without a usable GPU: conftest.py saw nvidia-smi and left it unset
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the triton package is not installed (pip install triton)")

from core_svc.config import ATTENTION_BACKEND_NAMES  # noqa: E402
from kernels import AttentionMetadata, get_attention_backend  # noqa: E402
from kernels.attention import selector  # noqa: E402
from kernels.attention.cpu import CpuAttentionBackend  # noqa: E402
from kernels.attention.torch_ref import TorchRefAttentionBackend  # noqa: E402
from kernels.attention.triton_attn import (  # noqa: E402
    TritonAttentionBackend,
    num_kv_segments,
    reshape_and_cache,
    unified_attention,
)
from kernels.attention.triton_kernels import INTERPRETED  # noqa: E402
from splitserve.base import envs  # noqa: E402
from tests.helpers import make_engine, run_engine  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRETED else "cuda")
# (tokens already cached, tokens this step), decodes first as the model runner orders them: decodes after 40 cached
# tokens (two 32-key tiles), none and 9, a fresh 7-token prefill, and a 6-token chunk after 19 cached tokens
# (mid-block for block sizes 16 and 32).
REQUESTS = [(40, 1), (0, 1), (9, 1), (0, 7), (19, 6)]
# Against the float32 oracle on the same rounded inputs, so the tolerance is the kernel's own rounding: float32
# only reorders sums; float16 rounds its probabilities for the P.V dot (as vLLM and flash-attention do) and its
# output, 2^-11 relative each, so 2e-3 leaves about two ulps; bfloat16 rounds the output (2^-9 relative; the
# interpreter may land one ulp off torch's rounding) and on a GPU its probabilities too, so 1e-2, about 2.5 ulps.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclasses.dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]: unwritten slots NaN
    metadata: AttentionMetadata


def make_batch(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> Batch:
    """Random queries, keys and values; each request's cached tokens written in scattered blocks of a cache whose
    unwritten slots are NaN (so a read the masks should have stopped shows in the output)."""
    gen = torch.Generator().manual_seed(seed)
    tables = []
    num_blocks = 1 + sum(-((cached + new) // -block_size) for cached, new in requests)
    free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    slots, keys, values = [], [], []
    for cached, new in requests:
        seq_len = cached + new
        table = [free_blocks.pop() for _ in range(-(seq_len // -block_size))]
        tables.append(table)
        request_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        cached_kv = torch.randn(2, cached, num_kv_heads, head_size, generator=gen).to(dtype)
        flat[:, request_slots[:cached]] = cached_kv
        slots += request_slots[cached:]
        keys.append(torch.randn(new, num_kv_heads, head_size, generator=gen).to(dtype))
        values.append(torch.randn(new, num_kv_heads, head_size, generator=gen).to(dtype))
    max_blocks = max(len(t) for t in tables) + 1  # a spare column of null blocks, as the model runner pads
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    num_decodes = sum(1 for _, new in requests if new == 1)
    metadata = AttentionMetadata.for_requests(block_table, requests, block_size, num_decodes)
    query_start_loc = metadata.query_start_loc_cpu
    assert metadata.slot_mapping.tolist() == slots
    query = torch.randn(query_start_loc[-1], num_heads, head_size, generator=gen).to(dtype)
    return Batch(query, torch.cat(keys), torch.cat(values), kv_cache, metadata)


def graph_safe(metadata: AttentionMetadata) -> AttentionMetadata:
    """The device tensors only: host-side fields poisoned, so a backend reading them fails or goes wrong."""
    return dataclasses.replace(
        metadata, query_start_loc_cpu=[], seq_lens_cpu=[], max_query_len=-1, max_seq_len=-1, num_decodes=-1
    )


def on_device(metadata: AttentionMetadata) -> AttentionMetadata:
    tensors = ("slot_mapping", "query_start_loc", "seq_lens", "block_table")
    return dataclasses.replace(metadata, **{name: getattr(metadata, name).to(DEVICE) for name in tensors})


def reference(batch: Batch, scale: float, window: int | None) -> torch.Tensor:
    """torch_ref in float32 on the same (rounded) inputs, over a cache whose unwritten slots are 0 (its gathers
    read whole blocks, and a masked NaN would still poison its matmul)."""
    kv_cache = batch.kv_cache.float().nan_to_num(0.0)
    backend = TorchRefAttentionBackend()
    return backend.forward(
        batch.query.float(), batch.key.float(), batch.value.float(), kv_cache, batch.metadata, scale, window
    )


def run_triton(batch: Batch, scale: float, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, kv_cache after the write), from the triton backend given only graph-safe metadata."""
    kv_cache = batch.kv_cache.to(DEVICE)
    metadata = on_device(graph_safe(batch.metadata))
    out = TritonAttentionBackend(DEVICE).forward(
        batch.query.to(DEVICE), batch.key.to(DEVICE), batch.value.to(DEVICE), kv_cache, metadata, scale, window
    )
    return out.cpu(), kv_cache.cpu()


def expected_cache(batch: Batch) -> torch.Tensor:
    """The cache with the step's keys and values stored at their slots, by plain indexing."""
    kv_cache = batch.kv_cache.clone()
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0, batch.metadata.slot_mapping] = batch.key
    flat[1, batch.metadata.slot_mapping] = batch.value
    return kv_cache


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so NaN slots compare equal to themselves."""
    return t.contiguous().view(torch.uint8)


# Each head size, block size, dtype and GQA ratio at least once, not their cross product (the interpreter is slow).
CASES = [
    # head_size, block_size, num_heads, num_kv_heads, dtype, sliding_window
    pytest.param(64, 16, 8, 2, torch.float32, None, id="d64-b16-gqa4-f32"),
    pytest.param(80, 32, 2, 2, torch.float16, None, id="d80-b32-mha-f16"),
    pytest.param(96, 16, 6, 2, torch.bfloat16, 7, id="d96-b16-gqa3-bf16-window7"),
    pytest.param(128, 32, 4, 1, torch.float32, 5, id="d128-b32-gqa4-f32-window5"),
    pytest.param(64, 32, 4, 4, torch.bfloat16, None, id="d64-b32-mha-bf16"),
    pytest.param(128, 16, 8, 2, torch.float16, 20, id="d128-b16-gqa4-f16-window20"),
]


@pytest.mark.parametrize(("head_size", "block_size", "num_heads", "num_kv_heads", "dtype", "window"), CASES)
def test_mixed_batch_matches_the_reference(head_size, block_size, num_heads, num_kv_heads, dtype, window):
    batch = make_batch(REQUESTS, num_heads, num_kv_heads, head_size, block_size, dtype)
    scale = head_size**-0.5

    out, kv_cache = run_triton(batch, scale, window)

    assert out.shape == batch.query.shape and out.dtype == dtype
    assert torch.equal(bits(kv_cache), bits(expected_cache(batch))), "the KV write is not bit for bit"
    expected = reference(batch, scale, window)
    tol = TOLERANCES[dtype]
    starts = batch.metadata.query_start_loc_cpu
    for i in range(len(REQUESTS)):
        rows = slice(starts[i], starts[i + 1])
        torch.testing.assert_close(out[rows].float(), expected[rows], atol=tol, rtol=tol, msg=f"request {i}")


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype", "window"),
    [
        pytest.param(14, 2, torch.bfloat16, None, id="gqa7-bf16"),
        pytest.param(8, 2, torch.float32, 20, id="gqa4-f32-window20"),
    ],
)
def test_small_decode_batch_splits_the_keys_and_matches_the_reference(num_heads, num_kv_heads, dtype, window):
    """Decodes only (one query token per request, by shape) in a batch too small to fill a GPU: split-KV, each
    request's keys shared among segments (some empty) and the partial softmaxes reduced. Context lengths of 7 tiles
    (more than the segments), under one tile, and a padding row with seq_len 0."""
    requests = [(200, 1), (5, 1), (37, 1), (0, 1)]
    batch = make_batch(requests, num_heads, num_kv_heads, 64, 16, dtype)
    batch.metadata.seq_lens[3] = 0
    batch.metadata.slot_mapping[3] = -1
    assert num_kv_segments(len(requests), len(requests), num_kv_heads) > 1

    out, kv_cache = run_triton(batch, 0.125, window)

    assert torch.equal(out[3], torch.zeros_like(out[3]))
    m = batch.metadata  # the reference over the three real decodes alone
    real = Batch(
        batch.query[:3],
        batch.key[:3],
        batch.value[:3],
        batch.kv_cache,
        dataclasses.replace(
            m,
            slot_mapping=m.slot_mapping[:3],
            query_start_loc=m.query_start_loc[:4],
            seq_lens=m.seq_lens[:3],
            block_table=m.block_table[:3],
            query_start_loc_cpu=m.query_start_loc_cpu[:4],
            seq_lens_cpu=m.seq_lens_cpu[:3],
            num_decodes=3,
        ),
    )
    expected = reference(real, 0.125, window)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:3].float(), expected, atol=tol, rtol=tol)


def test_only_small_decode_batches_are_split():
    assert num_kv_segments(num_tokens=8, num_reqs=8, num_kv_heads=2) > 1
    assert num_kv_segments(num_tokens=9, num_reqs=8, num_kv_heads=2) == 1  # a prefill chunk among them
    assert num_kv_segments(num_tokens=64, num_reqs=64, num_kv_heads=2) == 1  # 128 programs fill the GPU unsplit


def test_padding_rows_of_a_graph_batch_give_zeros_and_write_nothing():
    """A decode batch padded as vLLM pads its CUDA-graph batches: padding rows have slot -1 (vLLM's PAD_SLOT_ID),
    seq_len 0 and a block table of null blocks (the model runner pads with rows on the null block instead, which
    every backend handles unchanged: tests/test_model_runner.py). They store nothing and attend to nothing
    (zeros, never NaN), while the real rows are unaffected."""
    batch = make_batch([(21, 1), (3, 1)], 4, 2, 64, 16, torch.float32)
    padded = make_batch([(21, 1), (3, 1), (0, 1), (0, 1)], 4, 2, 64, 16, torch.float32)
    padded.query[:2], padded.key[:2], padded.value[:2] = batch.query, batch.key, batch.value
    padded.kv_cache = torch.cat([batch.kv_cache, batch.kv_cache[:, :2]], dim=1)  # room for the pads' would-be slots
    m = padded.metadata
    m.slot_mapping = torch.cat([batch.metadata.slot_mapping, torch.tensor([-1, -1])])
    m.seq_lens[2:] = 0
    m.block_table = torch.cat([batch.metadata.block_table, torch.zeros(2, batch.metadata.block_table.shape[1])])
    m.block_table = m.block_table.to(torch.int32)

    out, kv_cache = run_triton(padded, 0.125, None)

    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    unpadded_out, unpadded_cache = run_triton(batch, 0.125, None)
    assert torch.equal(out[:2], unpadded_out)
    assert torch.equal(bits(kv_cache[:, : batch.kv_cache.shape[1]]), bits(unpadded_cache))
    assert torch.equal(
        bits(kv_cache[:, batch.kv_cache.shape[1] :]), bits(padded.kv_cache[:, batch.kv_cache.shape[1] :])
    )


def test_an_empty_batch_launches_nothing():
    kv_cache = torch.zeros(2, 2, 16, 2, 64, device=DEVICE)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros(0, 1, dtype=torch.int32, device=DEVICE),
        query_start_loc_cpu=[0],
        seq_lens_cpu=[],
        max_query_len=0,
        max_seq_len=0,
    )
    empty = torch.zeros(0, 2, 64, device=DEVICE)
    out = TritonAttentionBackend(DEVICE).forward(empty.repeat(1, 2, 1), empty, empty, kv_cache, metadata, 0.125, None)
    assert out.shape == (0, 4, 64) and torch.equal(kv_cache, torch.zeros_like(kv_cache))


def test_bad_inputs_are_refused_by_name():
    batch = make_batch([(0, 2)], 4, 2, 64, 16, torch.float32)
    k_cache, v_cache = batch.kv_cache[0], batch.kv_cache[1]
    with pytest.raises(ValueError, match=r"slot_mapping must be \[2\] int64, got \(2,\) torch.int32"):
        reshape_and_cache(batch.key, batch.value, k_cache, v_cache, batch.metadata.slot_mapping.int())
    with pytest.raises(ValueError, match="must share a dtype"):
        reshape_and_cache(batch.key.half(), batch.value.half(), k_cache, v_cache, batch.metadata.slot_mapping)
    m, out = batch.metadata, torch.empty_like(batch.query)
    with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
        q = batch.query[:, :3]
        unified_attention(q, k_cache, v_cache, out[:, :3], m.query_start_loc, m.seq_lens, m.block_table, 1.0, None)
    with pytest.raises(ValueError, match="seq_lens must be \\[1\\] int32, got \\(1,\\) torch.int64"):
        args = (m.query_start_loc, m.seq_lens.long(), m.block_table)
        unified_attention(batch.query, k_cache, v_cache, out, *args, 1.0, None)
    with pytest.raises(ValueError, match="sliding_window must be None or >= 1, got 0"):
        unified_attention(batch.query, k_cache, v_cache, out, m.query_start_loc, m.seq_lens, m.block_table, 1.0, 0)


# Compiles the kernels for an H100/H200 (sm_90) through ptxas to a cubin, without a GPU, with the launch constants
# the backend would use: the interpreter runs the kernels' Python, not Triton's compiler, so this is what shows they
# compile (loop-carried types, bfloat16 dots, constexpr branches). Run apart: this process decorated them for the
# interpreter.
_COMPILE_SCRIPT = textwrap.dedent(
    """
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.attention import triton_attn, triton_kernels

    assert not triton_kernels.INTERPRETED
    TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

    def compile_kernel(kernel, types, constants):
        signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in kernel.arg_names}
        constexprs = {(kernel.arg_names.index(n),): v for n, v in constants.items()}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
        return len(compiled.asm["cubin"])

    # (dtype, num_heads, num_kv_heads, head_size, block_size, sliding_window, batch as (num_tokens, num_reqs)):
    # Qwen2.5-0.5B's layer (bfloat16 tensor-core dots) in a decode batch of 8, split-KV; float32's IEEE dots with
    # GQA 4, a padded head size and a window, in a mixed batch
    for dtype, num_heads, num_kv_heads, head_size, block_size, window, batch in [
        (torch.bfloat16, 14, 2, 64, 16, None, (8, 8)),
        (torch.float32, 4, 1, 80, 32, 7, (40, 3)),
    ]:
        t = "*" + TYPES[dtype]
        pointers = dict.fromkeys(["output_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr"], t)
        pointers.update(dict.fromkeys(["segment_max_ptr", "segment_sum_ptr", "segment_acc_ptr"], "*fp32"))
        pointers.update(block_table_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", scale_log2="fp32")
        constants = triton_attn.unified_attention_constants(
            num_heads, num_kv_heads, head_size, block_size, dtype, window
        )
        constants["NUM_SEGMENTS"] = triton_attn.num_kv_segments(*batch, num_kv_heads)
        print("attention", dtype, compile_kernel(triton_kernels.unified_attention_kernel, pointers, constants))
        if constants["NUM_SEGMENTS"] > 1:
            reduce_constants = {k: constants[k] for k in ("NUM_SEGMENTS", "HEAD_SIZE_PADDED")}
            print("reduce", compile_kernel(triton_kernels.reduce_segments_kernel, pointers, reduce_constants))
    pointers = dict.fromkeys(["key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"], "*bf16")
    pointers["slot_mapping_ptr"] = "*i64"
    constants = triton_attn.reshape_and_cache_constants(2, 64)
    print("kv write", compile_kernel(triton_kernels.reshape_and_cache_kernel, pointers, constants))
    """
)


@pytest.mark.slow
def test_kernels_compile_for_a_gpu_without_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from an earlier run's cache
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and all(int(line.rsplit(" ", 1)[1]) > 0 for line in lines), done.stdout


def test_selector_names_match_the_core_config():
    assert selector.BACKEND_NAMES == ATTENTION_BACKEND_NAMES


def test_only_the_triton_backend_is_cuda_graph_safe():
    assert TritonAttentionBackend.supports_cuda_graphs is True
    assert TorchRefAttentionBackend.supports_cuda_graphs is False
    assert CpuAttentionBackend.supports_cuda_graphs is False
    # --kv-cache-dtype bfloat16 under float32: the CPU backends round and widen; the CUDA ones store the model's dtype
    assert CpuAttentionBackend.supports_narrow_kv_cache and TorchRefAttentionBackend.supports_narrow_kv_cache
    assert TritonAttentionBackend.supports_narrow_kv_cache is False
    from kernels.attention.flash_attn_backend import FlashAttnBackend  # imports without the flash-attn package

    assert FlashAttnBackend.supports_narrow_kv_cache is False


def test_selector_picks_triton(tmp_path):
    assert get_attention_backend("triton", DEVICE, tmp_path).name == "triton"
    # auto on CUDA: constructing the backend touches no GPU, so this holds on a CPU-only machine too
    # (flash-attn is not installed here: test_flash_attn_backend.py covers the choice when it is)
    assert get_attention_backend("auto", "cuda", tmp_path).name == "triton"


def test_triton_on_cpu_needs_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA device, got cpu; or set TRITON_INTERPRET=1"):
        get_attention_backend("triton", "cpu", tmp_path)


def test_a_cpu_core_never_imports_triton():
    """The selector imports the triton backend only when it is chosen (a fresh process: this one has it)."""
    check = (
        "import sys; from kernels import get_attention_backend; "
        f"get_attention_backend('auto', 'cpu', {str(envs.kernel_dir())!r}); "  # the kernel built by make setup
        "assert not [m for m in sys.modules if m.split('.')[0] == 'triton'], 'triton was imported'"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_triton_without_the_package_names_the_fix(tmp_path, monkeypatch):
    for name in ("kernels.attention.triton_attn", "kernels.attention.triton_kernels"):
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(RuntimeError, match="needs the triton package, which cannot be imported .*pip install triton"):
        get_attention_backend("triton", "cuda", tmp_path)


def test_engine_with_triton_gives_the_reference_tokens(checkpoint):
    """A tiny Mistral (GQA 4:2, head size 16, a sliding window shorter than the prompts) through the whole engine
    core: chunked prefill (chunks ending mid-block), a prefix-cache hit, then decodes; greedy tokens equal to the
    same engine on torch_ref, and logprobs equal within float32 rounding."""
    if DEVICE.type != "cpu":
        pytest.skip("the engine runs on CPU here; the cuda tests cover the GPU engine")
    path = checkpoint("mistral", config_overrides={"sliding_window": 16})
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 200, (20,), generator=gen).tolist()
    prompts = [prefix + [5, 6, 7], prefix + [8, 9], torch.randint(3, 200, (26,), generator=gen).tolist()]
    arrival_steps = [0, 3, 3]  # the second prompt arrives after the first's prefill: its first block is cached
    # 20-token steps: the first prompt's chunk ends mid-block, the second's prefill follows its cached block
    config = {"max_num_batched_tokens": 20, "block_size": 16, "num_kv_blocks": 16}

    results = {}
    for backend in ("torch_ref", "triton"):
        engine = make_engine(path, attention_backend=backend, **config)
        results[backend], _ = run_engine(engine, prompts, 2, arrival_steps)

    assert results["triton"][1].num_cached_tokens == 16  # the shared prefix's full block
    assert [r.token_ids for r in results["triton"]] == [r.token_ids for r in results["torch_ref"]]
    # float32 throughout: the top-5 logprobs of every step agree to float32 rounding of the attention sums
    for ours, ref in zip(results["triton"], results["torch_ref"], strict=True):
        for step_ours, step_ref in zip(ours.logprobs, ref.logprobs, strict=True):
            assert step_ours.keys() == step_ref.keys()
            assert max(abs(step_ours[t] - step_ref[t]) for t in step_ref) < 1e-4
    assert all(len(r.token_ids) == 2 for r in results["triton"])
