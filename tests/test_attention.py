"""Attention backends against a dense causal attention computed independently, per request, from the tokens'
keys and values in position order (no paging)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels import AttentionMetadata, get_attention_backend
from kernels.attention.selector import FALLBACK_COST
from splitserve.base import envs
from tests.helpers import cpu_kernels_loaded, needs_cpu_kernels

BACKENDS = ["torch_ref", needs_cpu_kernels("cpu")]


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, window: int | None):
    """q: [q_len, H, D] at positions first_pos.., k/v: [seq_len, Hkv, D] at positions 0.. -> [q_len, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


# (tokens already cached, tokens this step) per request; decodes first, as the model runner orders them
STEPS = {
    # three decodes (one with no cached token), a fresh prefill and a prefill chunk over cached tokens
    "mixed": [(9, 1), (0, 1), (22, 1), (0, 7), (6, 5)],
    "decodes": [(9, 1), (0, 1), (22, 1)],  # decode-only: the CPU kernel writes the KV itself
    "one decode": [(22, 1)],  # a single request: the CPU kernel runs without an OpenMP region
}


# (queries' dtype, the KV cache's): the model's dtype, or a bfloat16 cache under float32 (--kv-cache-dtype)
DTYPES = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float32, bfloat16 cache": (torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtypes", list(DTYPES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("head_size", [32, 64, 128])  # the CPU kernel: 64 and 128 compiled apart, others at run time
def test_paged_attention_matches_dense(backend_name, dtypes, window, step, head_size):
    """Each kind of step (``STEPS``) with GQA, scattered blocks, and a block size that does not divide the
    lengths. A narrower cache: attention over the keys and values rounded to it, the fresh ones included."""
    dtype, cache_dtype = DTYPES[dtypes]
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, block_size, num_blocks = 8, 2, 4, 64
    requests = STEPS[step]
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=cache_dtype)
    free_blocks = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # block 0 is the null block
    all_keys, all_values, tables, slots = [], [], [], []
    for cached, new in requests:
        seq_len = cached + new
        keys = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        table = [free_blocks.pop() for _ in range(-(seq_len // -block_size))]
        for pos in range(cached):  # what earlier steps wrote
            kv_cache[0, table[pos // block_size], pos % block_size] = keys[pos]
            kv_cache[1, table[pos // block_size], pos % block_size] = values[pos]
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, seq_len)]
        all_keys.append(keys)
        all_values.append(values)
        tables.append(table)
    max_blocks = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    num_decodes = sum(1 for _, new in requests if new == 1)
    metadata = AttentionMetadata.for_requests(block_table, requests, block_size, num_decodes)
    query_start_loc = metadata.query_start_loc_cpu
    assert metadata.slot_mapping.tolist() == slots  # the helper's slots are this test's own
    query = torch.randn(query_start_loc[-1], num_heads, head_size, generator=gen).to(dtype)
    key = torch.cat([k[cached:] for k, (cached, _) in zip(all_keys, requests, strict=True)])
    value = torch.cat([v[cached:] for v, (cached, _) in zip(all_values, requests, strict=True)])

    backend = get_attention_backend(backend_name, "cpu", envs.kernel_dir())
    assert backend.name == backend_name
    # query, key and value as the model passes them: views into one fused projection output, rows not contiguous
    fused = torch.cat((query, key, value), dim=1)
    q_view, k_view = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    v_view = fused[:, num_heads + num_kv_heads :]
    out = backend.forward(q_view, k_view, v_view, kv_cache, metadata, head_size**-0.5, window)

    assert out.shape == query.shape and out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (cached, _) in enumerate(requests):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        keys, values = all_keys[i].to(cache_dtype), all_values[i].to(cache_dtype)  # as the cache holds them
        expected = _dense_attention(query[rows], keys, values, cached, window)
        torch.testing.assert_close(out[rows].float(), expected, atol=atol, rtol=0, msg=f"request {i}")
    # The step's keys and values landed in their slots.
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    written = (key.to(cache_dtype), value.to(cache_dtype))  # rounded to nearest even, as torch's .to()
    assert torch.equal(flat[0, metadata.slot_mapping], written[0]) and torch.equal(
        flat[1, metadata.slot_mapping], written[1]
    )


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="torch_ref"):
        get_attention_backend("flash", "cpu", envs.kernel_dir())


def test_auto_falls_back_to_the_reference_loudly_when_the_kernel_cannot_build(tmp_path, monkeypatch, caplog):
    """No compiler and nothing built yet: ``auto`` serves with the reference and a WARNING that gives the reason,
    the measured cost and the fix; ``cpu`` asked for explicitly raises."""
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    build_dir = tmp_path / "kernels"
    with caplog.at_level("WARNING", logger="kernels.attention.selector"):
        backend = get_attention_backend("auto", "cpu", build_dir)
    assert backend.name == "torch_ref"
    [record] = caplog.records
    assert record.levelname == "WARNING"
    message = record.getMessage()
    assert "(no C++ compiler: CXX='/nonexistent/g++' is not an executable)" in message
    assert "slower reference backend 'torch_ref'" in message
    assert f"Cost: {FALLBACK_COST}." in message and "install a C++ compiler (g++" in message
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        get_attention_backend("cpu", "cpu", build_dir)


# (dtype of the queries and outputs, of the cache): float32 queries over every cache dtype, 16-bit ones over their own
KERNEL_DTYPES = [(torch.float32, d) for d in (torch.float32, torch.bfloat16, torch.float16)] + [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
]


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])  # 8 query heads: groups of 1, 2, 4 and 8
@pytest.mark.parametrize("head_size", [64, 128])  # the sizes read 16 slots at a time on AVX-512
@pytest.mark.parametrize(("dtype", "cache_dtype"), KERNEL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_kernel_over_many_slots_matches_dense(num_kv_heads, head_size, dtype, cache_dtype, block_size):
    """The kernel's decode over contexts of 1 to 300 tokens (whole and partial groups of 16 slots, blocks
    scattered, a block size that does and one that does not divide 16), with and without a sliding window, against
    the dense attention over the same keys and values as the cache holds them; float32 queries over every cache
    dtype, 16-bit ones over their own."""
    atol = 2e-5 if dtype == torch.float32 else 2e-2  # the output rounded to a 16-bit dtype
    _check_decode_kernel(num_kv_heads, head_size, dtype, cache_dtype, block_size, scale=0.1, atol=atol)


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("head_size", [64, 128, 40])
@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_decode_kernel_with_scores_far_apart_matches_dense(head_size, dtype, cache_dtype):
    """Scores spread over hundreds (a softmax scale of 4 over unit-variance queries and keys), so most of a row's
    exponents lie below -87, where float32's exp underflows: the kernel's softmax still matches the dense one. Scores
    of magnitude ~200 carry float32 rounding of ~1e-5 in either computation, which moves the outputs as much: hence
    the looser tolerance."""
    _check_decode_kernel(4, head_size, dtype, cache_dtype, 16, scale=4.0, atol=2e-4)


def _check_decode_kernel(
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    block_size: int,
    scale: float,
    atol: float,
) -> None:
    """paged_decode_attention over contexts of 1 to 300 tokens, with and without a window of 21, against
    _dense_attention over the keys and values as the cache holds them."""
    from kernels.attention import cpu_ops

    gen = torch.Generator().manual_seed(1)
    num_heads, lengths = 8, [1, 15, 16, 17, 33, 100, 300]
    num_blocks = sum(-(n // -block_size) for n in lengths) + 1
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(cache_dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[order.pop() for _ in range(-(n // -block_size))] for n in lengths]
    block_table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    query = torch.randn(len(lengths), num_heads, head_size, generator=gen).to(dtype)
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    for window in (None, 21):
        out = torch.empty_like(query)
        cpu_ops.paged_decode_attention(out, query, kv_cache[0], kv_cache[1], block_table, seq_lens, scale, window)
        for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
            slots = [table[p // block_size] * block_size + p % block_size for p in range(n)]
            keys, values = flat[0, slots], flat[1, slots]
            scaled = query[i : i + 1].float() * scale * head_size**0.5
            expected = _dense_attention(scaled, keys, values, n - 1, window)
            torch.testing.assert_close(out[i : i + 1].float(), expected, atol=atol, rtol=0, msg=f"{n} tokens, {window}")


# (num_heads, num_kv_heads, head_size, dtype, cache_dtype, block_size): groups of 1, 2 and 8 query heads per KV head
# at head sizes compiled apart (64, 128) and read at run time (40), every dtype pair, a block size that divides the
# kernel's chunks of 16 or 32 keys and one that does not; and a group of 80 (more rows than a tile holds)
PREFILL_CASES = [
    (num_heads, num_kv_heads, head_size, dtype, cache_dtype, block_size)
    for num_heads, num_kv_heads in ((8, 8), (8, 4), (8, 1))
    for head_size in (64, 128, 40)
    for dtype, cache_dtype in KERNEL_DTYPES
    for block_size in (16, 5)
] + [(80, 1, 64, torch.float32, torch.float32, 16), (80, 1, 64, torch.bfloat16, torch.bfloat16, 5)]


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_kernel_over_many_tiles_matches_dense(case):
    """The prefill kernel over prompts and chunks of 1 to 150 tokens after 0 to 97 cached ones (whole and partial
    tiles and chunks of keys, blocks scattered), behind two decode rows it must leave alone, with and without a
    sliding window shorter than a chunk of keys and one longer, against the dense attention over the keys and values
    as the cache holds them."""
    from kernels.attention import cpu_ops

    num_heads, num_kv_heads, head_size, dtype, cache_dtype, block_size = case
    gen = torch.Generator().manual_seed(2)
    # (cached, new) per request; the first two are decodes
    requests = [(5, 1), (40, 1), (0, 1), (0, 16), (0, 150), (97, 33), (64, 1), (3, 70)]
    num_decodes = 2
    lengths = [cached + new for cached, new in requests]
    num_blocks = sum(-(n // -block_size) for n in lengths) + 1
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(cache_dtype)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[order.pop() for _ in range(-(n // -block_size))] for n in lengths]
    block_table = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], dtype=torch.int32)
    metadata = AttentionMetadata.for_requests(block_table, requests, block_size, num_decodes)
    starts = metadata.query_start_loc_cpu
    query = torch.randn(starts[-1], num_heads, head_size, generator=gen).to(dtype)
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    atol = 2e-5 if dtype == torch.float32 else 2e-2  # the output rounded to a 16-bit dtype
    for window in (None, 21, 45):
        out = torch.full_like(query, 7.0)
        cpu_ops.paged_prefill_attention(out, query, kv_cache[0], kv_cache[1], metadata, 0.1, window)
        assert torch.all(out[: starts[num_decodes]] == 7.0), "a decode row was written"
        for i in range(num_decodes, len(requests)):
            cached, n = requests[i][0], lengths[i]
            slots = [tables[i][p // block_size] * block_size + p % block_size for p in range(n)]
            rows = slice(starts[i], starts[i + 1])
            scaled = query[rows].float() * 0.1 * head_size**0.5
            expected = _dense_attention(scaled, flat[0, slots], flat[1, slots], cached, window)
            torch.testing.assert_close(out[rows].float(), expected, atol=atol, rtol=0, msg=f"request {i}, {window}")


def test_metadata_for_no_requests_is_an_empty_step():
    metadata = AttentionMetadata.for_requests(torch.zeros(0, 1, dtype=torch.int32), [], 16)
    assert metadata.query_start_loc_cpu == [0] and metadata.seq_lens_cpu == [] and metadata.num_decodes == 0
    assert metadata.max_query_len == 0 and metadata.max_seq_len == 0 and metadata.slot_mapping.numel() == 0


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
def test_prefill_kernel_refuses_lengths_its_block_table_cannot_hold():
    from kernels.attention import cpu_ops

    kv_cache = torch.zeros(2, 4, 4, 1, 64)
    query = torch.zeros(9, 2, 64)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(9, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 9], dtype=torch.int32),
        seq_lens=torch.tensor([9], dtype=torch.int32),
        block_table=torch.tensor([[1, 2]], dtype=torch.int32),  # 8 slots
        query_start_loc_cpu=[0, 9],
        seq_lens_cpu=[9],
        max_query_len=9,
        max_seq_len=9,
    )
    with pytest.raises(RuntimeError, match=r"request 0: 9 query tokens, seq_len 9 \(at most 8 slots"):
        cpu_ops.paged_prefill_attention(torch.empty_like(query), query, kv_cache[0], kv_cache[1], metadata, 1.0, None)
    # 8 query tokens of a seq_len of 8 (within the block table), starting at row -1: only the start is wrong
    outside = dataclasses.replace(
        metadata,
        query_start_loc=torch.tensor([-1, 7], dtype=torch.int32),
        seq_lens=torch.tensor([8], dtype=torch.int32),
        query_start_loc_cpu=[-1, 7],
        seq_lens_cpu=[8],
    )
    with pytest.raises(RuntimeError, match=r"query_start_loc runs outside the query's 9 rows"):
        cpu_ops.paged_prefill_attention(torch.empty_like(query), query, kv_cache[0], kv_cache[1], outside, 1.0, None)
