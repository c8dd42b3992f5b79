"""int8 (``--quantization int8``): the quantizer on a hand-checked matrix, the W8A8 matmul against a float64
reference on odd shapes, the layer's routes against its
dequantized weight, and the engine against the float32 engine on a checkpoint whose weights a reference
quantizer written here (float64) replaced by their dequantized values."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from core_svc.config import CoreConfig
from core_svc.cpu_dtype import cpu_compute_dtype, cpu_flags
from core_svc.models import quantization
from core_svc.models.quantization import (
    INT8PACK_MAX_ROWS,
    Int8Linear,
    int8_linear_w8a8,
    quantize_int8_per_channel,
    quantize_int8_per_row,
)
from tests.helpers import cpu_kernels_loaded, make_engine, needs_cpu_kernels, run_engine

QUANTIZED_FRAGMENTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def test_quantize_small_matrix_by_hand():
    w = torch.tensor([[1.27, -0.5, 0.0], [0.0, 0.0, 0.0], [0.25, -0.6, 0.15]])
    q, scales = quantize_int8_per_channel(w)
    # row 0: scale 1.27 / 127 = 0.01 -> 127, -50, 0; row 1: all zero -> scale 1, q 0;
    # row 2: scale 0.6 / 127 -> 0.25 / scale = 52.9 -> 53, -127, 0.15 / scale = 31.75 -> 32
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, -50, 0], [0, 0, 0], [53, -127, 32]]
    assert scales.tolist() == pytest.approx([0.01, 1.0, 0.6 / 127], rel=1e-6)


def reference_dequantized(w: torch.Tensor) -> torch.Tensor:
    """The per-channel absmax int8 round trip in float64, written independently of the module under test."""
    w64 = w.double()
    scale = w64.abs().max(dim=1, keepdim=True).values / 127
    return (torch.round(w64 / scale).clamp(-127, 127) * scale).float()


def reference_w8a8(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x @ w.T`` with both rounded to int8 by rows (absmax / 127), in float64, written independently of the module
    under test; and the bound on its distance from the float product: per element, the sum over k of
    ``|x||dw| + |dx||w| + |dx||dw|`` with ``|dx| <= x_scale / 2`` and ``|dw| <= w_scale / 2``."""
    x64, w64 = x.double(), w.double()
    x_scale, w_scale = (t.abs().max(dim=1, keepdim=True).values / 127 for t in (x64, w64))
    x_scale[x_scale == 0] = 1.0  # an all-zero row: any scale, its q is 0
    xq, wq = torch.round(x64 / x_scale), torch.round(w64 / w_scale)
    exact = (xq @ wq.T) * x_scale * w_scale.T
    dx, dw = x_scale / 2, w_scale / 2  # [rows, 1], [out, 1]
    bound = x64.abs().sum(1, keepdim=True) * dw.T + dx * w64.abs().sum(1, keepdim=True).T + dx * dw.T * x.shape[1]
    return exact, bound


def _vnni_gemv_built() -> bool:
    return cpu_kernels_loaded() and quantization.vnni_ops() is not None


# int8_linear_w8a8's two ways: torch's ops, and the compiled row kernels once the CPU kernels' library is loaded
ROW_PASSES = ["torch", needs_cpu_kernels("kernel")]


@pytest.fixture(params=ROW_PASSES)
def row_passes(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(quantization, "_row_kernels", lambda: None)
    else:
        assert quantization._row_kernels() is not None
    return request.param


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(5, 131, 67), (17, 64, 33), (64, 200, 96)])
def test_w8a8_matmul_against_a_float64_reference_on_odd_shapes(rows, in_features, out_features, row_passes):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    x[1] = 0.0  # an all-zero row: scale clamped, q 0, output the bias
    w = torch.randn(out_features, in_features, generator=generator) * 0.1
    bias = torch.randn(out_features, generator=generator)
    q, scales = quantize_int8_per_channel(w)
    out = int8_linear_w8a8(x, q, scales, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, out_features)
    exact, bound = reference_w8a8(x, w)
    # the integer sums are exact; float32 rescaling rounds at 2^-24 relative
    torch.testing.assert_close(out.double(), exact + bias.double(), rtol=1e-6, atol=1e-5)
    # and the result is within the int8 rounding's bound of the float product
    error = (out.double() - bias.double() - x.double() @ w.double().T).abs()
    assert bool((error <= bound + 1e-5).all())
    assert torch.equal(out[1], bias)
    xq, x_scales = quantize_int8_per_row(x)
    assert xq.dtype == torch.int8 and int(xq.abs().max()) == 127 and x_scales.shape == (rows, 1)


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(5, 131, 67), (64, 512, 96), (3, 1408, 16)])
def test_row_kernels_equal_torchs_ops_bit_for_bit(rows, in_features, out_features, dtype):
    """The compiled passes against the torch ops they replace: the same int8 values and scales (an all-zero row's q
    0), the same rescaled products with and without a bias."""
    ops = quantization._row_kernels()
    generator = torch.Generator().manual_seed(rows * in_features)
    x = (torch.randn(rows, in_features, generator=generator) * torch.rand(rows, 1, generator=generator) * 4).to(dtype)
    x[0] = 0.0
    q_ref, scales_ref = quantize_int8_per_row(x)
    q, scales = torch.empty(x.shape, dtype=torch.int8), torch.empty(rows)
    ops.quantize_rows_int8(q, scales, x)
    assert torch.equal(q, q_ref) and not q[0].any()
    assert torch.equal(scales[1:], scales_ref[1:, 0])
    w_q, w_scales = quantize_int8_per_channel(torch.randn(out_features, in_features, generator=generator))
    acc = torch._int_mm(q, w_q.t())
    bias = torch.randn(out_features, generator=generator)
    out = torch.empty(acc.shape)
    ops.dequantize_rows(out, acc, scales, w_scales, None)
    assert torch.equal(out, acc.float().mul_(scales_ref).mul_(w_scales))
    ops.dequantize_rows(out, acc, scales, w_scales, bias)
    assert torch.equal(out, acc.float().mul_(scales_ref).mul_(w_scales) + bias)


@pytest.mark.skipif(not _vnni_gemv_built(), reason="no AVX-512 VNNI kernel here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 512, 1536), (4, 131, 67), (3, 1408, 1029), (2, 64, 5), (1, 17, 3)],
)
def test_int8_gemv_equals_the_w8a8_path_bit_for_bit(rows, in_features, out_features, dtype):
    """A few rows through int8_gemv (u8 offset corrected by the weight rows' sums, a masked tail past the last 64
    columns, out_features not a multiple of its block of 8, or below it) against int8_linear_w8a8, with and without
    a bias."""
    generator = torch.Generator().manual_seed(out_features)
    for bias in (True, False):
        linear = nn.Linear(in_features, out_features, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
        layer = Int8Linear(linear)
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        reference = int8_linear_w8a8(x, layer.weight_int8, layer.scales, None if layer.bias is None else layer.bias)
        assert torch.equal(layer(x), reference)  # float rows, quantized inside int8_gemv
        ops = quantization.vnni_ops()
        x_int8, x_scales = quantization._quantize_rows(ops, x)  # int8 rows with their scales: the same values
        out = torch.empty(rows, out_features)
        bias_f32 = None if layer.bias is None else layer.bias.float()
        ops.int8_gemv(out, x_int8, x_scales, layer.weight_int8, layer.scales, layer.weight_sums, bias_f32)
        assert torch.equal(out.to(dtype), reference)


def test_int8_linear_takes_zero_rows_and_int8_gemv_names_what_is_wrong():
    layer = Int8Linear(nn.Linear(64, 40, bias=True))
    assert layer(torch.empty(0, 64)).shape == (0, 40)
    if _vnni_gemv_built():
        ops = quantization.vnni_ops()
        weights = (layer.weight_int8, layer.scales, layer.weight_sums, None)
        with pytest.raises(RuntimeError, match="1 to 4 rows, got 0"):
            ops.int8_gemv(torch.empty(0, 40), torch.empty(0, 64, dtype=torch.int8), torch.empty(0), *weights)
        with pytest.raises(RuntimeError, match="x_scales: float32, one per row of int8 x"):
            ops.int8_gemv(torch.empty(1, 40), torch.zeros(1, 64, dtype=torch.int8), None, *weights)
        with pytest.raises(RuntimeError, match="x_scales: only with int8 x"):
            ops.int8_gemv(torch.empty(1, 40), torch.zeros(1, 64), torch.ones(1), *weights)


def test_a_nan_in_a_row_makes_that_rows_products_nan_either_way(row_passes):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=generator)
    x[2, 9] = float("nan")
    q, scales = quantize_int8_per_channel(torch.randn(16, 64, generator=generator))
    out = int8_linear_w8a8(x, q, scales, None)
    assert bool(out[2].isnan().all())
    assert bool(out[[0, 1, 3, 4, 5, 6]].isfinite().all())


def test_int_mm_exactness_is_what_a_product_shows():
    """``int_mm_is_exact`` against an independent random product, in this process and in a child whose oneDNN is
    held to AVX2 (no VNNI). There the int8 sums saturated on an Intel Xeon (u8 x s8 pairs into int16) and were exact,
    through a slower kernel, on an AMD Zen 3: the answer is the product's, whichever it is."""
    check = (
        "import torch\n"
        "from core_svc.models.quantization import int_mm_is_exact\n"
        "g = torch.Generator().manual_seed(7)\n"
        "a = torch.randint(-127, 128, (64, 512), dtype=torch.int8, generator=g)\n"
        "b = torch.randint(-127, 128, (512, 96), dtype=torch.int8, generator=g)\n"
        "print(int_mm_is_exact(), torch.equal(torch._int_mm(a, b).double(), a.double() @ b.double()))\n"
    )
    generator = torch.Generator().manual_seed(7)
    a = torch.randint(-127, 128, (64, 512), dtype=torch.int8, generator=generator)
    b = torch.randint(-127, 128, (512, 96), dtype=torch.int8, generator=generator)
    assert quantization.int_mm_is_exact() == torch.equal(torch._int_mm(a, b).double(), a.double() @ b.double())
    if platform.machine() not in ("x86_64", "AMD64"):
        return
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    said, exact = result.stdout.split()
    assert said == exact  # both "True" or both "False"


def test_int8_linear_without_exact_int_mm_multiplies_by_the_dequantized_weight(monkeypatch):
    monkeypatch.setattr(quantization, "int_mm_is_exact", lambda: False)
    generator = torch.Generator().manual_seed(3)
    linear = nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=generator))
        linear.bias.copy_(torch.randn(48, generator=generator))
    layer = Int8Linear(linear)
    x = torch.randn(16, 64, generator=generator)
    expected = x.double() @ layer.dequantized_weight().double().T + linear.bias.detach().double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "few_rows",
    [
        "int8pack",
        pytest.param("vnni", marks=pytest.mark.skipif(not _vnni_gemv_built(), reason="no AVX-512 VNNI kernel here")),
    ],
)
def test_int8_linear_routes_by_rows(few_rows, monkeypatch):
    if few_rows == "int8pack":
        monkeypatch.setattr(quantization, "vnni_ops", lambda: None)
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator) * 0.1)
        linear.bias.copy_(torch.randn(40, generator=generator))
    layer = Int8Linear(linear)
    w = reference_dequantized(linear.weight)
    torch.testing.assert_close(layer.dequantized_weight(), w, rtol=1e-6, atol=1e-7)
    # more rows than INT8PACK_MAX_ROWS: activations quantized per row too, integer product
    x = torch.randn(INT8PACK_MAX_ROWS + 3, 96, generator=generator)
    exact, _ = reference_w8a8(x, linear.weight)
    torch.testing.assert_close(layer(x).double(), exact + linear.bias.double(), rtol=1e-6, atol=1e-5)
    x1 = x[:1]
    out1 = layer(x1)
    assert out1.dtype == torch.float32
    if few_rows == "vnni":  # one row: quantized as in W8A8, the integer dot products of int8_gemv
        exact1, _ = reference_w8a8(x1, linear.weight)
        torch.testing.assert_close(out1.double(), exact1 + linear.bias.double(), rtol=1e-6, atol=1e-5)
        return
    # one row: bfloat16 activations into torch._weight_int8pack_mm, its bfloat16 output rounded (2^-8 relative)
    expected1 = x1.bfloat16().double() @ w.double().T + linear.bias.double()
    torch.testing.assert_close(out1.double(), expected1, rtol=2**-7, atol=2e-2)
    # 2 rows of a width torch._weight_int8pack_mm reads out of bounds (not a multiple of 16): W8A8 instead
    odd = Int8Linear(torch.nn.Linear(40, 24, bias=False))
    x2 = torch.randn(2, 40, generator=generator)
    exact2, _ = reference_w8a8(x2, odd.dequantized_weight())
    torch.testing.assert_close(odd(x2).double(), exact2, rtol=1e-5, atol=1e-5)


def is_quantized(name: str) -> bool:
    """A linear weight of the decoder or the LM head (biases and norms stay float)."""
    return name.endswith(".weight") and any(fragment in name for fragment in QUANTIZED_FRAGMENTS)


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of checkpoint ``src`` in ``dst`` whose linear weights hold their int8 round trip."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            quantized = {k: reference_dequantized(v) if is_quantized(k) else v for k, v in tensors.items()}
            save_file(quantized, dst / f.name, metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def prompts(vocab_size: int, num: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (8 + 5 * i,), generator=generator).tolist() for i in range(num)]


# qwen2: q/k/v biases, kept float beside int8 weights; qwen3: per-head q/k norms, untied (the tiny tied one repeats
# its last prompt token at logprob ~0 whatever the weights, so its logprobs test nothing)
@pytest.mark.parametrize(
    ("arch", "overrides"), [("llama", None), ("qwen2", None), ("qwen3", {"tie_word_embeddings": False})]
)
def test_int8_engine_close_to_float_engine_on_dequantized_weights(checkpoint, tmp_path, arch, overrides):
    path = checkpoint(arch, config_overrides=overrides) if overrides else checkpoint(arch)
    reference_path = dequantized_checkpoint(path, tmp_path / "dequantized")
    # 6 requests: every step has more rows than INT8PACK_MAX_ROWS, so the int8 layers quantize their activations
    # per row as well (W8A8): the reference has the same weights, float activations, and int8's default KV cache
    # (bfloat16: kv_cache_dtype_for)
    batch = prompts(2048, 6)
    ours, _ = run_engine(make_engine(path, quantization="int8"), batch, 16)
    ref, _ = run_engine(make_engine(reference_path, kv_cache_dtype="bfloat16"), batch, 16)
    drifts = []
    for a, b in zip(ours, ref, strict=True):
        # the logprob of the reference's token at each step while both have generated the same tokens
        for i, (lp_a, lp_b) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            token = b.token_ids[i]
            drifts.append(abs(lp_a[token] - lp_b[token]) if token in lp_a else float("inf"))
            if a.token_ids[i] != token:
                break
    assert len(drifts) >= 6 * 2
    # the activations' rounding alone (about 0.4% of each row's largest value); a wrong scale or transposed weight
    # moves logprobs by nats
    assert max(drifts) < 0.1, sorted(drifts)[-5:]


def test_int8_logprobs_are_the_same_through_prefix_hits_and_prefill_chunks(checkpoint):
    """int8's bfloat16 KV cache holds each key and value rounded once as stored, and W8A8 quantizes each row on its
    own, so a prompt's logprobs do not depend on whether its prefix came from the cache or how its prefill was
    chunked."""
    path = checkpoint("qwen2")
    [prompt] = prompts(2048, 1)
    prompt = prompt + prompts(2048, 13)[-1]  # 8 + 68 tokens: four full blocks to hit and a partial one
    engine = make_engine(path, quantization="int8", max_num_batched_tokens=24)
    assert engine.kv_cache_dtype == torch.bfloat16
    runs = {
        "chunks of 24": run_engine(engine, [prompt], 6)[0][0],
        "its prefix from the cache": run_engine(engine, [prompt], 6)[0][0],
        "one chunk, no cache": run_engine(
            make_engine(path, quantization="int8", enable_prefix_caching=False), [prompt], 6
        )[0][0],
    }
    assert runs["its prefix from the cache"].num_cached_tokens == 64  # four blocks of 16
    reference = runs.pop("chunks of 24")
    for name, run in runs.items():
        assert run.token_ids == reference.token_ids, name
        for step, token in enumerate(reference.token_ids):
            assert run.logprobs[step][token] == pytest.approx(reference.logprobs[step][token], abs=1e-5), name


def test_int8_engine_logprobs_close_to_float32(checkpoint):
    path = checkpoint("llama")
    batch = prompts(2048, 2)  # 2 requests: decode steps of at most INT8PACK_MAX_ROWS rows
    ours, _ = run_engine(make_engine(path, quantization="int8"), batch, 4)
    ref, _ = run_engine(make_engine(path), batch, 4)
    drifts = []
    for a, b in zip(ours, ref, strict=True):
        # the first token comes from the prefill (W8A8: activations quantized too); the next from int8_gemv (the
        # same W8A8 values) on a CPU with AVX-512 VNNI, else from int8pack (bfloat16 activations)
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            sampled = next(iter(lp_b))
            if sampled in lp_a:
                drifts.append(abs(lp_a[sampled] - lp_b[sampled]))
    # the same tokens' logprobs in both: greedy agrees on these 2 x 4 steps
    assert len(drifts) == 8
    # measured 0.079 on this checkpoint with int8pack decode steps; 0.066 with VNNI and int8's bfloat16 KV cache
    # (0.072 with --kv-cache-dtype float32); a bug moves them by > 1
    assert max(drifts) < 0.15


def test_quantization_flag_errors():
    with pytest.raises(ValueError, match="quantization must be one of int8"):
        CoreConfig(model="m", quantization="fp8")  # type: ignore[arg-type]  # the refused value is the point
    with pytest.raises(ValueError, match="runs on CPU only"):
        CoreConfig(model="m", device="cuda", quantization="int8")


@pytest.mark.parametrize(
    ("requested", "flags", "expected", "missing"),
    [
        (torch.bfloat16, {"avx2", "fma"}, torch.float32, "avx512_bf16, amx_bf16"),
        (torch.bfloat16, {"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, None),
        (torch.bfloat16, {"avx2", "amx_bf16"}, torch.bfloat16, None),
        (torch.float16, {"avx2", "avx512_bf16", "amx_bf16"}, torch.float32, "avx512_fp16, amx_fp16"),
        (torch.float16, {"avx512_fp16"}, torch.float16, None),
        (torch.float32, {"avx2"}, torch.float32, None),
        (torch.bfloat16, set(), torch.bfloat16, None),  # flags unknown (not Linux x86): the request stands
    ],
)
def test_cpu_compute_dtype_by_flags(requested, flags, expected, missing):
    dtype, warning = cpu_compute_dtype(requested, frozenset(flags))
    assert dtype == expected
    if missing is None:
        assert warning is None
    else:
        assert warning is not None and f"(none of the flags {missing})" in warning and "runs in float32" in warning


@pytest.mark.parametrize(
    ("requested", "flags", "advice"),
    [
        (
            torch.bfloat16,
            {"avx2", "fma"},
            "int8 compresses the weights and runs faster than float32 on this CPU (through",
        ),
        (
            torch.bfloat16,
            {"avx2", "avx512f", "avx512_vnni"},
            "int8 compresses the weights and runs faster than float32 ",
        ),
        (torch.bfloat16, {"sse4_2"}, "--quantization int8 compresses the weights on this CPU;"),
        (torch.float16, {"avx2", "avx512_vnni", "avx512_bf16"}, "--dtype bfloat16 runs in 16 bits on this CPU"),
    ],
)
def test_the_fallback_warning_names_what_compresses_on_this_cpu(requested, flags, advice):
    """int8 is faster than float32 with int8 dot products (VNNI, AMX) and, through the AVX2 kernel, with AVX2; a CPU
    with bfloat16 but not float16 is pointed at bfloat16."""
    _, warning = cpu_compute_dtype(requested, frozenset(flags))
    assert (
        warning is not None and advice in warning and warning.endswith("--kv-cache-dtype bfloat16 halves the KV cache")
    )


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    )
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
def test_row_quantization_rounds_halves_to_even_in_the_vector_and_tail_parts():
    """Values exactly halfway between integers once divided by the row's scale (1.0 here: 127 is the largest),
    in the first 16 values (the AVX-512 path for float32) and after them (the scalar tail)."""
    halves = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5]
    x = torch.tensor([[127.0, *halves, *([0.0] * 7), *halves, 4.5]])  # 25 values: 16 in vectors, 9 in the tail
    expected_q, expected_scales = quantize_int8_per_row(x)
    assert expected_q[0, 1:9].tolist() == [0, 2, 2, 0, -2, -2, 4, 126]  # torch.round: halves to even
    for dtype in (torch.float32, torch.bfloat16):
        q, scales = quantization._quantize_rows(quantization._row_kernels(), x.to(dtype))
        assert torch.equal(q, expected_q) and torch.equal(scales, expected_scales[:, 0])
