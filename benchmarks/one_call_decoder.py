"""A decode step's decoder forward on CPU, the one-call decoder (``OneCallDecoder``,
core_svc/models/one_call_decoder.py: the few-row one up to 4 rows, the batch one above) against the per-layer path
it replaces, side by side in one process; with ``--compare fused-ops``, a step of any row count with the fused
layer ops (``fused_layer_ops``) against torch's operators between the products.

``python -m benchmarks.one_call_decoder [--num-threads 1] [--rows 1] [--context 128] [--rounds 40]`` builds a
``LlamaModel`` of ``small``'s shape (8 layers, hidden 512, 8 heads and 4 KV heads of 64, intermediate 1408; random
weights: the work does not depend on them) per precision: ``float32`` (column-major weights, the default),
``float32-dense`` and ``bfloat16-dense`` (``--dense-decode-weights``: the compiled ``gemv``), ``bfloat16`` (packed)
and ``int8`` (``--quantization int8``: ``int8_gemv``); ``--arch qwen3``: that shape with Qwen3's per-head q/k
norms. It times a decode step's forward (every layer and the final
norm, not the LM head) of ``--rows`` requests over ``--context`` cached tokens each, the two paths alternating
round by round (5 forwards a round), and prints the median ms per forward of each, their difference and ratio. The
two give the same values bit for bit (tests/test_one_call_decoder.py). A precision the machine cannot run (no
oneDNN bfloat16, no VNNI kernel) is left out and named.

``--compare fused-ops --rows 64 --context 200`` times the same forward, the one call off, with ``add_rms_norm``,
``rotary_in_place`` and ``silu_and_mul`` against torch's operators (``LlamaModel.fused_ops_enabled``; the values a
few float32 ulps apart, tests/test_layers.py), for a batch's decode step.

``--model DIR`` (a checkpoint, e.g. the ``small`` bench one) also measures the whole engine: an in-process
``EngineCore`` per precision decodes one greedy request (128 seeded prompt ids, ``--output-len`` tokens) with the
one-call decoder on and off in turn, ``--engine-rounds`` times each, and prints the medians of each request's median
decode step (ms per output token).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import Machine
from core_svc.models.arch import ModelArchConfig
from core_svc.models.layers import GEMV_MAX_ROWS, compiled_gemv, prepack_linear_weights
from core_svc.models.llama import LlamaModel
from core_svc.models.quantization import quantize_linear_weights, vnni_ops
from kernels import AttentionMetadata
from kernels.attention import cpu_ops
from kernels.attention.cpu import CpuAttentionBackend
from splitserve.base import envs

PRECISIONS = ("float32", "float32-dense", "bfloat16", "bfloat16-dense", "int8")
BLOCK_SIZE = 16


def build(precision: str, rows: int = 1, arch: str = "llama") -> LlamaModel | str:
    """``small``'s decoder in ``precision``, or why this machine cannot run it (or, for ``rows`` rows, why the
    one-call decoder does not cover it). ``arch`` "qwen3": the same shape with Qwen3's per-head q/k norms."""
    from transformers import LlamaConfig, Qwen3Config

    dtype = torch.bfloat16 if precision.startswith("bfloat16") else torch.float32
    shape: dict[str, Any] = dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    hf: LlamaConfig | Qwen3Config = (
        Qwen3Config(**shape, head_dim=64, architectures=["Qwen3ForCausalLM"])
        if arch == "qwen3"
        else LlamaConfig(**shape, architectures=["LlamaForCausalLM"])
    )
    model = LlamaModel(ModelArchConfig.from_hf_config(hf), CpuAttentionBackend(envs.kernel_dir()), dtype).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((torch.randn(param.shape, generator=gen) * 0.02 + (1.0 if "norm" in name else 0.0)).to(dtype))
    if precision == "int8":
        if vnni_ops() is None:
            return "no AVX-512 VNNI kernel (int8_gemv) in this build"
        quantize_linear_weights(model)
    else:
        dense = precision.endswith("-dense")
        if dense and compiled_gemv(dtype) is None:
            return f"no gemv for {dtype} in this build"
        if not prepack_linear_weights(model, keep_dense=dense):
            return f"torch has no oneDNN for {dtype} here"
    decoder = model.one_call_decoder() if rows <= GEMV_MAX_ROWS else model.batch_decoder()
    return model if decoder is not None else f"the one-call decoder does not cover it at {rows} rows"


def step(model: LlamaModel, rows: int, context: int) -> tuple[Any, ...]:
    """A decode step of ``rows`` requests, each with ``context`` tokens cached before its new one."""
    dtype = model.norm.weight.dtype
    length = context + 1
    per_request = -(-length // BLOCK_SIZE)
    kv_caches = [torch.randn(2, rows * per_request + 1, BLOCK_SIZE, 4, 64).to(dtype) for _ in model.layers]
    table = (torch.arange(rows * per_request, dtype=torch.int32) + 1).view(rows, per_request)
    metadata = AttentionMetadata.for_decodes(table, torch.full((rows,), length, dtype=torch.int32), BLOCK_SIZE)
    return torch.arange(rows) + 5, torch.full((rows,), context), kv_caches, metadata


# --compare: the two paths timed, each as (one_call_decoder_enabled, fused_ops_enabled)
PATHS = {
    "one-call": {"one call": (True, True), "per layer": (False, True)},
    "fused-ops": {"fused ops": (False, True), "torch ops": (False, False)},
}


def measure(model: LlamaModel, rows: int, context: int, rounds: int, compare: str = "one-call") -> dict[str, float]:
    """Median ms per forward of each path of ``PATHS[compare]``, alternating round by round."""
    args = step(model, rows, context)
    paths = PATHS[compare]
    times: dict[str, list[float]] = {path: [] for path in paths}
    with torch.inference_mode():
        for _ in range(rounds):
            for path, (one_call, fused_ops) in paths.items():
                model.one_call_decoder_enabled, model.fused_ops_enabled = one_call, fused_ops
                start = time.perf_counter()
                for _ in range(5):
                    model(*args)
                times[path].append((time.perf_counter() - start) / 5 * 1e3)
    model.one_call_decoder_enabled = model.fused_ops_enabled = True
    return {path: statistics.median(values) for path, values in times.items()}


ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},
    "float32-dense": {"dtype": "float32", "dense_decode_weights": True},
    "bfloat16": {"dtype": "bfloat16"},
    "bfloat16-dense": {"dtype": "bfloat16", "dense_decode_weights": True},
    "int8": {"dtype": "float32", "quantization": "int8"},
}


def measure_engine(model: Path, precision: str, output_len: int, rounds: int, threads: int) -> dict[str, float]:
    """Median ms per output token of one request on an ``EngineCore`` of ``model`` with ``threads`` compute
    threads, the one-call decoder on and off in turn (``rounds`` requests each)."""
    import random

    from benchmarks.decode_profile import decode
    from core_svc.config import CoreConfig
    from core_svc.engine_core import EngineCore

    prompt = [random.Random(0).randrange(3, 30000) for _ in range(128)]
    num_kv_blocks = -(-(len(prompt) + output_len) // BLOCK_SIZE) + 1
    core = EngineCore(
        CoreConfig(
            model=str(model),
            block_size=BLOCK_SIZE,
            num_kv_blocks=num_kv_blocks,
            num_threads=threads,
            **ENGINE_OPTIONS[precision],
        )
    )
    decoder_model: Any = core.model_runner.model.model
    decode(core, "warmup", prompt[:16], 8)
    times: dict[str, list[float]] = {"one call": [], "per layer": []}
    for round_index in range(rounds):
        for path in times:
            decoder_model.one_call_decoder_enabled = path == "one call"
            _, step_s, _ = decode(core, f"{path}-{round_index}", prompt, output_len)
            times[path].append(statistics.median(step_s) * 1e3)
    return {path: statistics.median(values) for path, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--compare", choices=tuple(PATHS), default="one-call", help="the two paths timed")
    parser.add_argument("--rows", type=int, default=1, help="requests in the step")
    parser.add_argument("--arch", choices=("llama", "qwen3"), default="llama", help="qwen3: with per-head q/k norms")
    parser.add_argument("--context", type=int, default=128, help="tokens cached per request")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint: also time the whole engine")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per engine request")
    parser.add_argument("--engine-rounds", type=int, default=6, help="engine requests per path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    cpu_ops.load(envs.kernel_dir())
    machine = Machine.current("cpu")
    print(
        f"CPU {machine.cpu} ({machine.cores} CPUs; flags {', '.join(machine.cpu_flags)}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.rows} row(s) over {args.context} cached tokens, median of "
        f"{args.rounds} rounds"
    )
    new_path, old_path = PATHS[args.compare]
    print(f"{'precision':>15} {new_path + ' ms':>12} {old_path + ' ms':>13} {'saved ms':>9}  ratio")
    results: dict[str, Any] = {}
    for precision in PRECISIONS:
        model = build(precision, args.rows if args.compare == "one-call" else 1, args.arch)
        if isinstance(model, str):
            print(f"{precision:>15}  left out: {model}")
            results[precision] = model
            continue
        ms = measure(model, args.rows, args.context, args.rounds, args.compare)
        fused, layered = ms[new_path], ms[old_path]
        print(f"{precision:>15} {fused:>12.2f} {layered:>13.2f} {layered - fused:>9.2f}  {fused / layered:.2f}x")
        results[precision] = ms
    if args.model is not None and args.compare == "one-call":
        print(f"engine, one request ({args.model}): ms per output token, median of {args.engine_rounds} requests each")
        print(f"{'precision':>15} {'one call ms':>12} {'per layer ms':>13} {'saved ms':>9}  ratio")
        for precision in PRECISIONS:
            if isinstance(results[precision], str):
                continue
            ms = measure_engine(args.model, precision, args.output_len, args.engine_rounds, args.num_threads)
            fused, layered = ms["one call"], ms["per layer"]
            print(f"{precision:>15} {fused:>12.2f} {layered:>13.2f} {layered - fused:>9.2f}  {fused / layered:.2f}x")
            results[f"engine {precision}"] = ms
    if args.out is not None:
        report = {
            "machine": dataclasses.asdict(machine),
            "args": {k: str(v) for k, v in vars(args).items()},
            "ms": results,
        }
        args.out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
