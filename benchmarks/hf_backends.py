"""The transformers backends of ``bench throughput``: ``generate`` in static batches and ``generate_batch`` (its
continuous batching with paged attention), on CPU or CUDA, greedy, exactly ``output_len`` tokens per request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.workload import RequestSet


def _load_hf(model: Path, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=getattr(torch, dtype), attn_implementation="sdpa", device_map=device
    )
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos
    return hf.eval()


def _hf_config(output_len: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)


def run_hf_generate(
    model: Path, requests: RequestSet, dtype: str, batch_size: int, device: str = "cpu"
) -> tuple[float, list[list[int]]]:
    """transformers ``generate`` over static batches, left-padded with id 0 and masked."""
    import torch

    hf = _load_hf(model, dtype, device)

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=_hf_config(max_new_tokens))
        return out[:, width:].tolist()

    generate(requests.prompts[:2], 4)
    start = time.perf_counter()
    outputs: list[list[int]] = []
    for i in range(0, len(requests.prompts), batch_size):
        outputs += generate(requests.prompts[i : i + batch_size], requests.output_len)
    return time.perf_counter() - start, outputs


def run_hf_generate_batch(
    model: Path, requests: RequestSet, dtype: str, device: str = "cpu"
) -> tuple[float, list[list[int]]]:
    """transformers ``generate_batch``: its continuous batching with paged attention, with its own defaults (on
    CUDA: CUDA graphs, KV cache from 90% of free memory).

    ``generate_batch`` sizes its manager for the requests it is given and, on CUDA, captures CUDA graphs before
    it starts them (its warm-up): work before the first request, not part of it. So the timed run uses the
    context manager ``generate_batch`` itself is built on, with the same workload hints, and times from
    ``add_requests`` (after the warm-up) to the last result.

    Raises:
        RuntimeError: transformers' generation thread stopped before every request finished.
    """
    import torch
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hf = _load_hf(model, dtype, device)
    config = _hf_config(requests.output_len)
    hints = WorkloadHints(
        max_prompt_length=max(requests.prompt_lens),
        max_generated_length=requests.output_len,
        num_requests=len(requests.prompts),
    )
    with torch.inference_mode():
        hf.generate_batch(requests.prompts[:2], generation_config=_hf_config(4), progress_bar=False)  # first use
        with hf.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5, workload_hints=hints
        ) as manager:
            start = time.perf_counter()
            request_ids = manager.add_requests(inputs=requests.prompts, max_new_tokens=requests.output_len)
            results: dict[str, Any] = {}
            while len(results) < len(request_ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError(f"generate_batch stopped after {len(results)} of {len(request_ids)} requests")
            wall = time.perf_counter() - start
    outputs = [list(results[request_id].generated_tokens) for request_id in request_ids]
    return wall, outputs
