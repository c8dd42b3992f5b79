"""Decode attention: the compiled CPU kernel against the torch reference, alone and in the whole engine.

``python -m benchmarks.decode_attention [--model DIR]`` prints, per case, the median time of one attention call of
each backend (a layer of the ``small`` preset: 8 query heads, 4 KV heads of 64, float32, block size 16) and their
ratio, and the kernel's time over a bfloat16 cache (``--kv-cache-dtype bfloat16``: half the bytes read) with its
ratio to the float32 cache's; with ``--model``, also the engine's output tokens/s with each backend (64 requests,
prompts of 64-400 random tokens, 64 greedy output tokens each). Together: what falling back to the reference costs
(``kernels.attention.backend`` quotes it). The requests' blocks are scattered over the cache, as after a while
of serving.

The last columns give the kernel's rate over the float32 cache, in GB/s of keys and values read: warm (the same
call repeated, the cache in L2 or L3 where it fits: the first case fits in L2) and cold (the CPU's caches
overwritten before each call, the cache read from memory). Warm about as slow as cold means the kernel's own work,
not the memory, bounds it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from core_svc.config import AttentionBackendName
from kernels import AttentionMetadata, get_attention_backend
from splitserve.base import envs

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 4, 64, 16
# (requests, context lengths): the throughput workload's decode batch (mean context about 200 tokens), and
# longer contexts.
CASES = [(4, (192, 208)), (64, (64, 400)), (64, (512, 1536)), (8, (512, 1536))]
# Bytes written between cold calls: more than any last-level cache these benchmarks have met (105 MB).
FLUSH_BYTES = 256 << 20


def make_batch(
    num_reqs: int, lengths: tuple[int, int], seed: int = 0, cache_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode token per request over a random cache in ``cache_dtype`` (float32 queries, keys and values):
    (query, key, value, kv_cache) and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(lengths[0], lengths[1] + 1, (num_reqs,), generator=gen, dtype=torch.int32)
    blocks_per_req = [-(int(n) // -BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(cache_dtype)
    metadata = AttentionMetadata.for_decodes(block_table, seq_lens, BLOCK_SIZE)
    query = torch.randn(num_reqs, NUM_HEADS, HEAD_SIZE, generator=gen)
    key = torch.randn(num_reqs, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    value = torch.randn(num_reqs, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    return query, key, value, kv_cache, metadata


def time_backend(name: str, batch: tuple, repeats: int, flush: torch.Tensor | None = None) -> float:
    """Median seconds of one forward (after one untimed call); ``flush``: a tensor written before each call (not
    timed), to push the cache out of the CPU's caches."""
    backend = get_attention_backend(name, "cpu", envs.kernel_dir())
    query, key, value, kv_cache, metadata = batch
    times = []
    for i in range(repeats + 1):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        backend.forward(query, key, value, kv_cache, metadata, HEAD_SIZE**-0.5, None)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def cache_bytes(batch: tuple) -> int:
    """Bytes of keys and values one forward over ``batch`` reads (every cached token's, the new one's included)."""
    _, _, _, kv_cache, metadata = batch
    per_token = 2 * NUM_KV_HEADS * HEAD_SIZE * kv_cache.element_size()
    return int(metadata.seq_lens.sum()) * per_token


def engine_output_tokens_per_s(
    model: Path, backend: AttentionBackendName, num_requests: int = 64, output_len: int = 64
) -> float:
    """Output tokens/s of an in-process engine core with ``backend`` on seeded random prompts of 64-400 tokens."""
    from core_svc.config import CoreConfig
    from core_svc.engine_core import EngineCore
    from core_svc.request import Request
    from core_svc.sampling_params import SamplingParams

    core = EngineCore(CoreConfig(model=str(model), attention_backend=backend))
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(3, core.vocab_size) for _ in range(rng.randint(64, 400))]
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        core.add_request(Request(request_id=str(i), prompt_token_ids=prompt, sampling_params=params))
    start = time.perf_counter()
    while core.has_unfinished_requests():
        core.step()
    return num_requests * output_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--model", type=Path, default=None, help="also run the engine on this checkpoint")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one layer of 'small', float32")
    header = f"{'requests':>8} {'context':>10} {'kernel ms':>10} {'torch_ref ms':>13} {'ratio':>6}"
    print(f"{header} {'kernel, bf16 cache ms':>22} {'ratio':>6} {'warm GB/s':>10} {'cold GB/s':>10}")
    flush = torch.zeros(FLUSH_BYTES // 4)
    for num_reqs, lengths in CASES:
        batch = make_batch(num_reqs, lengths)
        kernel, reference = (time_backend(name, batch, args.repeats) for name in ("cpu", "torch_ref"))
        cold = time_backend("cpu", batch, args.repeats, flush)
        narrow = time_backend("cpu", make_batch(num_reqs, lengths, cache_dtype=torch.bfloat16), args.repeats)
        context = f"{lengths[0]}-{lengths[1]}"
        read = cache_bytes(batch)
        print(
            f"{num_reqs:>8} {context:>10} {kernel * 1e3:>10.2f} {reference * 1e3:>13.2f} {reference / kernel:>6.1f} "
            f"{narrow * 1e3:>22.2f} {kernel / narrow:>6.2f} {read / kernel / 1e9:>10.1f} {read / cold / 1e9:>10.1f}"
        )
    if args.model is not None:
        kernel = engine_output_tokens_per_s(args.model, "cpu")
        reference = engine_output_tokens_per_s(args.model, "torch_ref")
        ratio = kernel / reference
        print(f"engine on {args.model}: output tok/s {kernel:.0f} (cpu), {reference:.0f} (torch_ref), {ratio:.1f}x")


if __name__ == "__main__":
    main()
