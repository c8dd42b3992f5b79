"""Single-request inter-token latency (ITL) against the weight-read bound.

One request alone decodes one token per step, and each step must read every weight the token passes through
once: no batch shares the read. So a step can take no less than ``weight bytes / memory bandwidth``, the
weight-read bound; how far above it the measured ITL sits is what the engine's per-step overheads (kernel
launches, host work, synchronization) cost. The bandwidth is ``device_limits.copy_bandwidth``, measured in the
same run; the ITL is measured at the engine core (``EngineCore.step``, one step per token, the host sync that
reads the sampled id included), without the frontend's detokenization.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.device_limits import CopyBandwidth, synchronize

# The target: a single request's ITL within this factor of the weight-read bound (CUDA graphs on).
ITL_OVER_BOUND_TARGET = 10.0


def decode_weight_bytes(model: Path, dtype: str) -> int:
    """Bytes of weights one decode step reads, in ``dtype``: every parameter of the transformers model built
    from ``model``'s config (on the meta device, so no weight is made), a tied embedding once (it is read whole
    as the LM head), an untied input embedding not at all (a step reads one row of it).

    Raises:
        OSError: ``model`` holds no readable config.json.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config)
    embedding = hf.get_input_embeddings().weight
    lm_head = hf.get_output_embeddings().weight
    params = {id(p): p for p in hf.parameters()}  # a tied parameter once
    if embedding is not lm_head:
        params.pop(id(embedding))
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return sum(p.numel() for p in params.values()) * element_size


def weight_read_bound_s(weight_bytes: int, bandwidth: CopyBandwidth) -> float:
    """Seconds to read ``weight_bytes`` at the copy's traffic rate (bytes read + written per second)."""
    return weight_bytes / bandwidth.bytes_per_s


@dataclass(frozen=True)
class SingleRequestLatency:
    device: str
    dtype: str
    cuda_graphs: bool  # CUDA graphs on (device cuda and not enforce_eager)
    prompt_len: int
    output_len: int
    ttft_ms: float  # add to first token
    itl_ms: list[float]  # output_len - 1 gaps between consecutive tokens
    itl_median_ms: float
    itl_mean_ms: float
    itl_p99_ms: float
    weight_bytes: int  # decode_weight_bytes
    copy_bandwidth_gb_s: float  # bytes read + written per second, / 1e9
    weight_read_bound_ms: float  # weight_bytes / copy bandwidth
    itl_over_bound: float  # itl_median_ms / weight_read_bound_ms
    target: float  # ITL_OVER_BOUND_TARGET
    target_met: bool  # itl_over_bound <= target

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    timing: tuple[float, list[float]], weight_bytes: int, bandwidth: CopyBandwidth, setting: dict[str, Any]
) -> SingleRequestLatency:
    """The report from a run's timing (TTFT and the ITL gaps, seconds) and the device's bandwidth. ``setting``:
    device, dtype, cuda_graphs, prompt_len, output_len.

    Raises:
        ValueError: fewer than one ITL gap (an output of one token has none).
    """
    ttft_s, gaps_s = timing
    if not gaps_s:
        raise ValueError("an ITL needs at least two output tokens")
    itl_ms = [1e3 * g for g in gaps_s]
    median = statistics.median(itl_ms)
    bound_ms = 1e3 * weight_read_bound_s(weight_bytes, bandwidth)
    ratio = median / bound_ms
    return SingleRequestLatency(
        **setting,
        ttft_ms=1e3 * ttft_s,
        itl_ms=itl_ms,
        itl_median_ms=median,
        itl_mean_ms=statistics.fmean(itl_ms),
        itl_p99_ms=float(np.percentile(itl_ms, 99)),
        weight_bytes=weight_bytes,
        copy_bandwidth_gb_s=bandwidth.bytes_per_s / 1e9,
        weight_read_bound_ms=bound_ms,
        itl_over_bound=ratio,
        target=ITL_OVER_BOUND_TARGET,
        target_met=ratio <= ITL_OVER_BOUND_TARGET,
    )


def measure(
    model: Path, prompt: list[int], output_len: int, bandwidth: CopyBandwidth, **core_config: Any
) -> SingleRequestLatency:
    """Greedy-decode ``output_len`` tokens (EOS ignored) for ``prompt`` alone on an in-process ``EngineCore`` made
    with ``core_config`` (``device``, ``dtype``, ``enforce_eager``, ...: ``CoreConfig`` fields; CUDA graphs stay
    on unless ``enforce_eager``), after a warm-up request, and time each token's arrival.

    Raises:
        RuntimeError: the request produced other than ``output_len`` tokens.
    """
    from core_svc.config import CoreConfig
    from core_svc.engine_core import EngineCore

    config = CoreConfig(model=str(model), **core_config)
    core = EngineCore(config)
    try:
        decode_timing(core, "warmup", prompt[:16], 8)
        timing = decode_timing(core, "single", prompt, output_len)
        # int8: one byte per weight (its few float32 norm weights, and a tied embedding it keeps float32, aside)
        dtype = config.quantization or str(core.dtype).removeprefix("torch.")
        setting = {
            "device": config.device,
            "dtype": dtype,
            "cuda_graphs": config.device == "cuda" and not config.enforce_eager,
            "prompt_len": len(prompt),
            "output_len": output_len,
        }
        return summarize(timing, decode_weight_bytes(model, dtype), bandwidth, setting)
    finally:
        device = config.device
        del core
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def decode_timing(core: Any, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    """TTFT and the gaps between consecutive tokens, in seconds, of one request run alone through ``core``."""
    from core_svc.request import Request
    from core_svc.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    synchronize(core.config.device)
    start = time.perf_counter()
    core.add_request(Request(request_id, list(prompt), params))
    arrivals: list[float] = []
    while core.has_unfinished_requests():
        outputs = core.step()
        now = time.perf_counter()
        for output in outputs.outputs:
            arrivals += [now] * len(output.new_token_ids)
    if len(arrivals) != output_len:
        raise RuntimeError(f"{request_id}: {len(arrivals)} tokens, expected {output_len}")
    return arrivals[0] - start, [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def format_lines(latency: dict[str, Any]) -> list[str]:
    """The summary of a ``SingleRequestLatency.to_dict()``: the ITL, and the bound it is measured against."""
    graphs = "on" if latency["cuda_graphs"] else "off"
    return [
        f"single request ({latency['dtype']}, {latency['prompt_len']} prompt tokens, {latency['output_len']} output "
        f"tokens, CUDA graphs {graphs}): ITL median {latency['itl_median_ms']:.3f} ms, mean "
        f"{latency['itl_mean_ms']:.3f}, p99 {latency['itl_p99_ms']:.3f}; TTFT {latency['ttft_ms']:.2f} ms",
        f"weight-read bound: {latency['weight_bytes'] / 1e9:.3f} GB of weights / "
        f"{latency['copy_bandwidth_gb_s']:.0f} GB/s copy bandwidth (bytes read + written) = "
        f"{latency['weight_read_bound_ms']:.4f} ms; ITL median / bound = {latency['itl_over_bound']:.2f}x",
    ]
