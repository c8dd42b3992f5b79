"""Weight-only int8 (``--quantization int8``): the quantizer on a hand-checked matrix, the layer against its
dequantized weight, and the engine against the float32 engine on a checkpoint whose weights a reference
quantizer written here (float64) replaced by their dequantized values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from core_svc.config import CoreConfig
from core_svc.cpu_dtype import cpu_compute_dtype, cpu_flags
from core_svc.models.quantization import INT8PACK_MAX_ROWS, Int8Linear, quantize_int8_per_channel
from tests.helpers import make_engine, run_engine

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


def test_int8_linear_matches_its_dequantized_weight():
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator) * 0.1)
        linear.bias.copy_(torch.randn(40, generator=generator))
    layer = Int8Linear(linear)
    w = reference_dequantized(linear.weight)
    torch.testing.assert_close(layer.dequantized_weight(), w, rtol=1e-6, atol=1e-7)
    # more rows than INT8PACK_MAX_ROWS: float32 activations with the dequantized weight
    x = torch.randn(INT8PACK_MAX_ROWS + 3, 96, generator=generator)
    expected = x.double() @ w.double().T + linear.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=1e-5)
    # one row: bfloat16 activations into torch._weight_int8pack_mm, its bfloat16 output rounded (2^-8 relative)
    x1 = x[:1]
    expected1 = x1.bfloat16().double() @ w.double().T + linear.bias.double()
    out1 = layer(x1)
    assert out1.dtype == torch.float32
    torch.testing.assert_close(out1.double(), expected1, rtol=2**-7, atol=2e-2)


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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, kept float beside int8 weights
def test_int8_engine_matches_float_engine_on_dequantized_weights(checkpoint, tmp_path, arch):
    path = checkpoint(arch)
    reference_path = dequantized_checkpoint(path, tmp_path / "dequantized")
    # 6 requests: every step has more rows than INT8PACK_MAX_ROWS, so the int8 layers multiply float32
    # activations by the dequantized weight, the reference's arithmetic up to summation order
    batch = prompts(2048, 6)
    ours, _ = run_engine(make_engine(path, quantization="int8"), batch, 16)
    ref, _ = run_engine(make_engine(reference_path), batch, 16)
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            for token, value in lp_b.items():
                if token in lp_a:
                    assert lp_a[token] == pytest.approx(value, abs=1e-4)


def test_int8_engine_logprobs_close_to_float32(checkpoint):
    path = checkpoint("llama")
    batch = prompts(2048, 2)  # 2 requests: decode steps go through torch._weight_int8pack_mm
    ours, _ = run_engine(make_engine(path, quantization="int8"), batch, 4)
    ref, _ = run_engine(make_engine(path), batch, 4)
    drifts = []
    for a, b in zip(ours, ref, strict=True):
        # the first token comes from the prefill (dequantized path); the next from int8pack with bf16 activations
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            sampled = next(iter(lp_b))
            if sampled in lp_a:
                drifts.append(abs(lp_a[sampled] - lp_b[sampled]))
    # the same tokens' logprobs in both: greedy agrees on these 2 x 4 steps
    assert len(drifts) == 8
    # measured 0.079 on this checkpoint (int8 round trip, bfloat16 activations in decode); a bug moves them by > 1
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


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n"
    )
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()
