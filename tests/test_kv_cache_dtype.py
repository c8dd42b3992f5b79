"""``--kv-cache-dtype``: which caches are served, their size, and the kernel's refusals. Their values are tested
against attention over rounded keys and values (tests/test_attention.py) and transformers with a rounding cache
(tests/test_model_vs_transformers.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from core_svc.config import CoreConfig
from core_svc.engine_core import kv_cache_dtype_for
from tests.helpers import cpu_kernels_loaded, make_engine


def test_unknown_cache_dtypes_are_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16, got 'fp8'"):
        CoreConfig(model="m", kv_cache_dtype="fp8")  # type: ignore[arg-type]  # what a bad flag would pass


def test_which_model_and_backend_take_a_narrower_cache():
    from types import SimpleNamespace

    from kernels.attention.cpu import CpuAttentionBackend
    from kernels.attention.torch_ref import TorchRefAttentionBackend

    triton = SimpleNamespace(name="triton", supports_narrow_kv_cache=False)  # as TritonAttentionBackend declares
    cpu, torch_ref = CpuAttentionBackend, TorchRefAttentionBackend  # the classes declare it
    assert kv_cache_dtype_for("auto", torch.float32, triton) == torch.float32
    assert kv_cache_dtype_for("auto", torch.float16, cpu) == torch.float16
    assert kv_cache_dtype_for("bfloat16", torch.float32, cpu) == torch.bfloat16
    assert kv_cache_dtype_for("bfloat16", torch.float32, torch_ref) == torch.bfloat16
    assert kv_cache_dtype_for("bfloat16", torch.bfloat16, triton) == torch.bfloat16  # the model's own
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 under a float16 model: .* float32 models only"):
        kv_cache_dtype_for("bfloat16", torch.float16, cpu)
    with pytest.raises(ValueError, match="needs the cpu or torch_ref attention backend; the triton backend stores"):
        kv_cache_dtype_for("bfloat16", torch.float32, triton)
    # float32 names a float32 model's own dtype; wider than a 16-bit model's, never served there
    assert kv_cache_dtype_for("float32", torch.float32, triton) == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype float32 under a bfloat16 model: .* float32 models only"):
        kv_cache_dtype_for("float32", torch.bfloat16, cpu)


def test_auto_is_bfloat16_under_int8_weights_of_a_float32_model_where_the_backend_narrows():
    from types import SimpleNamespace

    from kernels.attention.cpu import CpuAttentionBackend
    from kernels.attention.torch_ref import TorchRefAttentionBackend

    triton = SimpleNamespace(name="triton", supports_narrow_kv_cache=False)
    for backend in (CpuAttentionBackend, TorchRefAttentionBackend):
        assert kv_cache_dtype_for("auto", torch.float32, backend, "int8") == torch.bfloat16
        assert kv_cache_dtype_for("float32", torch.float32, backend, "int8") == torch.float32  # the way back
        assert kv_cache_dtype_for("auto", torch.bfloat16, backend, "int8") == torch.bfloat16  # the model's own
        assert kv_cache_dtype_for("auto", torch.float32, backend, None) == torch.float32
    assert kv_cache_dtype_for("auto", torch.float32, triton, "int8") == torch.float32  # auto never refuses


def test_an_int8_engine_keeps_bfloat16_keys_by_default_and_float32_ones_when_asked(checkpoint, caplog):
    path = checkpoint("llama")
    budget = {"kv_cache_memory_gib": 0.01, "quantization": "int8"}
    with caplog.at_level(logging.INFO, logger="core_svc.engine_core"):
        default = make_engine(path, **budget)
    kept = make_engine(path, kv_cache_dtype="float32", **budget)
    assert default.dtype == kept.dtype == torch.float32
    assert default.model_runner.kv_caches[0].dtype == torch.bfloat16
    assert kept.model_runner.kv_caches[0].dtype == torch.float32
    arch = kept.arch
    per_block = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_size * kept.config.block_size
    assert (default.num_kv_blocks, kept.num_kv_blocks) == (
        int(0.01 * 2**30) // (2 * per_block),
        int(0.01 * 2**30) // (4 * per_block),
    )
    assert any("KV cache in bfloat16 under int8 weights" in r.message for r in caplog.records)


def test_what_the_flags_alone_rule_out_is_refused_before_anything_loads():
    """A float32 model on a backend that stores the model's dtype; what depends on the checkpoint's dtype (auto) or
    on the CPU (a float16 model may load as float32) is the engine's to check."""
    for backend in ("triton", "flash_attn"):
        with pytest.raises(ValueError, match=f"attention backend; the {backend} backend stores keys and values"):
            CoreConfig(model="m", dtype="float32", attention_backend=backend, kv_cache_dtype="bfloat16")
        config = CoreConfig(model="m", dtype="bfloat16", attention_backend=backend, kv_cache_dtype="bfloat16")
        assert config.kv_cache_dtype == "bfloat16"  # the model's own dtype: served anywhere
    assert CoreConfig(model="m", dtype="float16", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    # a float32 cache under a 16-bit model on CUDA (on CPU the dtype may load as float32: the engine decides)
    with pytest.raises(ValueError, match="kv_cache_dtype float32 under a bfloat16 model: .* float32 models only"):
        CoreConfig(model="m", device="cuda", dtype="bfloat16", kv_cache_dtype="float32")
    assert CoreConfig(model="m", dtype="bfloat16", kv_cache_dtype="float32").kv_cache_dtype == "float32"


def test_a_bfloat16_cache_holds_twice_the_blocks_of_a_float32_one_in_the_same_memory(checkpoint, caplog):
    path = checkpoint("llama")
    budget = {"kv_cache_memory_gib": 0.01}
    plain = make_engine(path, **budget)
    with caplog.at_level(logging.INFO, logger="core_svc.engine_core"):
        narrow = make_engine(path, kv_cache_dtype="bfloat16", **budget)
    assert plain.model_runner.kv_caches[0].dtype == torch.float32 and plain.dtype == torch.float32
    assert narrow.model_runner.kv_caches[0].dtype == torch.bfloat16 and narrow.dtype == torch.float32
    arch = plain.arch
    per_block = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_size * plain.config.block_size
    assert plain.num_kv_blocks == int(0.01 * 2**30) // (4 * per_block)
    assert narrow.num_kv_blocks == int(0.01 * 2**30) // (2 * per_block)
    assert narrow.model_runner.kv_cache_bytes == narrow.num_kv_blocks * 2 * per_block
    assert any("KV cache size" in r.message and r.message.endswith("bfloat16)") for r in caplog.records)


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
def test_the_kernel_names_a_cache_dtype_it_does_not_serve():
    from kernels.attention import cpu_ops

    query = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 1, 64)  # float32 under bfloat16 queries: wider, never served
    table, lens = torch.ones(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="bfloat16 or float16 under float32 queries; got a Float cache under"):
        cpu_ops.paged_decode_attention(torch.empty_like(query), query, cache, cache, table, lens, 0.125, None)


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
def test_the_kernel_stores_keys_in_bfloat16_as_torch_rounds_them_nan_and_inf_included():
    """Ties, the largest finite values (rounding to inf), infinities and NaNs, one with a full payload (which a
    rounding that skips the NaN test turns into -0.0), through the decode kernel's KV write."""
    from kernels.attention import cpu_ops

    bits = [0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF]
    special = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    key = torch.randn(1, 1, 64)
    key[0, 0, : len(bits)] = special
    value = -key
    query = torch.zeros(1, 1, 64)
    caches = [torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16) for _ in range(2)]
    table, lens = torch.tensor([[1]], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    slots = torch.tensor([16 + 3])  # block 1, slot 3
    out = torch.empty_like(query)
    k_cache, v_cache = caches
    cpu_ops.decode_attention_with_kv_write(out, query, key, value, k_cache, v_cache, slots, table, lens, 0.125, None)
    for cache, expected in ((caches[0], key), (caches[1], value)):
        stored = cache[1, 3, 0]
        torch.testing.assert_close(stored, expected[0, 0].to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(caches[0][1, 3, 0, 7]) and torch.isnan(caches[1][1, 3, 0, 8])  # the full-payload NaNs
