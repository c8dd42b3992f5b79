"""The flash_attn backend without a GPU: a stand-in ``flash_attn`` module computes flash-attn's documented
semantics in plain torch (bottom-right aligned causal mask, ``window_size``, a paged ``block_table``, ``cu_seqlens``)
and asserts the argument contract of flash-attn 2.6+ (``csrc/flash_attn/flash_api.cpp``: dtypes, shapes, int32
index tensors, block size, contiguity); the backend over it must match the reference backend. Then the choice of a
backend on CUDA: ``auto`` and ``flash_attn`` by name, with every way flash-attn may not fit.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from kernels import AttentionMetadata, AttentionSpec, get_attention_backend
from kernels.attention.flash_attn_backend import FlashAttnBackend
from kernels.attention.selector import choose_cuda_backend
from kernels.attention.torch_ref import TorchRefAttentionBackend
from splitserve.base import envs

BLOCK_SIZE = 256  # upstream flash-attn's paged KV cache takes multiples of 256 only


# --- a stand-in for flash_attn: flash-attn's semantics from its docstrings, in plain torch ----------------------


def _check_common(q, k_cache, v_cache, block_table, softmax_scale, causal, window_size) -> None:
    """What flash-attn's kernels require of both calls, and what this backend must always pass."""
    assert q.dtype in (torch.float16, torch.bfloat16), q.dtype
    assert k_cache.dtype == v_cache.dtype == q.dtype
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape  # [num_blocks, page_block_size, Hkv, D]
    assert k_cache.shape[1] % 256 == 0, f"page_block_size {k_cache.shape[1]} is not divisible by 256"
    head_size = q.shape[-1]
    assert head_size == k_cache.shape[-1] and head_size <= 256 and head_size % 8 == 0
    assert q.shape[-2] % k_cache.shape[2] == 0  # GQA: query heads a multiple of KV heads
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert block_table.dim() == 2
    assert causal is True
    assert isinstance(softmax_scale, float)
    assert isinstance(window_size, tuple) and len(window_size) == 2 and all(type(w) is int for w in window_size)
    left, right = window_size
    assert window_size == (-1, -1) or (left >= 0 and right == 0), window_size


def _attend(q, k_cache, v_cache, table, seqlen_k: int, scale: float, window_size: tuple[int, int]) -> torch.Tensor:
    """One sequence: q [seqlen_q, H, D] over the first ``seqlen_k`` keys its block table names -> [seqlen_q, H, D].
    Query i sits at key position i + seqlen_k - seqlen_q and sees keys in [pos - left, pos + right] (causal: right
    is 0; -1: unbounded); a row that sees no key is 0. Float64 throughout."""
    seqlen_q, num_heads, _ = q.shape
    page = k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    # The sequence's keys and values in position order, page by page: [seqlen_k, Hkv, D].
    num_pages = -(seqlen_k // -page)
    k_all = torch.cat([k_cache[int(table[p])] for p in range(num_pages)])[:seqlen_k].double()
    v_all = torch.cat([v_cache[int(table[p])] for p in range(num_pages)])[:seqlen_k].double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    left, _ = window_size
    for i in range(seqlen_q):
        pos = i + seqlen_k - seqlen_q
        lo, hi = (0 if left < 0 else max(pos - left, 0)), min(pos, seqlen_k - 1)
        if hi < lo:
            continue
        k, v = k_all[lo : hi + 1], v_all[lo : hi + 1]  # [n, Hkv, D]
        for h in range(num_heads):
            scores = (k[:, h // group] @ q[i, h].double()) * scale  # [n]
            weights = torch.exp(scores - scores.max())
            out[i, h] = (weights / weights.sum()) @ v[:, h // group]
    return out


def make_fake_flash_attn(version: str = "2.7.4") -> types.ModuleType:
    """A ``flash_attn`` module whose two functions follow flash-attn's documented semantics and assert its
    argument contract; ``module.calls`` lists the functions called, in order."""
    module = types.ModuleType("flash_attn")
    calls: list[str] = []

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
        block_table=None,
    ):
        calls.append("flash_attn_varlen_func")
        _check_common(q, k, v, block_table, softmax_scale, causal, window_size)
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not return_attn_probs
        assert q.dim() == 3  # [total_q, H, D]
        for cu in (cu_seqlens_q, cu_seqlens_k):
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous() and int(cu[0]) == 0
        batch = cu_seqlens_q.numel() - 1
        assert cu_seqlens_k.numel() == batch + 1 and block_table.shape[0] == batch
        assert int(cu_seqlens_q[-1]) == q.shape[0]
        q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
        assert type(max_seqlen_q) is int and max_seqlen_q >= max(q_lens)
        assert type(max_seqlen_k) is int and max_seqlen_k >= max(k_lens)
        assert all(0 < n <= m for n, m in zip(q_lens, k_lens, strict=True))
        assert block_table.shape[1] * k.shape[1] >= max(k_lens)
        out = torch.empty(q.shape, dtype=torch.float64)
        for b in range(batch):
            rows = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
            out[rows] = _attend(q[rows], k, v, block_table[b], k_lens[b], softmax_scale, window_size)
        return out.to(q.dtype)

    def flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k=None,
        v=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_seqlens=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        rotary_interleaved=True,
        alibi_slopes=None,
        num_splits=0,
        return_softmax_lse=False,
    ):
        calls.append("flash_attn_with_kvcache")
        _check_common(q, k_cache, v_cache, block_table, softmax_scale, causal, window_size)
        assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
        assert softcap == 0.0 and alibi_slopes is None and not return_softmax_lse
        assert q.dim() == 4 and q.shape[1] == 1  # [batch, seqlen_q = 1, H, D]: decodes
        assert isinstance(cache_seqlens, torch.Tensor)  # a device tensor, not a host int: graph-safe
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous()
        assert cache_seqlens.shape == (q.shape[0],) and block_table.shape[0] == q.shape[0]
        out = torch.empty(q.shape, dtype=torch.float64)
        for b in range(q.shape[0]):
            seqlen_k = int(cache_seqlens[b])
            out[b] = _attend(q[b], k_cache, v_cache, block_table[b], seqlen_k, softmax_scale, window_size)
        return out.to(q.dtype)

    module.__dict__.update(
        __version__=version,
        flash_attn_varlen_func=flash_attn_varlen_func,
        flash_attn_with_kvcache=flash_attn_with_kvcache,
        calls=calls,
    )
    return module


@pytest.fixture()
def fake_flash_attn(monkeypatch) -> Any:
    module = make_fake_flash_attn()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return module


def test_the_stand_in_follows_flash_attns_documented_masks(fake_flash_attn):
    """flash-attn's docstring example: seqlen_q = 2, seqlen_k = 5, causal: row 0 sees keys 0-3, row 1 keys 0-4;
    with window_size (1, 0) row 0 sees keys 2-3, row 1 keys 3-4. Zero queries weigh the keys they see equally, so
    with value j at key j each row is the mean of the keys it sees."""
    head_size = 8
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, head_size, dtype=torch.float16)
    v_cache = torch.zeros(2, BLOCK_SIZE, 1, head_size, dtype=torch.float16)
    v_cache[1, :5] = torch.arange(5, dtype=torch.float16)[:, None, None]
    q = torch.zeros(2, 1, head_size, dtype=torch.float16)
    args = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 2, 5)
    table = torch.tensor([[1]], dtype=torch.int32)
    for window, expected in [((-1, -1), [1.5, 2.0]), ((1, 0), [2.5, 3.5])]:
        out = fake_flash_attn.flash_attn_varlen_func(
            q, k_cache, v_cache, *args, softmax_scale=0.5, causal=True, window_size=window, block_table=table
        )
        assert out[:, 0, 0].tolist() == expected
    with pytest.raises(AssertionError):  # the contract bites: an int64 block table
        fake_flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, *args, 0.0, 0.5, True, block_table=table.long())


def _batch(requests: list[tuple[int, int]], num_decodes: int, dtype: torch.dtype, gen: torch.Generator):
    """A step's inputs for ``requests`` (tokens cached before, tokens this step), decodes first; the cached tokens'
    keys and values written in scattered blocks. Returns (query, key, value, kv_cache, metadata)."""
    num_heads, num_kv_heads, head_size, num_blocks = 8, 2, 64, 9
    kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, num_kv_heads, head_size, dtype=dtype)
    free_blocks = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # block 0 is the null block
    tables, slots, keys, values = [], [], [], []
    for cached, new in requests:
        seq_len = cached + new
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
        table = [free_blocks.pop() for _ in range(-(seq_len // -BLOCK_SIZE))]
        for pos in range(cached):
            kv_cache[0, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = k[pos]
            kv_cache[1, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = v[pos]
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, seq_len)]
        keys.append(k[cached:])
        values.append(v[cached:])
        tables.append(table)
    width = max(len(t) for t in tables) + 1  # padded with the null block, as the runner's table is
    query_lens = [new for _, new in requests]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    seq_lens = [cached + new for cached, new in requests]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
    )
    query = torch.randn(starts[-1], num_heads, head_size, generator=gen).to(dtype)
    return query, torch.cat(keys), torch.cat(values), kv_cache, metadata


# (tokens cached, tokens this step), decodes first
MIXED = ([(300, 1), (255, 1), (0, 1), (300, 21), (0, 37)], 3)  # 300 cached: a prefix ending mid-block 1
DECODES = ([(300, 1), (255, 1), (256, 1), (0, 1), (511, 1)], 5)  # 255 + 1 fills block 0; 256 + 1 opens block 1


@pytest.mark.parametrize(("case", "call"), [(MIXED, "flash_attn_varlen_func"), (DECODES, "flash_attn_with_kvcache")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 64])
def test_flash_attn_matches_the_reference_backend(fake_flash_attn, case, call, dtype, window):
    """GQA (8 query heads, 2 KV heads), head size 64, block size 256; a mixed batch goes through one varlen call, a
    decode-only one through one with_kvcache call; outputs and the KV cache equal the reference backend's."""
    requests, num_decodes = case
    query, key, value, kv_cache, metadata = _batch(requests, num_decodes, dtype, torch.Generator().manual_seed(0))
    reference_cache = kv_cache.clone()
    backend = get_attention_backend("flash_attn", "cuda", envs.kernel_dir(), AttentionSpec(dtype, BLOCK_SIZE, 64))
    assert isinstance(backend, FlashAttnBackend) and backend.name == "flash_attn" and backend.supports_cuda_graphs
    scale = 64**-0.5
    out = backend.forward(query, key, value, kv_cache, metadata, scale, window)
    expected = TorchRefAttentionBackend().forward(query, key, value, reference_cache, metadata, scale, window)
    assert fake_flash_attn.calls == [call]
    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(kv_cache, reference_cache)  # this step's keys and values written as the reference writes them


# --- choosing a backend on CUDA ---------------------------------------------------------------------------------

FITS = AttentionSpec(torch.bfloat16, 256, 128)


def test_auto_on_cuda_picks_flash_attn_when_it_imports_and_fits(fake_flash_attn, caplog):
    with caplog.at_level("INFO", logger="kernels.attention.selector"):
        backend = get_attention_backend("auto", "cuda", envs.kernel_dir(), FITS)
    assert isinstance(backend, FlashAttnBackend)
    assert caplog.messages == [
        "attention backend: flash_attn (flash-attn imports and fits bfloat16, block_size 256, head_size 128)"
    ]


@pytest.mark.parametrize(
    ("spec", "installed", "reason"),
    [
        (FITS, False, "the flash-attn package is not installed (to install it: pip install 'flash-attn>=2.6' "),
        (AttentionSpec(torch.float32, 256, 128), True, "dtype float32 is not supported (float16 or bfloat16 only"),
        (AttentionSpec(torch.bfloat16, 16, 128), True, "block_size 16 is not a multiple of 256, which flash-attn's"),
    ],
    ids=["not-installed", "float32", "block-size-16"],
)
def test_auto_on_cuda_picks_triton_otherwise_and_says_why(monkeypatch, caplog, spec, installed, reason):
    monkeypatch.setitem(sys.modules, "flash_attn", make_fake_flash_attn() if installed else None)
    with caplog.at_level("INFO", logger="kernels.attention.selector"):
        assert choose_cuda_backend(torch.device("cuda"), spec) == "triton"
    [message] = caplog.messages
    assert message.startswith(f"attention backend: triton, not flash_attn, since {reason}")


@pytest.mark.parametrize(
    ("spec", "device", "message"),
    [
        (
            AttentionSpec(torch.float32, 16, 128),
            "cuda",
            "the flash_attn attention backend cannot serve here: dtype float32 is not supported (float16 or bfloat16 "
            "only: pass --dtype bfloat16 or float16); block_size 16 is not a multiple of 256, which flash-attn's "
            "paged KV cache needs (pass --block-size 256)",
        ),
        (
            AttentionSpec(torch.float16, 512, 320),
            "cuda",
            "the flash_attn attention backend cannot serve here: head_size 320 is not supported (a multiple of 8 up "
            "to 256)",
        ),
        (
            AttentionSpec(torch.float16, 256, 100),
            "cuda",
            "the flash_attn attention backend cannot serve here: head_size 100 is not supported (a multiple of 8 up "
            "to 256)",
        ),
        (
            FITS,
            "cpu",
            "the flash_attn attention backend cannot serve here: it runs on CUDA only, and the device is cpu (pass "
            "--device cuda)",
        ),
        (
            None,
            "cuda",
            "the flash_attn attention backend cannot serve here: the model's dtype, block size and head size were not "
            "given",
        ),
    ],
    ids=["float32-and-block-16", "head-320", "head-100", "cpu", "no-spec"],
)
def test_flash_attn_by_name_refuses_what_does_not_fit(fake_flash_attn, spec, device, message):
    with pytest.raises(ValueError) as info:
        get_attention_backend("flash_attn", device, envs.kernel_dir(), spec)
    assert str(info.value).startswith(message)
    assert fake_flash_attn.calls == []


def test_flash_attn_by_name_not_installed_too_old_or_on_an_old_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ValueError, match=r"not installed \(to install it: pip install 'flash-attn>=2\.6' "):
        get_attention_backend("flash_attn", "cuda", envs.kernel_dir(), FITS)
    monkeypatch.setitem(sys.modules, "flash_attn", make_fake_flash_attn("2.5.9"))
    with pytest.raises(ValueError, match=r"flash-attn 2\.5\.9 is older than 2\.6"):
        get_attention_backend("flash_attn", "cuda", envs.kernel_dir(), FITS)
    # The GPU's compute capability can only come from a GPU: mocked here, where nothing else reaches it.
    monkeypatch.setitem(sys.modules, "flash_attn", make_fake_flash_attn())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"compute capability 7\.5 is below 8\.0 \(flash-attn 2 needs Ampere"):
        get_attention_backend("flash_attn", "cuda", envs.kernel_dir(), FITS)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert isinstance(get_attention_backend("flash_attn", "cuda", envs.kernel_dir(), FITS), FlashAttnBackend)
