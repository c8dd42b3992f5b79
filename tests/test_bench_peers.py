"""The CPU peers of the benchmarks (``benchmarks.peers``: the GGUF conversion read back with the gguf package,
llama.cpp against transformers when llama-cpp-python is installed, the reason a missing peer is skipped), the
latency benchmark's arithmetic, the contention benchmark's fair share, and the peer targets."""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import numpy as np
import pytest

from benchmarks import latency, peers
from benchmarks.contention import expected_share, format_lines
from benchmarks.throughput_report import check_targets
from tests.conftest import shared_tokenizer


def test_expected_share_by_hand():
    assert expected_share(num_threads=2, num_cores=2, num_competitors=1) == pytest.approx(2 / 3)  # 2 of 3 threads
    assert expected_share(num_threads=1, num_cores=2, num_competitors=1) == 1.0  # a core each
    assert expected_share(num_threads=1, num_cores=1, num_competitors=1) == 0.5
    assert expected_share(num_threads=2, num_cores=2, num_competitors=2) == 0.5
    # 4 threads on 2 cores use 2 cores alone; beside 1 competitor they get 4/5 of 2 cores: 0.8 of what they had.
    assert expected_share(num_threads=4, num_cores=2, num_competitors=1) == pytest.approx(0.8)


def contention_report(policies: dict[str, tuple[float, float]], competitors: int, cores: int) -> dict[str, Any]:
    """A contention report as ``benchmarks.contention.run`` writes it: each policy's alone and contended rates."""
    runs = [
        {"policy": policy, "competitors": n, "output_tok_s": rate, "competitor_cpu_share": 0.5 if n else 0.0}
        for policy, pair in policies.items()
        for n, rate in zip((0, competitors), pair, strict=True)
    ]
    summary = {
        policy: {"kept": contended / alone, "competitor_cpu_share": 0.5}
        for policy, (alone, contended) in policies.items()
    }
    return {
        "competitors": competitors,
        "num_threads": 2,
        "cores": cores,
        "requests": 16,
        "output_len": 128,
        "expected_share": expected_share(2, cores, competitors),
        "runs": runs,
        "summary": summary,
    }


def test_contention_report_rows_per_policy_and_the_target_on_the_default_with_one_competitor():
    rates = {"runtime": (1300.0, 200.0), "passive": (1000.0, 750.0), "short-spin": (1300.0, 650.0)}
    lines = format_lines(contention_report(rates, competitors=1, cores=2))
    rows = {line.split()[0]: line.split()[1:4] for line in lines[2:5]}
    assert rows == {
        "runtime": ["1300.0", "200.0", "0.15"],
        "passive": ["1000.0", "750.0", "0.75"],
        "short-spin": ["1300.0", "650.0", "0.50"],
    }
    assert lines[-1] == "target short-spin (the default) throughput kept under contention: 0.50 (want >= 0.4) MET"
    # three competitors (a fair share of 0.40 itself), or a report of two policies written before short-spin: the
    # rows it has, and no target line, whose setting is one competitor on two cores under the default policy
    assert not any(line.startswith("target") for line in format_lines(contention_report(rates, 3, 2)))
    old = format_lines(contention_report({k: rates[k] for k in ("runtime", "passive")}, competitors=1, cores=2))
    assert [line.split()[0] for line in old[2:]] == ["runtime", "passive"]


def test_timing_from_arrivals():
    ttft, per_token = latency.timing_from_arrivals(10.0, [10.5, 10.6, 10.8])
    assert ttft == pytest.approx(0.5)
    assert per_token == pytest.approx(0.15)  # (10.8 - 10.5) / 2 gaps
    with pytest.raises(ValueError, match="at least two tokens, got 1"):
        latency.timing_from_arrivals(0.0, [1.0])


def test_permute_for_ggml_rope_pairs_each_half_with_the_other():
    # Two heads of size 4, one input column: rows 0..7. Within a head, rotate-half pairs (0, 2) and (1, 3); GGML
    # wants each pair adjacent: 0, 2, 1, 3.
    weight = np.arange(8, dtype=np.float32).reshape(8, 1)
    assert peers.permute_for_ggml_rope(weight, num_heads=2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_a_missing_peer_is_named_with_its_package(monkeypatch):
    # Decided here, not by what this machine has installed: llama_cpp missing, gguf present, then both missing.
    present = importlib.util.find_spec("json")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "llama_cpp" else present)
    assert peers.missing_reason("llama.cpp") == "llama-cpp-python not installed (pip install -e '.[bench]')"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert peers.missing_reason("llama.cpp") == "llama-cpp-python, gguf not installed (pip install -e '.[bench]')"
    with pytest.raises(ValueError, match="unknown peer 'vllm'"):
        peers.missing_reason("vllm")


def test_peer_targets_are_checked_against_float32_peers_only():
    report = {
        "results": [
            {
                "label": "splitserve float32",
                "mfu": 0.45,
                "output_tok_s": 100.0,
                "ratios": {
                    "transformers generate (batch 16)": 3.5,
                    "ctranslate2 float32": 2.5,
                    "ctranslate2 int8": 1.0,
                    "llama.cpp f32": 1.5,
                },
            }
        ]
    }
    lines = [check.line() for check in check_targets(report)]
    assert lines == [
        "target splitserve float32 MFU: 0.45 (want >= 0.50) NOT MET",
        "target splitserve float32 vs transformers generate: 3.50 (want >= 3.00) MET",
        "target splitserve float32 vs ctranslate2 float32: 2.50 (want >= 2.00) MET",
        "target splitserve float32 vs llama.cpp f32: 1.50 (want >= 2.00) NOT MET",
    ]


@pytest.fixture(scope="module")
def llama2_checkpoint(checkpoint):
    return checkpoint("llama", tokenizer=shared_tokenizer("llama2"))


@pytest.mark.parametrize("file_type", ["f32", "f16", "q8_0"])
def test_gguf_conversion_reads_back(llama2_checkpoint, tmp_path, file_type):
    gguf = pytest.importorskip("gguf", reason="the gguf package (bench extra) is not installed")
    from safetensors.numpy import load_file

    model = llama2_checkpoint
    config = json.loads((model / "config.json").read_text())
    path = peers.write_llama_gguf(model, tmp_path / "model.gguf", file_type)
    reader = gguf.GGUFReader(path)

    def value(key: str):
        return reader.get_field(key).contents()

    assert value("general.architecture") == "llama"
    assert value("llama.block_count") == config["num_hidden_layers"]
    assert value("llama.embedding_length") == config["hidden_size"]
    assert value("llama.attention.head_count") == config["num_attention_heads"]
    assert value("llama.attention.head_count_kv") == config["num_key_value_heads"]
    assert value("llama.feed_forward_length") == config["intermediate_size"]
    assert value("general.file_type") == {"f32": 0, "f16": 1, "q8_0": 7}[file_type]  # llama.cpp's LlamaFileType
    tokens = value("tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"]
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert value("tokenizer.ggml.eos_token_id") == 2
    # Per layer: 2 norms, q, k, v, o, gate, up, down; plus the embedding, the final norm and the LM head.
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 9 * config["num_hidden_layers"] + 3
    weights = load_file(next(model.glob("*.safetensors")))
    head = config["hidden_size"] // config["num_attention_heads"]
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    # The rows GGML wants: in each head of size `head`, row j * 2 + k of the pair comes from k * head / 2 + j.
    order = [
        h * head + k * head // 2 + j
        for h in range(config["num_attention_heads"])
        for j in range(head // 2)
        for k in (0, 1)
    ]
    expected_q = q[order]
    stored_q = tensors["blk.0.attn_q.weight"]
    assert stored_q.tensor_type.name == file_type.upper()
    if file_type == "q8_0":
        # Q8_0 blocks: 32 weights share scale d = absmax / 127, each weight round(w / d) in int8, d stored as
        # float16: dequantized within d / 2 (rounding) + 127 d 2^-11 (the scale's float16 rounding)
        blocks = expected_q.reshape(-1, 32).astype(np.float32)
        d = np.abs(blocks).max(axis=1, keepdims=True) / 127
        dequantized = gguf.quants.dequantize(stored_q.data, gguf.GGMLQuantizationType.Q8_0).reshape(-1, 32)
        assert dequantized.shape == blocks.shape
        assert (np.abs(dequantized - blocks) <= d * (0.5 + 127 * 2**-11) + 1e-9).all()
        assert (np.abs(dequantized - blocks) > 0).any()  # quantized, not stored as is
        return
    np.testing.assert_array_equal(np.asarray(stored_q.data), expected_q.astype(stored_q.data.dtype))
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.tensor_type.name == "F32"  # 1-D tensors stay float32 in an f16 file, as llama.cpp's converter
    np.testing.assert_array_equal(np.asarray(norm.data), weights["model.layers.0.input_layernorm.weight"])
    v = tensors["blk.0.attn_v.weight"]
    np.testing.assert_array_equal(
        np.asarray(v.data), weights["model.layers.0.self_attn.v_proj.weight"].astype(v.data.dtype)
    )


def test_llama_cpp_decodes_the_converted_checkpoint_as_transformers(llama2_checkpoint, tmp_path):
    """llama.cpp on the f32 GGUF greedily decodes what transformers decodes on the same checkpoint: the oracle of
    the conversion (a wrong RoPE permutation or tensor name would change the tokens)."""
    if (reason := peers.missing_reason("llama.cpp")) is not None:
        pytest.skip(reason)
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM

    model = llama2_checkpoint
    path = peers.write_llama_gguf(model, tmp_path / "model.gguf", "f32")
    prompt = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(prompt) :].tolist()
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
    engine = peers.PeerEngine("llama.cpp", "f32", llm, 2, [])
    assert [token for token, _ in engine.stream(prompt, 8)] == expected
    # Batched (one sequence per prompt in one context), each prompt decodes as it does alone.
    with torch.inference_mode():
        short = hf.generate(torch.tensor([prompt[:4]]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert engine.generate_batch([prompt, prompt[:4]], 8) == [expected, short[0, 4:].tolist()]


def test_latency_run_interleaves_engines_and_summarizes_each(checkpoint):
    from transformers import AutoTokenizer

    path = checkpoint("llama", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(path)
    settings = latency.Settings(
        prompt_lens=(8, 20), output_len=4, repeats=3, dtypes=("float32",), engines=("splitserve",), num_threads=1
    )
    import torch

    threads = torch.get_num_threads()
    try:
        report = latency.run(path, tokenizer, settings)
    finally:
        torch.set_num_threads(threads)  # latency.run sets this process's threads
    prompts = latency.prompts_for(tokenizer, (8, 20), seed=0)
    assert [len(prompts[8]), len(prompts[20])] == [8, 20]
    assert not set(prompts[20]) & set(tokenizer.all_special_ids)
    assert [(r["engine"], r["prompt_len"]) for r in report["rows"]] == [
        ("splitserve float32", 8),
        ("splitserve float32", 20),
    ]
    for row in report["rows"]:
        assert len(row["ttft_ms"]) == len(row["ms_per_token"]) == 3
        assert row["ms_per_token_p50"] == sorted(row["ms_per_token"])[1]
        assert row["ttft_p90_ms"] == pytest.approx(float(np.percentile(row["ttft_ms"], 90)))
    assert report["skipped"] == {} and report["num_threads"] == 1
    text = latency.format_report(report)
    assert "splitserve float32" in text and "1.00x, 1.00x" in text


def test_llama_cpp_extra_buffers_are_probed_once_in_a_child_and_a_crash_is_named(monkeypatch, tmp_path):
    """The probe's child process: killed by a signal -> the signal's name; a clean exit -> None; one probe per file
    and thread count."""
    import signal
    import subprocess

    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        code = -int(signal.SIGILL) if argv[-2].endswith("q8_0.gguf") else 0
        return subprocess.CompletedProcess(argv, code, "", "")

    monkeypatch.setattr(peers.subprocess, "run", fake_run)
    monkeypatch.setattr(peers, "_EXTRA_BUFFERS_FAILURES", {})
    q8, f32 = tmp_path / "q8_0.gguf", tmp_path / "f32.gguf"
    assert peers.llama_cpp_extra_buffers_failure(q8, 1) == "died with SIGILL"
    assert peers.llama_cpp_extra_buffers_failure(q8, 1) == "died with SIGILL"
    assert peers.llama_cpp_extra_buffers_failure(f32, 1) is None
    assert [argv[-3:] for argv in calls] == [["benchmarks.peers", str(q8), "1"], ["benchmarks.peers", str(f32), "1"]]
