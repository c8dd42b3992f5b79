"""The benchmark machinery: FLOP counting by hand, the seeded request set, and both commands end to end on a tiny
model (checking what they report, never how fast anything ran)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from benchmarks.workload import PROMPT_LEN_RANGE, ModelFlops, make_request_set
from splitserve.entrypoints.cli import main
from splitserve.entrypoints.test_model import PRESET_TABLE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_model_flops_by_hand(checkpoint):
    path = checkpoint("llama", "tiny")
    flops = ModelFlops.from_checkpoint(path)
    p = PRESET_TABLE["tiny"]  # hidden 64, intermediate 192, 4 layers, 4 heads, 2 KV heads: head size 16
    vocab = len(AutoTokenizer.from_pretrained(path))
    q, kv = 4 * 16, 2 * 16
    per_layer = 64 * q + 2 * 64 * kv + q * 64 + 3 * 64 * 192
    assert (p.hidden_size, p.intermediate_size, p.num_hidden_layers) == (64, 192, 4)
    assert flops.non_embedding_matmul_params == 4 * per_layer
    assert flops.lm_head_params == 64 * vocab
    # prompt 3, output 2: tokens at positions 0..3 go through the decoder (the last sampled token does not),
    # attending over 1, 2, 3, 4 keys; two tokens are sampled from LM head logits.
    attention = sum(4 * 4 * q * keys for keys in (1, 2, 3, 4))
    expected = 4 * 2 * (4 * per_layer) + attention + 2 * 2 * 64 * vocab
    assert flops.request_flops(3, 2) == expected


def test_request_set_is_seeded_and_avoids_special_tokens(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama", "tiny"))
    a = make_request_set(200, 8, tokenizer, seed=3)
    b = make_request_set(200, 8, tokenizer, seed=3)
    c = make_request_set(200, 8, tokenizer, seed=4)
    assert a.prompts == b.prompts and a.prompts != c.prompts
    lens = np.asarray(a.prompt_lens)
    assert lens.min() >= PROMPT_LEN_RANGE[0] and lens.max() <= PROMPT_LEN_RANGE[1]
    assert np.median(lens) < lens.mean()  # long-tailed: the mean sits above the median
    ids = {t for p in a.prompts for t in p}
    assert not ids & set(tokenizer.all_special_ids) and max(ids) < len(tokenizer)
    assert a.summary()["output_tokens"] == 200 * 8 and a.summary()["input_tokens"] == lens.sum()


@pytest.mark.slow
def test_bench_throughput_reports_every_backend(checkpoint, tmp_path, capsys):
    model = checkpoint("llama", "tiny")
    code = main(
        [
            "bench", "throughput", "--model", str(model), "--num-prompts", "4", "--output-len", "6",
            "--backends", "splitserve,hf-generate", "--dtypes", "float32", "--preemption-kv-fraction", "0.3",
            "--observability-repeats", "1", "--out", str(tmp_path), "--name", "t",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").read_bytes().startswith(PNG_MAGIC)
    by_label = {r["label"]: r for r in report["results"]}
    assert set(by_label) == {"splitserve float32", "transformers generate (batch 16)", "splitserve float32, KV 30%"}
    input_tokens = report["request_set"]["input_tokens"]
    for r in report["results"]:
        assert (r["requests"], r["output_tokens"], r["input_tokens"]) == (4, 24, input_tokens)
        assert r["output_tok_s"] == pytest.approx(24 / r["wall_s"])
        assert 0 < r["mfu"] < 1
    # transformers decodes the same tokens greedily; so does splitserve under a small KV budget.
    assert by_label["transformers generate (batch 16)"]["exact_match"] == 1.0
    assert by_label["splitserve float32, KV 30%"]["exact_match"] == 1.0
    small = by_label["splitserve float32, KV 30%"]["extra"]
    assert small["kv_cache_tokens"] == (small["num_kv_blocks"] - 1) * small["block_size"]
    assert small["kv_cache_bytes"] == small["num_kv_blocks"] * small["block_size"] * small["kv_bytes_per_token"]
    ratio = by_label["splitserve float32"]["ratios"]["transformers generate (batch 16)"]
    assert ratio == pytest.approx(
        by_label["splitserve float32"]["output_tok_s"] / by_label["transformers generate (batch 16)"]["output_tok_s"]
    )
    cost = report["observability_cost"]
    assert len(cost["off_tok_s"]) == len(cost["on_tok_s"]) == 1
    assert cost["on_over_off"] == pytest.approx(cost["on_tok_s"][0] / cost["off_tok_s"][0])
    assert len(cost["hook_fraction"]) == 1 and 0 < cost["hook_fraction"][0] < 1
    out = capsys.readouterr().out
    assert "target splitserve float32 MFU" in out and "observability (core metrics + a span per request)" in out


@pytest.mark.slow
def test_bench_serve_runs_both_deployments(checkpoint, tmp_path, capsys):
    model = checkpoint("llama", "tiny")
    code = main(
        [
            "bench", "serve", "--model", str(model), "--num-prompts", "4", "--output-len", "5", "--rates", "50,inf",
            "--repeats", "2", "--out", str(tmp_path), "--name", "s", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "s.json").read_text())
    assert (tmp_path / "s.png").read_bytes().startswith(PNG_MAGIC)
    assert set(report["deployments"]) == {"split", "inproc"}
    for results in report["deployments"].values():
        assert [r["rate"] for r in results] == [50.0, "inf"]
        for r in results:  # two runs of 4 requests x 5 tokens each
            assert (r["runs"], r["completed"], r["errors"], r["output_tokens"]) == (2, 8, [], 40)
            assert len(r["samples_ms"]["ttft"]) == 8 and len(r["output_tok_s_runs"]) == 2
            assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"] and r["ttft_p50_ms"] <= r["e2e_p50_ms"]
    assert [c["rate"] for c in report["comparison"]] == [50.0, "inf"]
    out = capsys.readouterr().out
    assert "split vs in-process at inf" in out and "target split/in-process throughput" in out


@pytest.mark.slow
def test_bench_n_reports_both_deployments_per_n(checkpoint, tmp_path, capsys):
    model = checkpoint("llama", "tiny")
    code = main(
        [
            "bench", "n", "--model", str(model), "--ns", "8,32", "--deadline-s", "2", "--max-tokens", "1500",
            "--repeats", "2", "--out", str(tmp_path), "--name", "n", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "n.json").read_text())
    assert (tmp_path / "n.png").read_bytes().startswith(PNG_MAGIC)
    assert [(r["deployment"], r["n"]) for r in report["results"]] == [
        ("split", 8),
        ("split", 32),
        ("in-process", 8),
        ("in-process", 32),
    ]
    assert [(r["deployment"], r["n"]) for r in report["runs"]] == [
        (deployment, n) for deployment in ("split", "in-process") for n in (8, 32) for _ in range(2)
    ]
    for row in report["results"]:
        runs = [r for r in report["runs"] if (r["deployment"], r["n"]) == (row["deployment"], row["n"])]
        for r in runs:  # the whole request was in the core, streamed before the deadline, and was aborted after it
            assert r["error"] is None and not r["finished_before_deadline"]
            assert r["peak_core_requests"] == r["n"] and 0 < r["add_s"] < 2
            assert 0 < r["first_output_s"] < 2 and r["abort_s"] >= 0
            assert r["liveness_num_samples"] > 0 and r["liveness_max_s"] >= r["liveness_p99_s"] >= 0
        assert row["runs"] == 2 and row["error"] is None
        for key in ("add_s", "first_output_s", "abort_s"):
            assert row[key] == pytest.approx(float(np.median([r[key] for r in runs])))
        assert row["liveness_max_s"] == max(r["liveness_max_s"] for r in runs)
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines() if line.startswith(("split ", "in-process "))]
    assert "live max s" in out and rows == [["split", "8"], ["split", "32"], ["in-process", "8"], ["in-process", "32"]]
