"""Model building blocks against plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from core_svc.models.layers import (
    DENSE_DECODE_MAX_ROWS,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    prepack_linear_weights,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_matches_f_linear(dtype, bias):
    gen = torch.Generator().manual_seed(0)
    layer = Linear(96, 160, bias=bias, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(160, generator=gen))
    weight, layer_bias = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone()
    model = nn.Sequential(layer)
    if not prepack_linear_weights(model):
        pytest.skip("torch has no oneDNN here")
    assert layer.weight is None and layer.packed_weight is not None
    tolerance = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.5, "rtol": 2e-2}
    for shape in [(1, 96), (37, 96), (4, 5, 96)]:
        x = torch.randn(*shape, generator=gen).to(dtype)
        expected = F.linear(x.float(), weight.float(), None if layer_bias is None else layer_bias.float())
        torch.testing.assert_close(layer(x).float(), expected, **tolerance)


def test_dense_decode_weights_serve_few_rows_as_f_linear_and_skip_the_lm_head():
    gen = torch.Generator().manual_seed(0)
    layer, head = Linear(96, 160, bias=True, dtype=torch.float32), Linear(96, 50, bias=False, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        layer.bias.copy_(torch.randn(160, generator=gen))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = nn.Module()
    model.layer, model.lm_head = layer, head
    if not prepack_linear_weights(model, keep_dense=True):
        pytest.skip("torch has no oneDNN here")
    assert layer.weight is None and layer.packed_weight is not None and layer.dense_weight is not None
    assert head.dense_weight is None and head.packed_weight is not None
    for rows in (1, DENSE_DECODE_MAX_ROWS):  # the dense path: F.linear's own values
        x = torch.randn(rows, 96, generator=gen)
        assert torch.equal(layer(x), F.linear(x, weight, bias))
    x = torch.randn(DENSE_DECODE_MAX_ROWS + 1, 96, generator=gen)  # the packed path
    expected = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")
    assert torch.equal(layer(x), expected)


def test_prepack_skips_other_dtypes():
    model = nn.Sequential(Linear(8, 8, dtype=torch.float16))
    assert not prepack_linear_weights(model)
    assert model[0].weight is not None


def test_rotary_equals_transformers_rotate_half_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    head_size, positions = 16, torch.tensor([0, 3, 7, 100])
    rotary = RotaryEmbedding(
        1.0 / 10000 ** (torch.arange(0, head_size, 2).float() / head_size), 1.0, 128, torch.float32
    )
    x = torch.randn(4, 3, head_size, generator=gen)
    cos, sin = rotary.cos[positions].unsqueeze(1), rotary.sin[positions].unsqueeze(1)
    rotate_half = torch.cat((-x[..., head_size // 2 :], x[..., : head_size // 2]), dim=-1)
    assert torch.equal(apply_rotary(x, *rotary.tables(positions)), x * cos + rotate_half * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_rms_norm_equals_transformers_bit_for_bit(dtype, num_tokens):
    """float32 goes through torch's rms_norm, other dtypes through the op-by-op path: both equal transformers'
    LlamaRMSNorm exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(num_tokens)
    hidden_size, eps = 512, 1e-6
    weight = torch.randn(hidden_size, generator=gen).to(dtype)
    x = (3 * torch.randn(num_tokens, hidden_size, generator=gen)).to(dtype)
    ours = RMSNorm(hidden_size, eps, dtype)
    reference = LlamaRMSNorm(hidden_size, eps).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        reference.weight.copy_(weight)
        assert torch.equal(ours(x), reference(x))
