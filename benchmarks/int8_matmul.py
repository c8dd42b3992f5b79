"""The int8 linear's routes against float32 and bfloat16, per projection shape of ``small`` and number of rows.

``python -m benchmarks.int8_matmul [--num-threads 1] [--repeats 7]`` prints, for each weight shape [N, K] of the
benchmark's ``small`` checkpoint (qkv, o, gate_up, down, the LM head) and rows 1, 4, 16, 64 and 256, the best
time of one call (interleaved repeats, the best of each: the machine's load only ever adds) of:
- float32: the weight column-major through MKL (``core_svc.models.layers.Linear``, what float32's projections
  run without the panel kernel);
- f32panels: the weight in panels through the compiled ``panel_linear`` (what every float32 ``Linear`` runs where
  the build has it: AVX-512F or AVX2); "-" where it has not;
- bfloat16: oneDNN with the weight prepacked (what bfloat16 runs);
- int8pack: ``torch._weight_int8pack_mm`` (weight-only, bfloat16 activations);
- w8a8: activations quantized per row and ``torch._int_mm`` (int8 x int8 -> int32), rescaled
  (``core_svc.models.quantization.int8_linear_w8a8``, the quantization of the activations included; its sums are
  wrong on CPUs without VNNI, where it is timed all the same);
- int8panels: activations quantized per row (the compiled pass) and the compiled AVX2 kernel ``int8_panel_linear``
  over the weight in panels (what ``Int8Linear`` runs at every row count on CPUs without VNNI); "-" where the
  build has no such kernel.
``Int8Linear`` picks its route from this table (``INT8PACK_MAX_ROWS``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from core_svc.models.layers import Linear, compiled_ops_where, compiled_panel_linear
from core_svc.models.quantization import int8_linear_w8a8, pack_int8_panels, quantize_int8_per_channel
from kernels.attention import cpu_ops
from splitserve.base import envs

# small: hidden 512, 8 heads and 4 KV heads of 64, intermediate 1408, vocabulary 32000
SHAPES = {"qkv": (1024, 512), "o": (512, 512), "gate_up": (2816, 512), "down": (512, 1408), "lm_head": (32000, 512)}
ROWS = (1, 4, 16, 64, 256)


def best_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each function's best time of ``repeats`` rounds (each a few calls), interleaved, in milliseconds."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(3):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / 3 * 1e3)
    return best


def routes(n: int, k: int, rows: int) -> dict[str, Callable[[], object]]:
    """The routes for a [n, k] weight and ``rows`` rows of activations (int8panels where the build has it)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(rows, k, generator=gen)
    f32 = Linear(k, n, bias=False)
    bf16 = Linear(k, n, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        f32.weight.copy_(weight)
        bf16.weight.copy_(weight)
    f32.prepack(column_major=True)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16.prepack()
    q, scales = quantize_int8_per_channel(weight)
    scales_bf16, x_bf16 = scales.to(torch.bfloat16), x.to(torch.bfloat16)
    found: dict[str, Callable[[], object]] = {
        "float32": lambda: f32(x),
        "bfloat16": lambda: bf16(x_bf16),
        "int8pack": lambda: torch._weight_int8pack_mm(x_bf16, q, scales_bf16),
        "w8a8": lambda: int8_linear_w8a8(x, q, scales, None),
    }
    if compiled_panel_linear() is not None:
        f32_panels = Linear(k, n, bias=False)
        with torch.no_grad():
            f32_panels.weight.copy_(weight)
        f32_panels.prepack(panels=True)
        found["f32panels"] = lambda: f32_panels(x)
    ops = compiled_ops_where("int8_panel_linear_available")
    if ops is not None:
        panels = pack_int8_panels(q)

        def int8panels() -> torch.Tensor:
            x_int8, x_scales = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows)
            ops.quantize_rows_int8(x_int8, x_scales, x)
            out = torch.empty(rows, n)
            ops.int8_panel_linear(out, x_int8, x_scales, panels, scales, None)
            return out

        found["int8panels"] = int8panels
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    try:
        cpu_ops.load(envs.kernel_dir())
    except cpu_ops.KernelBuildError as e:
        print(f"no compiled CPU kernels ({e.reason}): no int8panels column")
    names = ("float32", "f32panels", "bfloat16", "int8pack", "w8a8", "int8panels")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; best of {args.repeats}, ms per call")
    print(f"{'weight [N, K]':>22} {'rows':>5} " + " ".join(f"{name:>10}" for name in names))
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            for rows in ROWS:
                ms = best_ms(routes(n, k, rows), args.repeats)
                cells = " ".join(f"{ms[r]:10.3f}" if r in ms else f"{'-':>10}" for r in names)
                print(f"{name + f' [{n}, {k}]':>22} {rows:5d} {cells}")


if __name__ == "__main__":
    main()
