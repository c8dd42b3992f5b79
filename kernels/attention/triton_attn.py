"""The ``triton`` attention backend: the KV write and the attention of a whole mixed batch (decodes and prefill
chunks, with or without a cached prefix) in two Triton launches per layer (three for a small decode batch, whose
keys are split among programs), the kernels of ``triton_kernels``.

As vLLM's ``TritonAttentionBackend`` (``vllm/v1/attention/backends/triton_attn.py``) over its unified attention
kernel. ``forward`` reads only device tensors of the metadata (``slot_mapping``, ``query_start_loc``, ``seq_lens``,
``block_table``) and launches grids sized by tensor shapes, never by ``max_seq_len``, ``max_query_len``,
``num_decodes`` or the ``*_cpu`` lists: a decode step can be captured in a CUDA graph and replayed with new contents
of those tensors.

Runs on CUDA tensors, or on CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before this
module was first imported (slow: for tests; see ``triton_kernels`` for what the interpreter does not prove).
"""

from __future__ import annotations

import torch
import triton

from kernels.attention.backend import AttentionMetadata
from kernels.attention.triton_kernels import (
    INTERPRETED,
    reduce_segments_kernel,
    reshape_and_cache_kernel,
    unified_attention_kernel,
)

# The smallest dimension tl.dot takes on a GPU (M, N and K of the MMA).
_MIN_DOT_DIM = 16
# Keys per inner-loop iteration of the attention kernel, independent of the cache's block size (the kernel finds
# each key's block through the block table), as vLLM's TILE_SIZE.
_TILE_SIZE = 32
_LOG2_E = 1.4426950408889634
# Split-KV: programs per (query block, KV head) in a small decode batch, as vLLM's NUM_PAR_SOFTMAX_SEGMENTS (the
# interpreter runs programs one after another, so there splitting only costs time: 4 still run the same code with
# several segments, empty ones among them); and the programs below which a batch is split (about one per SM of an
# H100/H200, 132 SMs).
_NUM_SEGMENTS = 4 if INTERPRETED else 16
_MIN_PROGRAMS_UNSPLIT = 128


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True
    supports_narrow_kv_cache = False

    def __init__(self, device: torch.device | str) -> None:
        """A backend for tensors on ``device``.

        Raises:
            RuntimeError: ``device`` is not CUDA and the kernels were not decorated for the interpreter
                (``TRITON_INTERPRET=1`` unset when ``triton_kernels`` was first imported).
        """
        if torch.device(device).type != "cuda" and not INTERPRETED:
            raise RuntimeError(
                f"the triton attention backend runs on CUDA devices, got {device!s}; on CPU only in Triton's "
                "interpreter, and TRITON_INTERPRET=1 was not set when its kernels were first imported"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """``AttentionBackend.forward``: ``reshape_and_cache`` then ``unified_attention``.

        Raises:
            ValueError: inputs whose shapes, dtypes or devices do not fit together (see the two functions).
        """
        # query: [num_tokens, num_heads, head_size] -> same shape
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(kv_cache.shape)}"
            )
        reshape_and_cache(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        unified_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            output,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale,
            sliding_window,
        )
        return output


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` (any strides, contiguous last dim) at
    ``slot_mapping`` ``[num_tokens]`` int64 into ``key_cache``/``value_cache`` ``[num_blocks, block_size,
    num_kv_heads, head_size]`` (``kv_cache[0]``/``kv_cache[1]`` of ``backend.py``'s layout), slot s at block
    ``s // block_size``, row ``s % block_size``. A slot < 0 is skipped (vLLM's PAD_SLOT_ID). One program per token.

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together, or a last dimension that is not contiguous.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same shape")
    if key_cache.dim() != 4 or key_cache.shape[2:] != key.shape[1:] or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"the caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} must be [num_blocks, block_size, "
            f"{num_kv_heads}, {head_size}] for keys of {tuple(key.shape)}"
        )
    if not key.dtype == value.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"key, value and caches must share a dtype, got {key.dtype}, {value.dtype}, {key_cache.dtype}, "
            f"{value_cache.dtype}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be [{num_tokens}] int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    _check_same_device(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    _check_last_dim_contiguous(
        key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping
    )
    if key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key and value caches must have the same strides, got {key_cache.stride()} and {value_cache.stride()}"
        )
    if num_tokens == 0:
        return
    reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_size,
        key_cache.shape[1],
        **reshape_and_cache_constants(num_kv_heads, head_size),
    )


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> None:
    """Causal paged attention of a mixed batch in one launch, into ``output``.

    ``query`` and ``output`` are ``[num_tokens, num_heads, head_size]`` (any strides, contiguous last dim): each
    request's query tokens are a contiguous run, ``query_start_loc`` ``[num_reqs + 1]`` int32 their offsets;
    ``seq_lens`` ``[num_reqs]`` int32 counts each request's tokens in the cache including this step's (already
    written), so its queries are at positions ``seq_len - query_len ..``; ``block_table`` ``[num_reqs,
    max_num_blocks_per_req]`` int32 maps each request's block index to a cache block. A query at position p sees
    keys at positions k <= p and, with a window W, k > p - W (transformers' convention). Scores are
    ``scale * q.k``; softmax runs online in float32. The metadata's values live on the device and are not checked:
    each ``seq_len`` is at least its request's query length, and each block-table row covers its ``seq_len``; a
    request with ``seq_len`` 0 (a padding row of a CUDA-graph batch) gets zeros; rows past
    ``query_start_loc[-1]`` are left as they are.

    As vLLM's ``unified_attention`` 2D kernel: a program per (block of BLOCK_Q query tokens of one request, KV
    head) holds the ``NUM_QUERIES_PER_KV`` query heads of that KV head, so each key is read once per group; the
    grid is ``(num_tokens // BLOCK_Q + num_reqs, num_kv_heads)`` (each request wastes at most one block) and each
    program finds its request by binary search over ``query_start_loc``. A decode batch too small to fill a GPU
    (``num_kv_segments``) also splits each block's keys among ``NUM_SEGMENTS`` programs, whose partial softmaxes a
    second launch combines (vLLM's 3D kernel and ``reduce_segments``).

    Raises:
        ValueError: shapes, dtypes or devices that do not fit together, head counts that are not a multiple of
            the KV heads', or a ``sliding_window`` < 1.
    """
    num_tokens, num_heads, head_size = query.shape
    if key_cache.dim() != 4 or key_cache.shape[3] != head_size or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"the caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} must be [num_blocks, block_size, "
            f"num_kv_heads, {head_size}] for queries of {tuple(query.shape)}"
        )
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if output.shape != query.shape or not query.dtype == output.dtype == key_cache.dtype == value_cache.dtype:
        raise ValueError(
            f"query, output and caches must share a dtype and output the query's shape, got query "
            f"{tuple(query.shape)} {query.dtype}, output {tuple(output.shape)} {output.dtype}, caches "
            f"{key_cache.dtype} {value_cache.dtype}"
        )
    num_reqs = seq_lens.shape[0]
    for name, tensor, shape in (
        ("query_start_loc", query_start_loc, (num_reqs + 1,)),
        ("seq_lens", seq_lens, (num_reqs,)),
    ):
        if tensor.shape != shape or tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be {list(shape)} int32, got {tuple(tensor.shape)} {tensor.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != num_reqs or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be [{num_reqs}, max_num_blocks_per_req] int32, got {tuple(block_table.shape)} "
            f"{block_table.dtype}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")
    _check_same_device(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        output=output,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
    )
    _check_last_dim_contiguous(
        query=query,
        output=output,
        key_cache=key_cache,
        value_cache=value_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
    )
    if key_cache.stride() != value_cache.stride():
        raise ValueError(
            f"key and value caches must have the same strides, got {key_cache.stride()} and {value_cache.stride()}"
        )
    if num_tokens == 0 or num_reqs == 0:  # nothing to attend (and no request for a program to find)
        return
    constants = unified_attention_constants(num_heads, num_kv_heads, head_size, block_size, query.dtype, sliding_window)
    num_segments = num_kv_segments(num_tokens, num_reqs, num_kv_heads)
    head_size_padded = constants["HEAD_SIZE_PADDED"]
    if num_segments > 1:
        segment_max = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=query.device)
        segment_sum = torch.empty_like(segment_max)
        segment_acc = torch.empty(*segment_max.shape, head_size_padded, dtype=torch.float32, device=query.device)
    else:  # unused by the kernel
        segment_max = segment_sum = segment_acc = output
    grid = (num_tokens // constants["BLOCK_Q"] + num_reqs, num_kv_heads, num_segments)
    unified_attention_kernel[grid](
        output,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        segment_max,
        segment_sum,
        segment_acc,
        scale * _LOG2_E,
        num_reqs,
        num_heads,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        head_size,
        **constants,
        NUM_SEGMENTS=num_segments,
    )
    if num_segments > 1:
        reduce_segments_kernel[(num_tokens, num_heads)](
            output,
            segment_max,
            segment_sum,
            segment_acc,
            query_start_loc,
            num_reqs,
            num_heads,
            output.stride(0),
            output.stride(1),
            head_size,
            NUM_SEGMENTS=num_segments,
            HEAD_SIZE_PADDED=head_size_padded,
        )


def num_kv_segments(num_tokens: int, num_reqs: int, num_kv_heads: int) -> int:
    """How many programs share each query block's keys (split-KV, vLLM's 3D ``unified_attention`` kernel), from
    shapes only: ``_NUM_SEGMENTS`` for a batch of one query token per request (decodes, by shape) too small to give
    each SM of a large GPU a program of its own; else 1. Both paths compute the same attention."""
    if num_tokens == num_reqs and num_reqs * num_kv_heads < _MIN_PROGRAMS_UNSPLIT:
        return _NUM_SEGMENTS
    return 1


def reshape_and_cache_constants(num_kv_heads: int, head_size: int) -> dict[str, int]:
    """The ``tl.constexpr`` arguments of ``reshape_and_cache_kernel`` for keys of ``[*, num_kv_heads, head_size]``."""
    return {
        "NUM_KV_HEADS_PADDED": triton.next_power_of_2(num_kv_heads),
        "HEAD_SIZE_PADDED": triton.next_power_of_2(head_size),
    }


def unified_attention_constants(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype, sliding_window: int | None
) -> dict[str, int | bool]:
    """The ``tl.constexpr`` arguments of ``unified_attention_kernel`` for one layer's shapes and dtype (one compiled
    kernel per distinct result). ``BLOCK_M``: 16 rows (the smallest tl.dot M), or one query token's whole GQA group
    when it has more heads, as vLLM's ``unified_attention``; ``BLOCK_Q``: the query tokens those rows hold."""
    num_queries_per_kv = num_heads // num_kv_heads
    block_m = max(_MIN_DOT_DIM, triton.next_power_of_2(num_queries_per_kv))
    return {
        "NUM_QUERIES_PER_KV": num_queries_per_kv,
        "BLOCK_SIZE": block_size,
        "TILE_SIZE": _TILE_SIZE,
        "HEAD_SIZE_PADDED": max(_MIN_DOT_DIM, triton.next_power_of_2(head_size)),
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // num_queries_per_kv,
        "SLIDING_WINDOW": sliding_window or 0,
        # Why the interpreter upcasts bfloat16: see triton_kernels' docstring.
        "DOT_F32": INTERPRETED and dtype == torch.bfloat16,
        # TF32 would cost float32 about 3 decimal digits on a GPU: float32 serves correctness checks, not speed.
        "DOT_IEEE": dtype == torch.float32,
    }


def _check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous (stride 1), got strides {tensor.stride()}")
