"""bfloat16 products on AMX over the dense weight (kernels/attention/csrc/amx_linear_cpu.cpp) and the routes that
use it (``Linear``, the tied LM head, the engine), against the exact product rounded once and against oneDNN's
packed path. Skipped where the build or the CPU has no AMX-BF16."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core_svc.models import layers
from core_svc.models.layers import (
    AMX_MAX_ROWS,
    GEMV_MAX_ROWS,
    Linear,
    RotaryEmbedding,
    prepack_linear_weights,
    tied_lm_head,
)
from tests.helpers import assert_rounded_once, cpu_kernels_loaded, linear_operands, make_engine, run_engine

pytestmark = pytest.mark.skipif(
    not cpu_kernels_loaded() or layers.compiled_amx_linear() is None,
    reason="no AMX-BF16 kernel here (the build or the CPU lacks AMX-BF16, or the OS refused the tile registers)",
)


def _operands(rows: int, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return linear_operands(rows, out_features, in_features, torch.bfloat16, seed)


# (rows, out_features, in_features)
SHAPES = [
    (1, 16, 32),  # one tile of each
    (5, 48, 96),  # a last block of 16 features after a block of 32
    (33, 96, 64),  # a row past a pass of 32 rows
    (64, 1024, 512),  # small's qkv projection at a decode batch
    (70, 512, 1408),  # small's down projection
    (300, 80, 96),  # rows past a chunk of 256 (the kernel's kRowChunk)
    (40, 2096, 64),  # more blocks than a parallel share, prefetching to the end, a last block of 16
    (250, 80, 1024),  # a parallel share of one block (and the re-layout of x split in shares too)
]


@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_the_exact_product_rounded_once_on_any_thread_count(
    threads, rows, out_features, in_features, with_bias
):
    """Within half a bfloat16 ulp (plus float32's summation error) of the exact product, on one thread and on two;
    the same bits on both (a product of more than one share of about 4M multiply-adds is split over the threads: the
    fourth, the fifth and the last two shapes)."""
    ops = layers.compiled_amx_linear()
    x, w, bias = _operands(rows, out_features, in_features)
    exact = x.double() @ w.double().T + (bias.double() if with_bias else 0.0)
    outs = []
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        out = torch.full((rows, out_features), float("nan"), dtype=torch.bfloat16)
        ops.amx_linear(out, x, w, bias if with_bias else None)
        assert_rounded_once(out, exact, torch.bfloat16, terms=in_features)
        outs.append(out)
    # each output's sums run in the same order whichever thread computes it
    assert torch.equal(outs[0], outs[1])


def test_the_kernel_flushes_subnormal_inputs_as_oneDNN_does():
    """AMX's tdpbf16ps treats bfloat16 inputs below float32's normal range as zero: a product of them is 0 here,
    as in oneDNN's AMX path; normal values beside them still count."""
    ops = layers.compiled_amx_linear()
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[0, 0] = 2.0**-130  # subnormal in bfloat16 (its normal range ends at 2^-126, as float32's)
    x[1, 0], x[1, 1] = 2.0**-130, 1.5
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    w[:, 0], w[:, 1] = 2.0**100, 2.0
    out = torch.empty(2, 16, dtype=torch.bfloat16)
    ops.amx_linear(out, x, w, None)
    assert torch.equal(out[0], torch.zeros(16, dtype=torch.bfloat16))
    assert torch.equal(out[1], torch.full((16,), 3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"in_features": 72}, "in_features must be a positive multiple of 32, got 72"),
        ({"out_features": 40}, "out_features must be a positive multiple of 16, got 40"),
        ({"w_dtype": torch.float32}, "w: contiguous bfloat16 [out_features, in_features], got Float [32, 64]"),
        ({"x_transposed": True}, "x: contiguous bfloat16 [rows, in_features=64] with at least one row, got BFloat16"),
        ({"x_in_features": 96}, "in_features=64] with at least one row, got BFloat16 [4, 96]"),
        ({"out_rows": 3}, "out: contiguous bfloat16 [rows, out_features] = [4, 32], got BFloat16 [3, 32]"),
        ({"bias_dtype": torch.bfloat16}, "bias: float32, one per output feature"),
    ],
)
def test_the_kernel_names_what_it_refuses(change, message):
    ops = layers.compiled_amx_linear()
    in_features, out_features = change.get("in_features", 64), change.get("out_features", 32)
    x, w, bias = _operands(4, out_features, in_features)
    w = w.to(change.get("w_dtype", torch.bfloat16))
    if change.get("x_transposed"):
        x = torch.randn(in_features, 4).bfloat16().t()
    if "x_in_features" in change:
        x = torch.randn(4, change["x_in_features"]).bfloat16()
    out = torch.empty(change.get("out_rows", 4), out_features, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.amx_linear(out, x, w, bias.to(change.get("bias_dtype", torch.float32)))


def test_linear_keeps_the_weight_dense_and_routes_each_row_count():
    """A bfloat16 ``Linear`` that fits keeps its weight as loaded (no packed weight, no copy); up to GEMV_MAX_ROWS
    rows it is the matrix-vector kernel's product, up to AMX_MAX_ROWS the AMX kernel's, above F.linear's. One that
    does not fit the kernel's shapes is packed for oneDNN as before."""
    gen = torch.Generator().manual_seed(0)
    model = nn.Module()
    model.layer = Linear(96, 160, bias=True, dtype=torch.bfloat16)
    model.odd = Linear(72, 160, bias=False, dtype=torch.bfloat16)  # in_features not a multiple of 32
    model.lm_head = Linear(96, 48, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        for module in (model.layer, model.odd, model.lm_head):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
        model.layer.bias.copy_(torch.randn(160, generator=gen))
    weight, bias = model.layer.weight.detach().clone(), model.layer.bias.detach().clone()
    assert prepack_linear_weights(model)
    layer, head, odd = model.layer, model.lm_head, model.odd
    assert layer.amx and head.amx and not odd.amx
    assert layer.packed_weight is None and torch.equal(layer.weight, weight)
    assert layer.dense_weight is not None and layer.dense_weight.data_ptr() == layer.weight.data_ptr()  # no copy
    assert odd.weight is None and odd.packed_weight is not None
    gemv_ops, amx_ops = layers.compiled_gemv(torch.bfloat16), layers.compiled_amx_linear()
    with torch.inference_mode():
        for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
            x = torch.randn(rows, 96, generator=gen).bfloat16()
            out = layer(x)
            if rows <= GEMV_MAX_ROWS:
                expected = layers.gemv(gemv_ops, x, weight, bias)
            elif rows <= AMX_MAX_ROWS:
                expected = torch.empty(rows, 160, dtype=torch.bfloat16)
                amx_ops.amx_linear(expected, x, weight, bias.float())
            else:
                expected = F.linear(x, weight, bias)
            assert torch.equal(out, expected), rows
            assert_rounded_once(out, x.double() @ weight.double().T + bias.double(), torch.bfloat16, terms=96)
        x3 = torch.randn(2, 7, 96, generator=gen).bfloat16()  # rows in more than one dimension
        assert torch.equal(layer(x3), layer(x3.reshape(14, 96)).view(2, 7, 160))


@pytest.mark.parametrize("rows", [3, 5, 64, AMX_MAX_ROWS + 1])
def test_tied_lm_head_in_bfloat16_takes_the_kernel_for_its_rows(rows):
    gen = torch.Generator().manual_seed(0)
    embedding = torch.randn(1008, 96, generator=gen).bfloat16()
    hidden = torch.randn(rows, 96, generator=gen).bfloat16()
    logits = tied_lm_head(hidden, embedding)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 1008)
    if rows <= GEMV_MAX_ROWS:
        expected = layers.gemv(layers.compiled_gemv(torch.bfloat16), hidden, embedding, None)
    elif rows <= AMX_MAX_ROWS:
        expected = torch.empty(rows, 1008, dtype=torch.bfloat16)
        layers.compiled_amx_linear().amx_linear(expected, hidden, embedding, None)
    else:
        expected = F.linear(hidden, embedding)
    assert torch.equal(logits, expected.float())
    assert_rounded_once(logits.bfloat16(), hidden.double() @ embedding.double().T, torch.bfloat16)


def test_the_engine_logs_the_layout_and_why_dense_decode_weights_adds_nothing(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="core_svc.model_loader"):
        engine = make_engine(checkpoint("llama"), dtype="bfloat16", dense_decode_weights=True)
    linears = [m for m in engine.model_runner.model.modules() if isinstance(m, Linear)]
    assert any(m.amx for m in linears)
    assert all(m.dense_weight is None or m.dense_weight.data_ptr() == m.weight.data_ptr() for m in linears if m.amx)
    messages = [r.getMessage() for r in caplog.records]
    amx = sum(m.amx for m in linears)
    assert any(f"{amx} dense for the AMX kernel" in m for m in messages), messages
    if all(m.amx for m in linears):
        assert any("--dense-decode-weights has no effect here: the bfloat16 weights stay dense" in m for m in messages)


def test_the_dense_weight_beside_an_amx_weight_is_not_counted_twice(checkpoint):
    """``weights_bytes`` (what sleep level 2 reports freed) counts the memory an AMX ``Linear``'s ``dense_weight``
    shares with its weight once: the model's parameters and buffers, nothing more."""
    engine = make_engine(checkpoint("llama"), dtype="bfloat16")
    model = engine.model_runner.model
    assert all(m.amx and m.dense_weight is not None for m in model.modules() if isinstance(m, Linear))
    held = [*model.parameters(), *model.buffers()]
    held += [m.inv_freq for m in model.modules() if isinstance(m, RotaryEmbedding)]  # a plain tensor attribute
    assert engine.model_runner.weights_bytes() == sum(t.numel() * t.element_size() for t in held)


def test_a_bfloat16_batch_on_amx_stays_as_close_to_float32_as_the_packed_path(checkpoint, monkeypatch):
    """Eight requests at once (decode steps of eight rows: the AMX kernel's; the prefill over the AMX kernel or
    F.linear by its rows): at every step where float32 (which matches transformers, tests/test_model_vs_transformers.py)
    and both bfloat16 engines have produced the same tokens so far, the AMX engine's top-5 logprobs drift from
    float32's no more than oneDNN's packed path's do; the two differ only in the order of float32 sums before each
    rounding to bfloat16."""
    path = checkpoint("llama")
    amx_engine = make_engine(path, dtype="bfloat16")
    assert any(m.amx for m in amx_engine.model_runner.model.modules() if isinstance(m, Linear))
    float32_engine = make_engine(path)
    with monkeypatch.context() as patch:
        patch.setattr(layers, "compiled_amx_linear", lambda: None)
        packed_engine = make_engine(path, dtype="bfloat16")
    assert not any(m.amx for m in packed_engine.model_runner.model.modules() if isinstance(m, Linear))
    vocab_size = amx_engine.model_runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in (5, 9, 17, 33, 40, 12, 24, 7)]
    engines = {"float32": float32_engine, "amx": amx_engine, "packed": packed_engine}
    results = {name: run_engine(engine, prompts, 12, logprobs=5)[0] for name, engine in engines.items()}
    drifts: dict[str, list[float]] = {"amx": [], "packed": []}
    for i in range(len(prompts)):
        reference = results["float32"][i]
        for step in range(12):
            if any(r[i].token_ids[:step] != reference.token_ids[:step] for r in results.values()):
                break
            for name in drifts:
                ours = results[name][i].logprobs[step]
                drifts[name] += [abs(ours[t] - v) for t, v in reference.logprobs[step].items() if t in ours]
    assert len(drifts["amx"]) >= 50, "too few steps agreed to compare"
    # a wrong weight block, row or rounding moves logprobs by nats; reordered float32 sums by the same as oneDNN's
    assert max(drifts["amx"]) <= 1.25 * max(drifts["packed"]) + 0.02, (max(drifts["amx"]), max(drifts["packed"]))


def test_prepack_for_amx_names_a_weight_the_kernel_does_not_take():
    layer = Linear(72, 160, bias=False, dtype=torch.bfloat16)  # in_features not a multiple of 32
    with pytest.raises(ValueError, match=re.escape("in_features of 32, got (160, 72) torch.bfloat16 on cpu")):
        layer.prepack(amx=True)
    assert layer.weight is not None and not layer.amx  # left as it was
