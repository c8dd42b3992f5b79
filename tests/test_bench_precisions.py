"""The benchmarks' int8 precision: the core fields it stands for, and its target line in the throughput report."""

from __future__ import annotations

from benchmarks.throughput_report import check_targets
from benchmarks.workload import matmul_dtype, splitserve_precision


def _checks(rates: dict[str, float]) -> dict[str, tuple[float, bool]]:
    """check_targets of a CPU report whose rows are ``label -> output tok/s``: name -> (measured, met)."""
    rows = [{"label": label, "output_tok_s": tok_s, "mfu": 0.5, "ratios": {}} for label, tok_s in rates.items()]
    return {c.name: (c.measured, c.met) for c in check_targets({"device": "cpu", "results": rows})}


def test_splitserve_precision_names():
    assert splitserve_precision("int8") == {"dtype": "float32", "quantization": "int8"}
    assert splitserve_precision("bfloat16") == {"dtype": "bfloat16"}
    assert splitserve_precision("float32-dense") == {"dtype": "float32", "dense_decode_weights": True}
    assert splitserve_precision("bfloat16-dense") == {"dtype": "bfloat16", "dense_decode_weights": True}
    assert splitserve_precision("float32-kv-bfloat16") == {"dtype": "float32", "kv_cache_dtype": "bfloat16"}
    int8_kv = {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "float32"}
    assert splitserve_precision("int8-kv-float32") == int8_kv  # int8's own cache is bfloat16 (auto)
    # the peak each one's MFU is over: its compute dtype; int8's integer products stand over float32's
    names = ("float32", "int8", "float32-dense", "float32-kv-bfloat16", "bfloat16", "bfloat16-dense")
    assert [matmul_dtype(n) for n in names] == ["float32"] * 4 + ["bfloat16"] * 2


def test_a_bfloat16_kv_cache_run_is_not_checked_against_the_float32_mfu_target():
    """Its MFU is in the table; the float32 target is float32's, cache included."""
    report = {
        "device": "cpu",
        "results": [
            {"label": "splitserve float32", "output_tok_s": 200.0, "mfu": 0.45, "ratios": {}},
            {"label": "splitserve float32-kv-bfloat16", "output_tok_s": 230.0, "mfu": 0.52, "ratios": {}},
        ],
    }
    checks = check_targets(report)
    assert [(c.name, c.measured, c.met) for c in checks] == [("splitserve float32 MFU", 0.45, False)]


def test_int8_and_bfloat16_targets_over_float32():
    checks = _checks({"splitserve float32": 200.0, "splitserve bfloat16": 500.0, "splitserve int8": 150.0})
    # 500 / 200 = 2.5 and 150 / 200 = 0.75 against issue 18's 1.5
    assert checks["splitserve bfloat16 over float32"] == (2.5, True)
    assert checks["splitserve int8 over float32"] == (0.75, False)


def test_reduced_precisions_against_the_peers_of_their_class():
    checks = _checks(
        {
            "splitserve float32": 200.0,
            "splitserve bfloat16": 500.0,
            "splitserve int8": 300.0,
            "ctranslate2 int8": 100.0,
            "llama.cpp f16": 300.0,
            "llama.cpp q8_0": 200.0,
        }
    )
    # issue 18: at least 2x the peers at the same precision class
    assert checks["splitserve bfloat16 vs llama.cpp f16"] == (500.0 / 300.0, False)
    assert checks["splitserve int8 vs ctranslate2 int8"] == (3.0, True)
    assert checks["splitserve int8 vs llama.cpp q8_0"] == (1.5, False)
    assert "splitserve bfloat16 vs ctranslate2 int8" not in checks


def test_int8_over_a_float32_kv_cache_is_in_the_table_but_not_the_targets():
    """``int8-kv-float32`` (--quantization int8 --kv-cache-dtype float32) is not int8 as served (its cache is
    bfloat16), so only plain int8 has target lines."""
    checks = _checks(
        {
            "splitserve float32": 400.0,
            "splitserve int8": 800.0,
            "splitserve int8-kv-float32": 560.0,
            "ctranslate2 int8": 250.0,
            "llama.cpp q8_0": 100.0,
        }
    )
    assert checks["splitserve int8 over float32"] == (2.0, True)
    assert checks["splitserve int8 vs ctranslate2 int8"] == (3.2, True)
    assert checks["splitserve int8 vs llama.cpp q8_0"] == (8.0, True)
    assert not [name for name in checks if "kv-float32" in name]


def test_a_16_bit_precision_the_cpu_cannot_compute_is_measured_against_float32s_peak(monkeypatch):
    """On an AVX2-only CPU the core runs bfloat16 in float32 (core_svc.cpu_dtype), so its MFU is over float32's
    peak, and no emulated bfloat16 product is timed."""
    import core_svc.cpu_dtype
    from benchmarks.throughput import _peak_dtype

    monkeypatch.setattr(core_svc.cpu_dtype, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    assert [_peak_dtype(p, "cpu") for p in ("bfloat16", "bfloat16-dense", "int8", "float32")] == ["float32"] * 4
    monkeypatch.setattr(core_svc.cpu_dtype, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert _peak_dtype("bfloat16", "cpu") == "bfloat16" and _peak_dtype("float16", "cpu") == "float32"
    assert _peak_dtype("bfloat16", "cuda") == "bfloat16"
