"""int8 products over the weight in panels (kernels/attention/csrc/int8_panel_linear_cpu.cpp), the AVX2 route of
``Int8Linear`` on CPUs without VNNI: the kernel against exact integer sums rescaled by torch's own float32 ops, bit
for bit, on odd shapes and thread counts; ``Int8Linear`` on that route against a float64 W8A8 written in the test;
and the refusals. Skipped where the build has no AVX2."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from core_svc.models import quantization
from core_svc.models.layers import Linear, compiled_ops_where
from core_svc.models.quantization import (
    INT8_PANEL_WIDTH,
    Int8Linear,
    pack_int8_panels,
    quantize_int8_per_channel,
    quantize_int8_per_row,
    quantize_linear_weights,
)
from tests.helpers import cpu_kernels_loaded

pytestmark = pytest.mark.skipif(
    not cpu_kernels_loaded() or compiled_ops_where("int8_panel_linear_available") is None,
    reason="no int8 panel kernel here (it needs a build with AVX2)",
)


def _ops():
    return compiled_ops_where("int8_panel_linear_available")


def test_pack_int8_panels_pairs_in_features_and_pads_with_zeros():
    w = torch.arange(-60, -60 + 20 * 5, dtype=torch.int8).view(20, 5)  # panels of 16 and 4 features, 3 pairs of k
    panels = pack_int8_panels(w)
    assert panels.shape == (2, 3, INT8_PANEL_WIDTH, 2) and panels.dtype == torch.int8 and panels.is_contiguous()
    for p, j, f, i in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 7, 1), (0, 2, 15, 0), (1, 0, 3, 1), (1, 2, 2, 0)]:
        assert panels[p, j, f, i] == w[INT8_PANEL_WIDTH * p + f, 2 * j + i]
    assert (panels[:, 2, :, 1] == 0).all()  # k = 5 past in_features
    assert (panels[1, :, 4:] == 0).all()  # features 20-31 past out_features


def _int8_operands(rows: int, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, ...]:
    """int8 x and w over their whole range [-127, 127] (pairs of products reach int16's limits), positive scales
    and a bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8, generator=gen)
    w = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    x[0], w[0] = 127, -127  # the extreme sum: in_features * 127^2 in magnitude
    x_scales = torch.rand(rows, generator=gen) + 0.01
    w_scales = torch.rand(out_features, generator=gen) / 100
    bias = torch.randn(out_features, generator=gen)
    return x, w, x_scales, w_scales, bias


def _expected(x, w, x_scales, w_scales, bias) -> torch.Tensor:
    """The exact integer sums (int64), then (float(sum) * x_scale) * w_scale (+ bias), each op one float32 rounding
    by torch (the sums rounded to float32 to nearest, as the kernel converts its int32 sums)."""
    sums = (x.long() @ w.long().T).float()
    out = sums * x_scales[:, None] * w_scales[None, :]
    return out if bias is None else out + bias


# (rows, out_features, in_features)
SHAPES = [
    (1, 1024, 512),  # one request: four panels side by side
    (1, 70, 33),  # one row: four panels side by side, then the partial fifth alone
    (2, 100, 37),  # two rows: three pairs of panels side by side, the partial seventh alone
    (4, 20, 16),  # four rows: the block of 6, two of its rows empty
    (5, 40, 37),  # a partial block, a partial last panel, an odd in_features
    (6, 16, 1),  # one whole block, one panel, a single in_feature
    (13, 100, 64),  # blocks of 6, 6 and 1
    (64, 2816, 512),  # small's gate_up projection at a decode batch
    (300, 48, 512),  # rows past a chunk (42 blocks of 6 at 512 in_features)
    (253, 40, 512),  # a last chunk of one row: the one-row walk
    (254, 40, 512),  # a last chunk of two rows: the two-row walk
    (40, 24, 4000),  # a chunk cut to 5 blocks (30 rows) by a wide in_features
    (8, 4112, 96),  # more panels than a parallel share: split over two threads
]


@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_exact_sums_rescaled_bit_for_bit_on_any_thread_count(
    threads, rows, out_features, in_features, with_bias
):
    x, w, x_scales, w_scales, bias = _int8_operands(rows, out_features, in_features, seed=rows + in_features)
    bias = bias if with_bias else None
    expected = _expected(x, w, x_scales, w_scales, bias)
    panels = pack_int8_panels(w)
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        out = torch.full((rows, out_features), float("nan"))
        _ops().int8_panel_linear(out, x, x_scales, panels, w_scales, bias)
        assert torch.equal(out, expected), (num_threads, (out - expected).abs().max())


def test_the_kernel_writes_only_its_output():
    """out a view inside a larger buffer: the guard bands around it keep their values."""
    x, w, x_scales, w_scales, bias = _int8_operands(7, 20, 33, seed=4)
    buffer = torch.full((7 * 20 + 64,), 12345.0)
    out = buffer[32 : 32 + 7 * 20].view(7, 20)
    _ops().int8_panel_linear(out, x, x_scales, pack_int8_panels(w), w_scales, bias)
    assert torch.equal(out, _expected(x, w, x_scales, w_scales, bias))
    assert (buffer[:32] == 12345.0).all() and (buffer[32 + 7 * 20 :] == 12345.0).all()


def test_the_kernel_names_what_is_wrong():
    x, w, x_scales, w_scales, _ = _int8_operands(3, 20, 33, seed=1)
    panels = pack_int8_panels(w)
    ops = _ops()
    out = torch.empty(3, 20)
    with pytest.raises(RuntimeError, match=r"panels: contiguous int8 \[num_panels"):
        ops.int8_panel_linear(out, x, x_scales, panels.float(), w_scales, None)
    with pytest.raises(RuntimeError, match=r"x: contiguous int8 \[rows, in_features\]"):
        ops.int8_panel_linear(out, x[:, :30].contiguous(), x_scales, panels, w_scales, None)
    with pytest.raises(RuntimeError, match=r"x: contiguous int8 \[rows, in_features\] with at least one row"):
        ops.int8_panel_linear(torch.empty(0, 20), x[:0], x_scales[:0], panels, w_scales, None)
    with pytest.raises(RuntimeError, match=r"x_scales: contiguous float32 \[rows=3\]"):
        ops.int8_panel_linear(out, x, x_scales[:2], panels, w_scales, None)
    with pytest.raises(RuntimeError, match=r"out_features in \(16, 32\]"):
        ops.int8_panel_linear(torch.empty(3, 40), x, x_scales, panels, w_scales, None)
    with pytest.raises(RuntimeError, match=r"w_scales: contiguous float32 \[out_features=20\]"):
        ops.int8_panel_linear(out, x, x_scales, panels, w_scales[:16], None)
    with pytest.raises(RuntimeError, match=r"bias: contiguous float32 \[out_features=20\]"):
        ops.int8_panel_linear(out, x, x_scales, panels, w_scales, torch.zeros(21))


def _linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.1)
        linear.bias.copy_(torch.randn(out_features, generator=gen))
    return linear


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64])
def test_int8_linear_on_panels_is_w8a8_at_every_row_count(rows, monkeypatch):
    """On a CPU without int8 dot products (forced here), ``Int8Linear`` with panels multiplies every
    row count through the kernel: the float64 W8A8 product of the per-row and per-channel int8 values, to float32
    rounding."""
    monkeypatch.setattr(quantization, "has_int8_dot_products", lambda: False)
    linear = _linear(72, 40, seed=rows)
    layer = Int8Linear(linear, panels=True)
    assert layer.weight_panels is not None and torch.equal(layer.weight_panels, pack_int8_panels(layer.weight_int8))
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(9))
    calls = []
    real = quantization.int8_panel_ops

    def counted():
        calls.append(1)
        return real()

    monkeypatch.setattr(quantization, "int8_panel_ops", counted)
    out = layer(x)
    assert calls, "the panel route was not asked"
    xq, x_scales = quantize_int8_per_row(x)
    wq, w_scales = quantize_int8_per_channel(linear.weight)
    exact = (xq.double() @ wq.double().T) * x_scales.double() * w_scales.double() + linear.bias.double()
    assert out.dtype == torch.float32 and out.shape == (rows, 40)
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=1e-5)
    # and bit for bit: the same int8 values, exact sums, each rescaling one float32 rounding in the stated order
    assert torch.equal(out, _expected(xq, wq, x_scales.view(-1), w_scales, linear.bias.detach()))
    # bfloat16 activations: the same product, rounded to bfloat16 once
    out16 = layer(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    exact16 = layer._forward_panels(real(), x.bfloat16().float())
    torch.testing.assert_close(out16.float(), exact16.bfloat16().float(), rtol=0, atol=0)


def test_int8_linear_on_panels_takes_3d_empty_and_non_contiguous_inputs(monkeypatch):
    monkeypatch.setattr(quantization, "has_int8_dot_products", lambda: False)
    layer = Int8Linear(_linear(72, 40, seed=2), panels=True)
    x = torch.randn(2, 5, 72, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (2, 5, 40)
    assert torch.equal(out.view(10, 40), layer(x.view(10, 72)))
    assert torch.equal(layer(x.view(10, 72)[::2]), layer(x.view(10, 72)[::2].contiguous()))
    assert layer(torch.empty(0, 72)).shape == (0, 40)


def test_the_kernel_refuses_in_features_where_int32_sums_could_overflow():
    k = 1 << 17  # 2^17 products of -128 x -128 reach 2^31
    x = torch.full((1, k), -128, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="in_features 131072 from 131072 up"):
        _ops().int8_panel_linear(torch.empty(1, 1), x, torch.ones(1), pack_int8_panels(x), torch.ones(1), None)
    x = x[:, 1:].contiguous()  # one fewer: the extreme sum 2^31 - 2^14 is exact
    out = torch.empty(1, 1)
    _ops().int8_panel_linear(out, x, torch.ones(1), pack_int8_panels(x), torch.ones(1), None)
    assert out.item() == float((1 << 31) - (1 << 14))


@pytest.mark.parametrize("in_features", [8, 16, 17, 9, 40])
def test_row_quantization_equals_torchs_on_infinite_subnormal_and_zero_rows(in_features):
    """The compiled pass (AVX2 or AVX-512 where built) against ``quantize_int8_per_row``, bit for bit, on rows an inf
    makes NaN-scaled (inf / inf lanes 0, in the vector part and in the tail), rows of subnormals (the scale from
    torch's clamp to the smallest normal) and zero rows."""
    x = torch.randn(6, in_features, generator=torch.Generator().manual_seed(in_features))
    x[0, 3] = float("inf")
    x[1, in_features - 1] = -float("inf")
    x[2] = 1e-40
    x[3, : in_features // 2] = 1e-45
    x[3, in_features // 2 :] = 0.0
    x[4] = 0.0
    q = torch.empty(x.shape, dtype=torch.int8)
    scales = torch.empty(x.shape[0])
    _ops().quantize_rows_int8(q, scales, x)
    q_ref, scales_ref = quantize_int8_per_row(x)
    assert torch.equal(q, q_ref)
    assert torch.equal(scales, scales_ref.view(-1))


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_non_finite_activation_makes_only_that_rows_products_nan(value, monkeypatch):
    """As through torch's ops: an inf makes the row's scale inf, its int8 values 0, its products 0 x inf; a NaN gives
    the row a NaN scale."""
    monkeypatch.setattr(quantization, "has_int8_dot_products", lambda: False)
    layer = Int8Linear(_linear(64, 24, seed=3), panels=True)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(5))
    x[2, 9] = value
    out = layer(x)
    assert bool(out[2].isnan().all())
    assert bool(out[[0, 1, 3, 4, 5, 6]].isfinite().all())


@pytest.mark.parametrize("dot_products", [False, True])
def test_quantize_linear_weights_lays_out_panels_only_on_cpus_without_int8_dot_products(dot_products, monkeypatch):
    monkeypatch.setattr(quantization, "has_int8_dot_products", lambda: dot_products)
    model = nn.Sequential(Linear(64, 48, bias=False), Linear(48, 20, bias=True))
    assert quantize_linear_weights(model) == 2
    for module in model:
        assert isinstance(module, Int8Linear)
        assert (module.weight_panels is None) == dot_products
