"""Prefill attention: the compiled CPU kernel against the torch reference's, side by side in one run.

``python -m benchmarks.prefill_attention`` prints, per case, the median time of one layer's prefill attention of
``small`` (8 query heads, 4 KV heads of 64, float32, block size 16) through the paged prefill kernel
(``kernels/attention/csrc/prefill_attention_cpu.cpp``) and through the reference's loop of torch's
``scaled_dot_product_attention`` calls (``kernels.attention.torch_ref.prefill_attention``: one per request, over a
gathered copy of its blocks and a mask where it has cached tokens), their ratio, and the kernel's rate in GFLOP/s of
the causal attention's products (2 x 2 x head_size per query head and visible key). The KV cache is written before
the timed calls: only the attention is timed. Cases: the throughput benchmark's 64 prompts (log-normal lengths,
median 100), one 2048-token prompt, and 8 chunks of 512 tokens after 1536 cached ones each (chunked prefill,
prefix caching).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.workload import PROMPT_LEN_MEDIAN, PROMPT_LEN_RANGE, PROMPT_LEN_SIGMA, Machine
from kernels import AttentionMetadata
from kernels.attention import cpu_ops
from kernels.attention.torch_ref import prefill_attention
from splitserve.base import envs

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 4, 64, 16


def benchmark_prompt_lens(num_requests: int = 64, seed: int = 0) -> list[int]:
    """The throughput benchmark's prompt lengths (``benchmarks.workload.make_request_set``'s draw)."""
    rng = np.random.default_rng(seed)
    lo, hi = PROMPT_LEN_RANGE
    lens = rng.lognormal(np.log(PROMPT_LEN_MEDIAN), PROMPT_LEN_SIGMA, num_requests).astype(int)
    return np.clip(lens, lo, hi).tolist()


# name -> (cached tokens, new tokens) per request
CASES: dict[str, list[tuple[int, int]]] = {
    "64 prompts (the throughput set)": [(0, n) for n in benchmark_prompt_lens()],
    "1 prompt of 2048": [(0, 2048)],
    "8 chunks of 512 after 1536": [(1536, 512)] * 8,
}


def make_step(requests: list[tuple[int, int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A prefill step over a random float32 cache already holding every request's keys and values, its blocks
    scattered: (query [num_tokens, NUM_HEADS, HEAD_SIZE], kv_cache, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [cached + new for cached, new in requests]
    blocks_per_req = [-(n // -BLOCK_SIZE) for n in lengths]
    num_blocks = sum(blocks_per_req) + 1
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    metadata = AttentionMetadata.for_requests(block_table, requests, BLOCK_SIZE)
    query = torch.randn(metadata.query_start_loc_cpu[-1], NUM_HEADS, HEAD_SIZE, generator=gen)
    return query, kv_cache, metadata


def own_keys(kv_cache: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new keys and values ([num_tokens, NUM_KV_HEADS, HEAD_SIZE]), read back from the cache: what the
    reference attends over for a request with nothing cached."""
    keys, values = [], []
    for i in range(metadata.num_reqs):
        start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
        seq_len = metadata.seq_lens_cpu[i]
        slots = torch.arange(seq_len - (end - start), seq_len)
        blocks = metadata.block_table[i, slots // BLOCK_SIZE].long()
        keys.append(kv_cache[0, blocks, slots % BLOCK_SIZE])
        values.append(kv_cache[1, blocks, slots % BLOCK_SIZE])
    return torch.cat(keys), torch.cat(values)


def causal_flops(requests: list[tuple[int, int]]) -> float:
    """Multiplies and adds of the products (scores and weighted values) over the keys each query token sees."""
    visible = sum(new * cached + new * (new + 1) / 2 for cached, new in requests)
    return 2 * 2 * HEAD_SIZE * NUM_HEADS * visible


def median_s(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_case(requests: list[tuple[int, int]], repeats: int) -> tuple[float, float]:
    """Median seconds of the kernel's and the reference's prefill attention over one step of ``requests``, after
    checking that they agree."""
    query, kv_cache, metadata = make_step(requests)
    key, value = own_keys(kv_cache, metadata)
    out, reference_out = torch.empty_like(query), torch.empty_like(query)
    scale = HEAD_SIZE**-0.5

    def kernel() -> None:
        cpu_ops.paged_prefill_attention(out, query, kv_cache[0], kv_cache[1], metadata, scale, None)

    def reference() -> None:
        prefill_attention(query, key, value, kv_cache, metadata, scale, None, reference_out)

    times = median_s(kernel, repeats), median_s(reference, repeats)
    torch.testing.assert_close(out, reference_out, atol=1e-4, rtol=0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    cpu_ops.load(envs.kernel_dir())
    machine = Machine.current()
    print(
        f"CPU {machine.cpu} ({machine.cores} CPUs; flags {', '.join(machine.cpu_flags)}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; one layer of 'small', float32"
    )
    print(f"{'case':<34} {'kernel ms':>10} {'reference ms':>13} {'ratio':>6} {'kernel GFLOP/s':>15}")
    for name, requests in CASES.items():
        kernel, reference = time_case(requests, args.repeats)
        rate = causal_flops(requests) / kernel / 1e9
        print(f"{name:<34} {kernel * 1e3:>10.2f} {reference * 1e3:>13.2f} {reference / kernel:>6.2f} {rate:>15.0f}")


if __name__ == "__main__":
    main()
