"""A decode step's linear layers on CPU: a pass over every weight matrix of ``small`` with a few rows, each route side
by side.

``python -m benchmarks.gemv [--num-threads 1] [--rows 1] [--repeats 15] [--no-lm-head]`` builds ``small``'s 33
weight matrices (8 layers of qkv [1024, 512], o [512, 512], gate_up [2816, 512], down [512, 1408], and the LM head
[32000, 512]; ``--no-lm-head``: the 32 projections only; random values) once per precision, each layer its own (as
in a model, so a pass reads 160 MB in float32 and the next pass finds little of it in the caches), and times one
pass over all of them per route, the routes interleaved round by round:
- float32: ``packed`` (oneDNN's prepacked weight, what float32's LM head runs without the panel kernel),
  ``column-major`` (``F.linear`` on the weight stored transposed, what float32's projections run without it),
  ``panels`` (the compiled panel kernel on ``pack_panels``' layout, what every float32 ``Linear`` runs where the
  build has AVX-512F or AVX2), ``mkl`` (``F.linear`` on the weight as loaded), ``gemv`` (the compiled kernel on the
  dense weight, ``--dense-decode-weights``; at most 4 rows);
- bfloat16: ``packed`` (oneDNN's prepacked weight, what bfloat16 runs without AMX), ``amx`` (the compiled AMX kernel
  on the dense weight, what bfloat16 runs at 5 to ``AMX_MAX_ROWS`` rows on a CPU with AMX), ``dense`` (``F.linear``
  on the dense weight: oneDNN repacks it per call; what it runs above ``AMX_MAX_ROWS`` rows there), ``gemv``;
- int8: ``int8pack`` (``torch._weight_int8pack_mm``, weight-only), ``int8_gemv`` (the compiled VNNI kernel, with the
  activations' per-row quantization).
A route the machine cannot run (no compiled kernel, no AVX-512 BF16, AMX or VNNI) is left out and named. Prints the
median ms per pass, the weight bytes read per second, and each route's ratio to the first of its precision.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.workload import Machine
from core_svc.models.layers import (
    AMX_MAX_ROWS,
    GEMV_MAX_ROWS,
    amx_fits,
    compiled_amx_linear,
    compiled_gemv,
    compiled_panel_linear,
    pack_panels,
)
from core_svc.models.quantization import Int8Linear, vnni_ops
from kernels.attention import cpu_ops
from splitserve.base import envs

# small: hidden 512, 8 heads and 4 KV heads of 64 (qkv: 512 + 2 * 256 rows), intermediate 1408, 8 layers,
# vocabulary 32000 (benchmarks/workload.py's preset)
LAYER_SHAPES = ((1024, 512), (512, 512), (2816, 512), (512, 1408))
SHAPES = (*LAYER_SHAPES * 8, (32000, 512))

Pass = Callable[[], object]


def gemv_pass(ops: Any, weights: list[torch.Tensor], xs: dict[int, torch.Tensor], rows: int) -> Pass:
    """A pass of the compiled ``gemv`` over ``weights``, ``xs`` the activations by in_features."""

    def run() -> None:
        for w in weights:
            ops.gemv(torch.empty(rows, w.shape[0], dtype=w.dtype), xs[w.shape[1]], w, None)

    return run


def routes(rows: int, shapes: tuple[tuple[int, int], ...] = SHAPES) -> tuple[dict[str, dict[str, Pass]], list[str]]:
    """Every route this machine can run for weights of ``shapes``, by precision, and a line for each it cannot."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    x32 = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
    out: dict[str, dict[str, Pass]] = {"float32": {}, "bfloat16": {}, "int8": {}}
    missing: list[str] = []
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]

    def packed_pass(ws: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> Pass:
        return lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w_k], p, None, "none", [], "")
            for (_, w_k), p in zip(shapes, ws, strict=True)
        ]

    out["float32"]["packed"] = packed_pass(packed, x32)
    column_major = [w.t().contiguous().t() for w in weights]
    out["float32"]["column-major"] = lambda: [F.linear(x32[w.shape[1]], w) for w in column_major]
    panel_ops = compiled_panel_linear()
    if panel_ops is None:
        missing.append("float32 panels: no panel kernel loaded (the kernels not built, or neither AVX-512F nor AVX2)")
    else:
        panels = [pack_panels(w) for w in weights]

        def panel_pass() -> list[torch.Tensor]:
            outs = [torch.empty(rows, w.shape[0]) for w in weights]
            for o, w, p in zip(outs, weights, panels, strict=True):
                panel_ops.panel_linear(o, x32[w.shape[1]], p, None)
            return outs

        out["float32"]["panels"] = panel_pass
    out["float32"]["mkl"] = lambda: [F.linear(x32[w.shape[1]], w) for w in weights]
    bf16 = [w.bfloat16() for w in weights]
    x16 = {k: v.bfloat16() for k, v in x32.items()}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        out["bfloat16"]["packed"] = packed_pass([torch.ops.mkldnn._reorder_linear_weight(w) for w in bf16], x16)
    else:
        missing.append("bfloat16 packed: oneDNN has no bfloat16 here")
    out["bfloat16"]["dense"] = lambda: [F.linear(x16[w.shape[1]], w) for w in bf16]
    amx = compiled_amx_linear()
    if amx is None or rows > AMX_MAX_ROWS or not all(amx_fits(w) for w in bf16):
        why = "no AMX kernel here" if amx is None else f"at most {AMX_MAX_ROWS} rows, shapes the kernel takes"
        missing.append(f"bfloat16 amx: {why}")
    else:

        def amx_pass() -> list[torch.Tensor]:
            outs = [torch.empty(rows, w.shape[0], dtype=torch.bfloat16) for w in bf16]
            for o, w in zip(outs, bf16, strict=True):
                amx.amx_linear(o, x16[w.shape[1]], w, None)
            return outs

        out["bfloat16"]["amx"] = amx_pass
    for dtype, ws, xs in ((torch.float32, weights, x32), (torch.bfloat16, bf16, x16)):
        ops = compiled_gemv(dtype)
        if ops is None or rows > GEMV_MAX_ROWS:
            why = "no compiled kernel for it here" if ops is None else f"at most {GEMV_MAX_ROWS} rows"
            missing.append(f"{str(dtype).removeprefix('torch.')} gemv: {why}")
            continue
        out[str(dtype).removeprefix("torch.")]["gemv"] = gemv_pass(ops, ws, xs, rows)
    int8 = []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        int8.append(Int8Linear(linear))
    out["int8"]["int8pack"] = lambda: [
        torch._weight_int8pack_mm(x16[layer.in_features], layer.weight_int8, layer.scales_bf16) for layer in int8
    ]
    vnni = vnni_ops()
    if vnni is None or rows > GEMV_MAX_ROWS:
        missing.append(f"int8 int8_gemv: {'no AVX-512 VNNI kernel here' if vnni is None else 'at most 4 rows'}")
    else:

        def int8_gemv() -> None:
            for layer in int8:
                out_ = torch.empty(rows, layer.out_features)
                vnni.int8_gemv(
                    out_, x32[layer.in_features], None, layer.weight_int8, layer.scales, layer.weight_sums, None
                )

        out["int8"]["int8_gemv"] = int8_gemv
    return {k: v for k, v in out.items() if v}, missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (gemv routes: at most 4; amx: 256)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-lm-head", action="store_true", help="the 32 projections only")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    try:
        cpu_ops.load(envs.kernel_dir())
    except cpu_ops.KernelBuildError as e:
        print(f"the compiled kernels are not available ({e.reason}): their routes are left out")
    machine = Machine.current("cpu")
    flags = ", ".join(machine.cpu_flags)
    threads = torch.get_num_threads()
    print(f"CPU {machine.cpu} ({machine.cores} CPUs; flags {flags}), torch {torch.__version__}, {threads} threads")
    with torch.inference_mode():
        shapes = SHAPES[:-1] if args.no_lm_head else SHAPES
        by_precision, missing = routes(args.rows, shapes)
        for line in missing:
            print(f"left out: {line}")
        every = {(p, r): fn for p, rs in by_precision.items() for r, fn in rs.items()}
        for fn in every.values():
            fn()
        times: dict[tuple[str, str], list[float]] = {key: [] for key in every}
        for _ in range(args.repeats):
            for key, fn in every.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
    bytes_per_element = {"float32": 4, "bfloat16": 2, "int8": 1}
    elements = sum(n * k for n, k in shapes)
    print(
        f"one pass over {len(shapes)} weight matrices ({elements / 1e6:.1f}M weights), {args.rows} row(s); "
        f"median of {args.repeats}"
    )
    print(f"{'precision':>10} {'route':>12} {'ms/pass':>8} {'GB/s':>6}  vs first")
    for precision, rs in by_precision.items():
        first = None
        for route in rs:
            ms = statistics.median(times[(precision, route)]) * 1e3
            first = first or ms
            gbs = elements * bytes_per_element[precision] / ms / 1e6
            print(f"{precision:>10} {route:>12} {ms:8.2f} {gbs:6.2f}  {ms / first:.2f}x")


if __name__ == "__main__":
    main()
