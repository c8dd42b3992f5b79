"""The ``@triton.jit`` code of the ``triton`` attention backend (launched by ``triton_attn``): the KV write (the
role of vLLM's ``reshape_and_cache`` op) and the unified paged attention of a mixed batch of prefill chunks and
decodes (the design of vLLM's ``vllm/attention/ops/triton_unified_attention.py``: its 2D kernel
``kernel_unified_attention_2d``, and with ``NUM_SEGMENTS`` > 1 its split-KV 3D kernel and ``reduce_segments``).

The kernels read lengths and block tables from device memory and their grids depend only on tensor shapes, so a
decode batch can be captured in a CUDA graph and replayed with new ``seq_lens`` / ``block_table`` contents.

``triton.jit`` decides when this module is imported whether its kernels compile for the GPU or run in Triton's
interpreter (``TRITON_INTERPRET=1``: each program in Python/numpy over CPU tensors); ``INTERPRETED`` records what
it decided. The interpreter computes ``tl.dot`` on bfloat16 operands wrongly (it stores bfloat16 as uint16; triton
issue #11584), so the launcher sets ``DOT_F32`` there and the attention kernel upcasts bfloat16 Q, K and V to
float32 before its dots. On a GPU bfloat16 goes to the tensor cores as is: the interpreter tests on CPU prove the
indexing, masking and online softmax in every dtype, but not the bfloat16 tensor-core dots, which only the ``cuda``
tests run.

No ``from __future__ import annotations`` and no Python type hints on kernel parameters here: Triton reads the
annotations of a jitted function's parameters (``tl.constexpr``) to specialize it.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,  # [num_tokens, num_kv_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens] int64
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    num_kv_heads,
    head_size,
    block_size,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # vLLM's PAD_SLOT_ID: a padding token stores nothing
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, NUM_KV_HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_SIZE_PADDED)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_size)
    cache_offsets = block * cache_stride_block + offset * cache_stride_slot + heads * cache_stride_head + dims
    key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims, mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning global query block ``q_block``: request i's blocks start at
    ``query_start_loc[i] // BLOCK_Q + i``, so a binary search over them (vLLM's ``find_seq_idx``)."""
    left: tl.int32 = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


# num_reqs changes every step: one compiled kernel for all its values, not one per specialization of it (1, multiples
# of 16), since a compile in the middle of serving takes seconds.
@triton.jit(do_not_specialize=["num_reqs"])
def unified_attention_kernel(
    output_ptr,  # [num_tokens, num_heads, head_size]
    query_ptr,  # [num_tokens, num_heads, head_size]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_reqs, max_num_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    segment_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] float32 (NUM_SEGMENTS > 1 only)
    segment_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] float32
    segment_acc_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED] float32
    scale_log2,  # float: softmax scale x log2(e), so the kernel can use exp2
    num_reqs,
    num_heads,
    query_stride_token,
    query_stride_head,
    output_stride_token,
    output_stride_head,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    block_table_stride,
    head_size,
    NUM_QUERIES_PER_KV: tl.constexpr,  # query heads per KV head (GQA group), all in one program
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_SIZE: tl.constexpr,  # keys per loop iteration, a power of two >= 16
    HEAD_SIZE_PADDED: tl.constexpr,  # head_size rounded up to a power of two >= 16
    BLOCK_M: tl.constexpr,  # rows of the query tile: BLOCK_Q tokens x NUM_QUERIES_PER_KV heads, padded
    BLOCK_Q: tl.constexpr,  # query tokens per program
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    DOT_F32: tl.constexpr,  # upcast Q, K, V to float32 before the dots (the interpreter with bfloat16)
    DOT_IEEE: tl.constexpr,  # float32 dots in IEEE precision rather than TF32
    NUM_SEGMENTS: tl.constexpr,  # 1: normalize into output; > 1: this program's share of the keys into segment_*
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - query_start
    q_block_local = q_block - (query_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= query_len:  # the grid has one spare block per request
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len  # tokens cached before this step's

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    query_index = q_block_local * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # within the request's query tokens
    head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (query_index < query_len)
    dim_mask = dims < head_size
    token = (query_start + query_index).to(tl.int64)
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        query_ptr + token[:, None] * query_stride_token + head[:, None] * query_stride_head + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)
    query_pos = context_len + query_index  # each row's position in its sequence

    # Keys the tile's queries may see: causal up to its last query, and, with a window, from its first query's
    # window on (tiles wholly before it are skipped).
    key_end = tl.minimum(context_len + (q_block_local + 1) * BLOCK_Q, seq_len)
    first_tile = 0
    if SLIDING_WINDOW > 0:
        first_tile = tl.maximum(context_len + q_block_local * BLOCK_Q - SLIDING_WINDOW + 1, 0) // TILE_SIZE
    num_tiles = (key_end + TILE_SIZE - 1) // TILE_SIZE
    if NUM_SEGMENTS > 1:  # split-KV: segment s takes the s-th of NUM_SEGMENTS equal runs of those tiles
        tiles_per_segment = (num_tiles - first_tile + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        first_tile = first_tile + segment * tiles_per_segment
        num_tiles = tl.minimum(first_tile + tiles_per_segment, num_tiles)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scores, log2 units
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator  # noqa: E741
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    tile_offsets = tl.arange(0, TILE_SIZE)
    block_table_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    kv_head_offset = kv_head * cache_stride_head
    for tile in range(first_tile, num_tiles):
        key_pos = tile * TILE_SIZE + tile_offsets
        key_mask = key_pos < seq_len
        block = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        kv_offsets = block * cache_stride_block + (key_pos % BLOCK_SIZE) * cache_stride_slot + kv_head_offset
        k = tl.load(  # [HEAD_SIZE_PADDED, TILE_SIZE]
            key_cache_ptr + kv_offsets[None, :] + dims[:, None],
            mask=dim_mask[:, None] & key_mask[None, :],
            other=0.0,
        )
        v = tl.load(  # [TILE_SIZE, HEAD_SIZE_PADDED]
            value_cache_ptr + kv_offsets[:, None] + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if DOT_IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale_log2  # [BLOCK_M, TILE_SIZE]
        visible = key_mask[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf; exponents are taken against 0 there, so its
        # probabilities are exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        if DOT_IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    if NUM_SEGMENTS == 1:
        # A row that saw no key (a request with seq_len 0) has l = 0 and acc = 0: its output is 0, not NaN.
        out = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        tl.store(
            output_ptr + token[:, None] * output_stride_token + head[:, None] * output_stride_head + dims[None, :],
            out.to(output_ptr.dtype.element_ty),
            mask=q_mask,
        )
    else:  # an empty segment stores m = -inf, l = 0, acc = 0, which reduce_segments_kernel weighs 0
        segment_index = (token * num_heads + head) * NUM_SEGMENTS + segment
        tl.store(segment_max_ptr + segment_index, m, mask=row_mask)
        tl.store(segment_sum_ptr + segment_index, l, mask=row_mask)
        tl.store(
            segment_acc_ptr + segment_index[:, None] * HEAD_SIZE_PADDED + dims[None, :], acc, mask=row_mask[:, None]
        )


@triton.jit(do_not_specialize=["num_reqs"])
def reduce_segments_kernel(
    output_ptr,  # [num_tokens, num_heads, head_size]
    segment_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] float32, running max per segment, log2 units
    segment_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] float32, softmax denominator per segment
    segment_acc_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED] float32, unnormalized output
    query_start_loc_ptr,  # [num_reqs + 1] int32
    num_reqs,
    num_heads,
    output_stride_token,
    output_stride_head,
    head_size,
    NUM_SEGMENTS: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
):
    """One (token, query head): the segments' partial softmaxes rescaled to their common max and summed (vLLM's
    ``reduce_segments``)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # a row past the batch's requests: no segments written
        return
    segments = tl.arange(0, NUM_SEGMENTS)
    dims = tl.arange(0, HEAD_SIZE_PADDED)
    index = (token * num_heads + head) * NUM_SEGMENTS + segments
    m = tl.load(segment_max_ptr + index)
    l = tl.load(segment_sum_ptr + index)  # noqa: E741
    acc = tl.load(segment_acc_ptr + index[:, None] * HEAD_SIZE_PADDED + dims[None, :])
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - tl.where(m_max > float("-inf"), m_max, 0.0))  # 0 for empty segments
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        output_ptr + token * output_stride_token + head * output_stride_head + dims,
        out.to(output_ptr.dtype.element_ty),
        mask=dims < head_size,
    )


INTERPRETED: bool = isinstance(unified_attention_kernel, InterpretedFunction)
