"""float32 products over the weight in panels (kernels/attention/csrc/panel_linear_cpu.cpp) and the routes that use
it (``Linear``, ``prepack_linear_weights``, the load log), against the exact product and against itself row by
row. Skipped where the build has neither AVX-512F nor AVX2."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from core_svc.models import layers
from core_svc.models.layers import GEMV_MAX_ROWS, PANEL_WIDTH, Linear, pack_panels, prepack_linear_weights
from tests.helpers import assert_rounded_once, cpu_kernels_loaded, linear_operands, make_engine

pytestmark = pytest.mark.skipif(
    not cpu_kernels_loaded() or layers.compiled_panel_linear() is None,
    reason="no panel kernel here (it needs a build with AVX-512F or AVX2)",
)


def _operands(rows: int, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return linear_operands(rows, out_features, in_features, torch.float32, seed)


def test_pack_panels_lays_out_32_features_per_panel_and_pads_the_last_with_zeros():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)  # 70 features: panels of 32, 32 and 6
    panels = pack_panels(w)
    assert panels.shape == (3, 3, PANEL_WIDTH) and panels.is_contiguous()
    for p, k, j in [(0, 0, 0), (0, 2, 31), (1, 1, 5), (2, 0, 5), (2, 2, 3)]:
        assert panels[p, k, j] == w[PANEL_WIDTH * p + j, k]
    assert (panels[2, :, 6:] == 0).all()


# (rows, out_features, in_features)
SHAPES = [
    (1, 1024, 512),  # one request: four panels side by side (AVX2: three, and two left one at a time)
    (2, 100, 37),  # two requests (AVX2: one panel at a time), a last partial panel, in_features odd
    (3, 100, 37),  # two panels side by side (AVX2: a block of three rows), a last partial panel
    (6, 70, 300),  # one whole block: k in slices of 128 and a last one of 44, a last panel with 6 features
    (4, 16, 5),  # a single partial panel, half of it empty
    (5, 33, 64),  # the register-blocked walk at its fewest rows on AVX-512 (AVX2: from three), a one-feature panel
    (64, 1024, 512),  # small's qkv projection at a decode batch: blocks of 6 rows (nine) and 5 (two)
    (70, 512, 1408),  # small's down projection: k in eleven slices of 128
    (300, 96, 96),  # rows past a chunk of 256
    (200, 80, 4000),  # a chunk cut to 65 rows by a wide in_features
    (40, 4128, 64),  # more panels than a parallel share: split over two threads
]


@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_the_exact_product_on_any_thread_count(threads, rows, out_features, in_features, with_bias):
    """Within float32's summation error of the exact product, on one thread and on two, and the same bits on both
    (the last shape's product is split over the threads)."""
    ops = layers.compiled_panel_linear()
    x, w, bias = _operands(rows, out_features, in_features)
    exact = x.double() @ w.double().T + (bias.double() if with_bias else 0.0)
    outs = []
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        out = torch.full((rows, out_features), float("nan"))
        ops.panel_linear(out, x, pack_panels(w), bias if with_bias else None)
        assert_rounded_once(out, exact, torch.float32, terms=in_features)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(("rows", "in_features"), [(9, 64), (64, 512), (300, 96), (200, 4000)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, in_features):
    """Each output is one sum in order over in_features, whichever path (one to four rows, register blocks, chunks)
    computed it: every row of a batch equals that row alone, bit for bit."""
    ops = layers.compiled_panel_linear()
    x, w, bias = _operands(rows, 72, in_features, seed=rows)
    panels = pack_panels(w)
    batch = torch.empty(rows, 72)
    ops.panel_linear(batch, x, panels, bias)
    for r in (0, 1, rows // 2, rows - 1):
        for lone in (x[r : r + 1], x[max(0, r - 2) : r + 1]):  # the row alone, and among three
            out = torch.empty(lone.shape[0], 72)
            ops.panel_linear(out, lone.contiguous(), panels, bias)
            assert torch.equal(out[-1], batch[r])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("panels_2d", r"panels: contiguous float32 \[num_panels, in_features, 32\], got Float \[64, 96\]"),
        ("panels_bf16", r"panels: contiguous float32 .*got BFloat16"),
        ("x_width", r"x: contiguous float32 \[rows, in_features=96\] with at least one row, got Float \[3, 95\]"),
        ("no_rows", r"with at least one row, got Float \[0, 96\]"),
        ("out_width", r"out_features in \(32, 64\] \(2 panels of 32\), got Float \[3, 65\]"),
        ("bias_size", r"bias: contiguous float32 \[out_features=50\], got Float \[49\]"),
        ("alias", r"out: must not share memory with x or panels"),
        ("bias_alias", r"out: must not share memory with bias"),
    ],
)
def test_the_kernel_names_what_it_refuses(change, message):
    ops = layers.compiled_panel_linear()
    x, w, bias = _operands(3, 50, 96)
    panels, out = pack_panels(w), torch.empty(3, 50)
    if change == "panels_2d":
        panels = torch.zeros(64, 96)
    elif change == "panels_bf16":
        panels = panels.bfloat16()
    elif change == "x_width":
        x = x[:, :95].contiguous()
    elif change == "no_rows":
        x, out = x[:0], out[:0]
    elif change == "out_width":
        out = torch.empty(3, 65)
    elif change == "bias_size":
        bias = bias[:49]
    elif change == "alias":
        buffer = torch.zeros(3 * 96)
        x, out = buffer.view(3, 96), buffer[: 3 * 50].view(3, 50)
    elif change == "bias_alias":  # partial sums would overwrite the bias before it is added
        bias = out[0]
    with pytest.raises(RuntimeError, match=message):
        ops.panel_linear(out, x, panels, bias)


def test_linear_takes_panels_in_place_of_its_weight_at_every_row_count():
    gen = torch.Generator().manual_seed(0)
    layer = Linear(96, 70, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(70, 96, generator=gen))
        layer.bias.copy_(torch.randn(70, generator=gen))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepack(panels=True)
    assert layer.weight is None and layer.packed_weight is None and layer.dense_weight is None
    assert torch.equal(layer.panel_weight, pack_panels(weight))
    ops = layers.compiled_panel_linear()
    for shape in [(1, 96), (4, 96), (5, 96), (64, 96), (300, 96), (2, 3, 96), (0, 96)]:
        x = torch.randn(*shape, generator=gen)
        out = layer(x)
        assert out.shape == (*shape[:-1], 70)
        if x.numel():
            expected = torch.empty(x.numel() // 96, 70)
            ops.panel_linear(expected, x.reshape(-1, 96).contiguous(), layer.panel_weight, bias)
            assert torch.equal(out.reshape(-1, 70), expected)  # the kernel's own values: its route
            assert_rounded_once(out, x.double() @ weight.double().T + bias.double(), torch.float32)


def test_dense_copies_beside_panels_serve_up_to_four_rows():
    gen = torch.Generator().manual_seed(0)
    layer = Linear(96, 70, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(70, 96, generator=gen))
    weight = layer.weight.detach().clone()
    if layers.compiled_gemv(torch.float32) is None:
        pytest.skip("no compiled float32 matrix-vector kernel here")
    layer.prepack(keep_dense=True, panels=True)
    assert torch.equal(layer.dense_weight, weight) and layer.panel_weight is not None
    gemv_ops, panel_ops = layers.compiled_gemv(torch.float32), layers.compiled_panel_linear()
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=gen)
        via_panels = torch.empty(rows, 70)
        panel_ops.panel_linear(via_panels, x, layer.panel_weight, None)
        expected = layers.gemv(gemv_ops, x, weight, None) if rows <= GEMV_MAX_ROWS else via_panels
        assert torch.equal(layer(x), expected)


def test_prepack_for_panels_names_a_weight_the_kernel_does_not_take(monkeypatch):
    with pytest.raises(ValueError, match=r"non-empty float32 CPU weight, got \(8, 16\) torch.bfloat16 on cpu"):
        Linear(16, 8, dtype=torch.bfloat16).prepack(panels=True)
    monkeypatch.setattr(layers, "compiled_panel_linear", lambda: None)
    with pytest.raises(ValueError, match="the loaded CPU kernels have no panel kernel"):
        Linear(16, 8).prepack(panels=True)


def test_prepack_lays_out_every_float32_linear_in_panels_the_lm_head_too():
    gen = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.layer, model.lm_head = Linear(96, 160, bias=True), Linear(96, 50, bias=False)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    weights = {name: m.weight.detach().clone() for name, m in model.named_children()}
    assert prepack_linear_weights(model)
    for name, module in model.named_children():
        assert module.weight is None and torch.equal(module.panel_weight, pack_panels(weights[name]))


def test_the_engine_logs_the_panel_layout(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="core_svc.model_loader"):
        engine = make_engine(checkpoint("llama"))
    linears = [m for m in engine.model_runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.panel_weight is not None for m in linears)
    messages = [r.getMessage() for r in caplog.records]
    expected = f"{len(linears)} in panels of 32 output features (the float32 panel kernel)"
    assert any(expected in m for m in messages), messages
