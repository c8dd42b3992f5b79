"""The benchmark machinery: FLOP counting by hand, the seeded request set, the commands end to end on a tiny model
(checking what they report, never how fast anything ran), the qwen2.5-0.5b preset's shape, and the GPU benchmark's
device-independent parts (matmul peak, copy bandwidth, weight-read bound, single-request ITL) run on CPU."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoTokenizer

from benchmarks import single_request, throughput, throughput_report
from benchmarks.device_limits import CopyBandwidth, MatmulPeak, copy_bandwidth, matmul_peak
from benchmarks.image_workload import make_image_request_set, with_fresh_images
from benchmarks.single_request import decode_weight_bytes, weight_read_bound_s
from benchmarks.workload import MATMUL_CPU_FLAGS, PROMPT_LEN_RANGE, Machine, ModelFlops, make_request_set
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
def test_bench_throughput_structured_outputs_reports_both_runs(checkpoint, tmp_path, capsys):
    model = checkpoint("llama", "tiny")
    code = main(
        [
            "bench", "throughput", "--structured-outputs", "--model", str(model), "--num-prompts", "4",
            "--output-len", "6", "--out", str(tmp_path), "--name", "so",
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "so.json").read_text())
    assert set(report["runs"]) == {"none", "half-json"}
    for r in report["runs"]["none"]:
        assert (r["output_tokens"], r["constrained_requests"]) == (24, 0)
        assert r["output_tok_s"] == pytest.approx(24 / r["wall_s"])
    for r in report["runs"]["half-json"]:
        # Requests 0 and 2 under the schema: six tokens cannot hold a whole document, so they end by length.
        assert (r["output_tokens"], r["constrained_requests"], r["constrained_valid_json"]) == (24, 2, 0)
    best = report["best_output_tok_s"]
    assert report["half_json_over_none"] == pytest.approx(best["half-json"] / best["none"])
    assert len(report["load_average_before"]) == 3 and report["machine"]["cpu"]
    assert "best half-json / none output tok/s" in capsys.readouterr().out


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


def test_bench_serve_api_http_measures_both_apis_of_one_frontend(checkpoint, tmp_path, capsys):
    model = checkpoint("llama", "tiny")
    code = main(
        [
            "bench", "serve", "--api", "http", "--model", str(model), "--num-prompts", "4", "--output-len", "5",
            "--rates", "inf", "--repeats", "1", "--out", str(tmp_path), "--name", "h",
            "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "h.json").read_text())
    assert report["api"] == "http" and set(report["deployments"]) == {"grpc", "http"}
    for results in report["deployments"].values():
        (r,) = results  # one run of 4 requests x 5 tokens, each token counted from the stream
        assert (r["runs"], r["completed"], r["errors"], r["output_tokens"]) == (1, 4, [], 20)
        assert 0 < r["ttft_p50_ms"] <= r["e2e_p50_ms"]
    (row,) = report["comparison"]
    grpc_run, http_run = report["deployments"]["grpc"][0], report["deployments"]["http"][0]
    assert row["throughput_ratio"] == http_run["output_tok_s"] / grpc_run["output_tok_s"]
    assert row["ttft_p50_ratio"] == http_run["ttft_p50_ms"] / grpc_run["ttft_p50_ms"]
    assert "HTTP vs gRPC at inf" in capsys.readouterr().out


def test_image_request_set_is_seeded_llava_prompts(checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llava", "tiny"))
    sizes = ((40, 30), (64, 48))
    a = make_image_request_set(3, 4, tokenizer, 2, sizes, seed=1)
    text = make_request_set(3, 4, tokenizer, seed=1)
    # LLaVA-1.5's format around the text workload's ids: BOS, "USER: ", a placeholder per image, " ASSISTANT:".
    head = tokenizer("USER: <image>\n<image>\n").input_ids
    tail = tokenizer(" ASSISTANT:", add_special_tokens=False).input_ids
    assert head[0] == tokenizer.bos_token_id and head.count(tokenizer.convert_tokens_to_ids("<image>")) == 2
    for prompt, text_prompt, images in zip(a.prompts, text.prompts, a.images, strict=True):
        assert prompt == head + text_prompt + tail and len(images) == 2
    all_images = [image for images in a.images for image in images]
    assert [Image.open(io.BytesIO(data)).size for data in all_images] == [(40, 30), (64, 48)] * 3
    assert len(set(all_images)) == 6 and make_image_request_set(3, 4, tokenizer, 2, sizes, seed=1).images == a.images
    fresh = with_fresh_images(a, 1)
    assert fresh.prompts == a.prompts and not set(all_images) & {i for images in fresh.images for i in images}
    assert a.summary()["images_per_request"] == 2 and a.summary()["image_sizes"] == [[40, 30], [64, 48]]


def test_bench_serve_image_workload(checkpoint, tmp_path, capsys):
    model = checkpoint("llava", "tiny")
    code = main(
        [
            "bench", "serve", "--model", str(model), "--images-per-request", "1", "--image-sizes", "40x30,64x48",
            "--preprocess-images", "2", "--num-prompts", "2", "--output-len", "3", "--rates", "inf",
            "--repeats", "1", "--out", str(tmp_path), "--name", "i", "--log-dir", str(tmp_path / "logs"),
        ]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "i.json").read_text())
    rs = report["request_set"]
    assert (rs["images_per_request"], rs["image_sizes"]) == (1, [[40, 30], [64, 48]])
    for results in report["deployments"].values():
        (r,) = results
        assert (r["completed"], r["errors"], r["output_tokens"]) == (2, [], 6)
        assert 0 < r["ttft_p50_ms"] <= r["e2e_p50_ms"]
    pre = report["preprocessing"]
    assert pre["processor"] == "CLIPImageProcessorPil" and pre["num_images_per_size"] == 2
    assert set(pre["images_per_s_by_size"]) == {"40x30", "64x48"} and pre["images_per_s"] > 0
    assert pre["cpu_s_per_image"] > 0 and report["machine"]["cpu"]
    out = capsys.readouterr().out
    assert "1 PNG images each (40x30, 64x48, cycling)" in out and "frontend preprocessing on one thread" in out


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


def test_qwen25_preset_has_qwen25_05b_shape():
    """The preset's config against Qwen2.5-0.5B's config.json; its parameter count, made on the meta device (no
    weights), against the published 494,032,768, worked out by hand below."""
    import torch
    import transformers

    from splitserve.entrypoints.test_model import build_config

    config = build_config("qwen2", "qwen2.5-0.5b", 8192, 1, 2)  # a tokenizer of 8192: the preset's vocabulary wins
    assert isinstance(config, transformers.Qwen2Config) and config.architectures == ["Qwen2ForCausalLM"]
    shape = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (896, 24, 14, 2)
    assert (config.head_dim, config.intermediate_size, config.vocab_size) == (64, 4864, 151936)
    assert config.tie_word_embeddings is True and config.max_position_embeddings == 32768
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert PRESET_TABLE["qwen2.5-0.5b"].dtype == "bfloat16"
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    # per layer: q 896x896 + 896 bias, k and v 896x128 + 128 bias each, o 896x896, MLP 3 x 896x4864, 2 norms of 896
    per_layer = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    assert per_layer == 14_912_384
    expected = 24 * per_layer + 896 + 151936 * 896  # + final norm + the embedding, tied to the LM head
    assert sum(p.numel() for p in model.parameters()) == expected == 494_032_768


def test_fixed_vocabulary_preset_pads_past_the_tokenizer(tmp_path, monkeypatch):
    """A preset's fixed vocabulary (as qwen2.5-0.5b's 151936 over any tokenizer here) is written as is, with the
    preset's tying, RoPE theta and dtype; one smaller than the tokenizer is refused before any weight is made.
    Shown on tiny-sized copies of the preset, so no 1 GB checkpoint is built."""
    import dataclasses

    from safetensors import safe_open

    from splitserve.entrypoints import test_model

    tiny = PRESET_TABLE["tiny"]
    fixed = {k: getattr(PRESET_TABLE["qwen2.5-0.5b"], k) for k in ("tie_word_embeddings", "rope_theta", "dtype")}
    monkeypatch.setitem(test_model.PRESET_TABLE, "padded", dataclasses.replace(tiny, vocab_size=9000, **fixed))
    monkeypatch.setitem(test_model.PRESET_TABLE, "short", dataclasses.replace(tiny, vocab_size=100))
    monkeypatch.setattr(test_model, "PRESETS", (*test_model.PRESETS, "padded", "short"))
    path = test_model.make_test_model(tmp_path / "padded", "qwen2", "padded")
    config = json.loads((path / "config.json").read_text())
    assert len(AutoTokenizer.from_pretrained(path)) < 9000 == config["vocab_size"]
    assert config["tie_word_embeddings"] is True and config["rope_parameters"]["rope_theta"] == 1_000_000.0
    with safe_open(path / "model.safetensors", "pt") as f:
        embedding = f.get_tensor("model.embed_tokens.weight")
        assert "lm_head.weight" not in f.keys()  # tied: saved once
    assert tuple(embedding.shape) == (9000, 64) and str(embedding.dtype) == "torch.bfloat16"
    with pytest.raises(ValueError, match="100 vocabulary rows, fewer than the tokenizer's"):
        test_model.make_test_model(tmp_path / "short", "qwen2", "short")
    assert not (tmp_path / "short" / "model.safetensors").exists()


def test_device_limits_arithmetic_and_cpu_runs():
    peak = MatmulPeak.from_timing("float32", "cpu", 1000, 0.5)
    assert peak.flops_per_s == 4e9  # 2 x 1000^3 FLOPs in half a second
    copy = CopyBandwidth.from_timing("cpu", 10**6, 1e-3)
    assert copy.bytes_per_s == 2e9  # 1 MB read and 1 MB written in a millisecond
    measured = matmul_peak("float32", "cpu", sizes=(32, 64), trials=2)
    assert measured.size in (32, 64) and measured.flops_per_s == pytest.approx(2 * measured.size**3 / measured.best_s)
    moved = copy_bandwidth("cpu", num_bytes=4 * 2**20, trials=2)
    assert moved.num_bytes == 4 * 2**20 and moved.bytes_per_s == pytest.approx(2 * 4 * 2**20 / moved.best_s)
    with pytest.raises(ValueError, match="multiple of 4"):
        copy_bandwidth("cpu", num_bytes=6)
    with pytest.raises(ValueError, match="cpu or cuda"):
        matmul_peak("float32", "meta")


def test_decode_weight_bytes_by_hand(checkpoint):
    # tiny: hidden 64, intermediate 192, 4 layers, 4 query and 2 KV heads of 16
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192 + 2 * 64  # q, k and v, o, MLP, two norms
    llama = checkpoint("llama", "tiny")
    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    # untied: the LM head is read whole each step, the input embedding one row (not counted)
    llama_params = 4 * per_layer + 64 + 64 * vocab
    assert decode_weight_bytes(llama, "float32") == 4 * llama_params
    assert decode_weight_bytes(llama, "bfloat16") == 2 * llama_params
    qwen3 = checkpoint("qwen3", "tiny")
    vocab = json.loads((qwen3 / "config.json").read_text())["vocab_size"]
    # tied: the embedding is the LM head, counted once; qwen3 adds q and k norms of 16 per layer
    assert decode_weight_bytes(qwen3, "float32") == 4 * (4 * (per_layer + 2 * 16) + 64 + 64 * vocab)
    bandwidth = CopyBandwidth.from_timing("cpu", 10**9, 0.5)  # 4 GB/s read + written
    assert weight_read_bound_s(10**9, bandwidth) == 0.25


def test_single_request_summary_by_hand():
    bandwidth = CopyBandwidth.from_timing("cpu", 10**6, 1e-3)  # 2e9 bytes/s
    setting = {"device": "cpu", "dtype": "float32", "cuda_graphs": False, "prompt_len": 5, "output_len": 4}
    latency = single_request.summarize((0.02, [0.004, 0.006, 0.005]), 10**6, bandwidth, setting)
    assert latency.ttft_ms == pytest.approx(20.0) and latency.itl_ms == pytest.approx([4.0, 6.0, 5.0])
    assert (latency.itl_median_ms, latency.itl_mean_ms) == pytest.approx((5.0, 5.0))
    assert latency.itl_p99_ms == pytest.approx(5.98)  # linear interpolation between 5 and 6 at 0.98
    assert latency.weight_read_bound_ms == pytest.approx(0.5)  # 1e6 bytes at 2e9 bytes/s
    assert latency.copy_bandwidth_gb_s == pytest.approx(2.0)
    assert latency.itl_over_bound == pytest.approx(10.0) and latency.target_met  # at the target: met
    slower = single_request.summarize((0.02, [0.004, 0.0051, 0.006]), 10**6, bandwidth, setting)
    assert slower.itl_over_bound == pytest.approx(10.2) and not slower.target_met
    with pytest.raises(ValueError, match="two output tokens"):
        single_request.summarize((0.02, []), 10**6, bandwidth, setting)


def test_throughput_run_reports_device_and_single_request_on_cpu(checkpoint, monkeypatch):
    """The device-independent parts of the GPU benchmark, run on CPU: the machine named with its CPU flags, the
    single-request ITL measured at the core (one gap per token after the first) against the weight-read bound; the
    matmul peak (MFU's denominator) measured on the thread count the backends run on, not torch's default."""
    peak_threads: list[int] = []

    def recording_peak(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        peak_threads.append(torch.get_num_threads())
        return matmul_peak(*args, **kwargs)

    monkeypatch.setattr(throughput, "matmul_peak", recording_peak)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)  # a default other than the run's one thread
    path = checkpoint("llama", "tiny")
    requests = make_request_set(2, 3, AutoTokenizer.from_pretrained(path), seed=0)
    settings = throughput.Settings.for_device(
        "cpu",
        backends=("splitserve",),
        dtypes=("float32",),
        preemption_kv_fraction=0.0,
        observability_repeats=0,
        single_request_output_len=5,
        matmul_sizes=(64,),
        copy_bytes=4 * 2**20,
        num_threads=1,
    )
    try:
        report = throughput.run(path, requests, settings)
    finally:
        torch.set_num_threads(threads_before)
    assert peak_threads == [1, 1]  # before the runs and after, float32 each
    assert report["num_threads"] == 1
    assert report["device"] == "cpu" and report["machine"]["gpu"] is None
    assert set(report["machine"]["cpu_flags"]) <= set(MATMUL_CPU_FLAGS)
    [result] = report["results"]
    assert result["label"] == "splitserve float32" and result["extra"]["device"] == "cpu"
    assert result["extra"]["kv_cache_dtype"] == "float32"
    latency = report["single_request"]
    assert (latency["device"], latency["dtype"], latency["cuda_graphs"]) == ("cpu", "float32", False)
    assert (latency["prompt_len"], latency["output_len"]) == (len(requests.prompts[0]), 5)
    assert len(latency["itl_ms"]) == 4 and all(gap > 0 for gap in latency["itl_ms"])
    assert latency["weight_bytes"] == decode_weight_bytes(path, "float32")
    copy = latency["copy_bandwidth"]
    assert copy["num_bytes"] == 4 * 2**20 and latency["copy_bandwidth_gb_s"] == pytest.approx(copy["bytes_per_s"] / 1e9)
    bound_ms = 1e3 * latency["weight_bytes"] / copy["bytes_per_s"]
    assert latency["weight_read_bound_ms"] == pytest.approx(bound_ms)
    assert latency["itl_over_bound"] == pytest.approx(latency["itl_median_ms"] / bound_ms)
    assert [c.name for c in throughput_report.check_targets(report)] == ["splitserve float32 MFU"]
    assert "single request (float32" in throughput_report.format_report(report)


def test_rounds_interleave_the_precisions_and_report_each_ones_median_run(monkeypatch):
    """``--rounds 3``: the rounds in ``round_order``; each precision's result is its median run by wall time, its
    MFU from that run, every run's rate kept in round order and printed, the target ratio paired by round."""
    from benchmarks.workload import RequestSet

    requests = RequestSet(prompts=[[5, 6, 7], [8, 9]], output_len=4, seed=0)  # 8 output tokens a run
    walls = {"float32": [2.0, 1.0, 4.0], "int8": [0.5, 2.0, 1.0]}  # the medians: 2.0 s and 1.0 s (round by round)
    order: list[str] = []

    def fake_run(model, reqs, dtype, **core_config):  # noqa: ANN001, ANN003, ANN202
        order.append(dtype)
        return walls[dtype][order.count(dtype) - 1], [[1] * 4, [2] * 4], {"run": order.count(dtype)}

    monkeypatch.setattr(throughput, "run_splitserve", fake_run)
    settings = throughput.Settings(dtypes=("float32", "int8"), rounds=3)
    flops = ModelFlops(non_embedding_matmul_params=10, lm_head_params=2, num_layers=1, attention_width=1)
    peaks = {"float32": 100.0, "int8": 100.0}
    results = throughput._splitserve_rounds(Path("m"), requests, settings, {}, flops, peaks)
    assert order == ["float32", "int8", "int8", "float32", "float32", "int8"]  # round_order(2, r)
    by_dtype = {r.dtype: r for r in results}
    assert (by_dtype["float32"].wall_s, by_dtype["float32"].extra["run"]) == (2.0, 1)
    assert (by_dtype["int8"].wall_s, by_dtype["int8"].extra["run"]) == (1.0, 3)
    assert by_dtype["float32"].output_tok_s == 4.0 and by_dtype["float32"].mfu == flops.total(requests) / 2.0 / 100.0
    assert by_dtype["int8"].extra["rounds_output_tok_s"] == [16.0, 4.0, 8.0]
    report = {
        "device": "cpu", "machine": {"cpu": "x", "cores": 2, "torch": "t", "transformers": "t", "triton": None},
        "model": "m", "matmul_peak_gflops": {"float32": 0.1},
        "request_set": {"num_requests": 2, "prompt_len_mean": 2.5, "output_len": 4},
        "results": [throughput._public(r) | {"ratios": {}} for r in results], "single_request": None,
    }  # fmt: skip
    assert (
        "rounds splitserve int8: 16.0, 4.0, 8.0 out tok/s (above: the median run)"
        in throughput_report.format_report(report)
    )
    # int8 over float32 round by round: 16/4, 4/8, 8/2 -> median 4.0 (the rows' medians would give 8/4 = 2.0)
    checks = {c.name: c.measured for c in throughput_report.check_targets(report)}
    assert checks["splitserve int8 over float32"] == 4.0
    with pytest.raises(ValueError, match="rounds must be at least 1, got 0"):
        throughput.Settings(rounds=0)
    with pytest.raises(ValueError, match="splitserve needs at least one precision in dtypes"):
        throughput.Settings(dtypes=())
    with pytest.raises(ValueError, match="dtypes names a precision more than once: int8,float32,int8"):
        throughput.Settings(dtypes=("int8", "float32", "int8"))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_round_order_puts_every_precision_in_every_place_and_after_every_other_alike(n):
    """Williams' design: n rounds (2n for an odd n) hold each precision once per position per n rounds and every
    ordered neighbour pair equally often."""
    span = n if n % 2 == 0 else 2 * n
    orders = [throughput.round_order(n, r) for r in range(span)]
    assert all(sorted(order) == list(range(n)) for order in orders)
    for block in (orders[:n], orders[n:]):
        for position in range(n):
            assert block == [] or sorted(order[position] for order in block) == list(range(n))
    pairs = [(order[i], order[i + 1]) for order in orders for i in range(n - 1)]
    times = span // n
    assert sorted(pairs) == sorted((a, b) for a in range(n) for b in range(n) if a != b for _ in range(times))


def test_the_timed_run_has_the_startup_heap_frozen_and_gives_it_back():
    """``startup_heap_frozen``: inside, what was alive on entry is out of garbage collection (as in the servers once
    loaded); after, it is collectable again, and a cycle dropped inside is then collected."""
    import gc
    import weakref

    from benchmarks.throughput import startup_heap_frozen

    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the collector frees it
    dead = weakref.ref(node)
    gc.unfreeze()
    with startup_heap_frozen():
        assert gc.get_freeze_count() > 1000
        del node
        gc.collect()
        assert dead() is not None  # frozen: not collected
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert dead() is None


def test_report_says_whose_peak_an_integer_runs_mfu_is_over():
    """int8 (over either KV cache) and q8_0 runs' MFU divides by float32's matmul peak (no integer peak is
    measured): the report says so under the table, naming those runs, and says nothing of it without them."""
    machine = {"cpu": "x", "cores": 2, "torch": "2.13.0", "transformers": "5.24.0", "triton": "3.9.0"}

    def result(label: str, mfu: float) -> dict:
        return {
            "backend": label.split()[0], "label": label, "wall_s": 1.0, "output_tok_s": 1.0, "total_tok_s": 2.0,
            "mfu": mfu, "mfu_lm_head_every_token": mfu, "exact_match": None, "ratios": {},
        }  # fmt: skip

    report = {
        "device": "cpu", "machine": machine, "model": "m", "matmul_peak_gflops": {"float32": 131.0},
        "request_set": {"num_requests": 64, "prompt_len_mean": 137.0, "output_len": 128},
        "results": [
            result("splitserve float32", 0.48), result("splitserve int8", 1.01),
            result("splitserve int8-kv-float32", 0.7), result("llama.cpp q8_0", 0.1),
        ],
        "single_request": None,
    }  # fmt: skip
    text = throughput_report.format_report(report)
    assert "MFU of splitserve int8, splitserve int8-kv-float32, llama.cpp q8_0: over float32's matmul peak" in text
    report["results"] = report["results"][:1]
    assert "over float32's matmul peak" not in throughput_report.format_report(report)


def test_gpu_report_targets_and_device_line():
    """On CUDA the targets are issue 16's: at least 5x transformers generate_batch, the single-request ITL at most
    10x the weight-read bound; the report names the GPU."""
    gpu = {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8, "cuda": "13.0", "multiprocessors": 132}
    machine = {"cpu": "x", "cores": 16, "torch": "2.11.0", "transformers": "5.24.0", "triton": "3.6.0", "gpu": gpu}
    result = {
        "backend": "splitserve", "label": "splitserve bfloat16", "wall_s": 1.0, "output_tok_s": 6000.0,
        "total_tok_s": 7000.0, "mfu": 0.1, "mfu_lm_head_every_token": 0.1, "exact_match": None,
        "ratios": {"transformers generate_batch": 6.0, "transformers generate (batch 64)": 9.0},
    }  # fmt: skip
    latency = {"itl_over_bound": 12.0, "cuda_graphs": True}
    report = {
        "device": "cuda", "machine": machine, "model": "m", "matmul_peak_gflops": {"bfloat16": 7.9e5},
        "request_set": {"num_requests": 512, "prompt_len_mean": 140.0, "output_len": 128}, "results": [result],
        "single_request": None,
    }  # fmt: skip
    checks = throughput_report.check_targets({**report, "single_request": latency})
    assert [(c.name, c.measured, c.wanted, c.met) for c in checks] == [
        ("splitserve bfloat16 vs transformers generate_batch", 6.0, 5.0, True),
        ("single-request ITL over weight-read bound", 12.0, 10.0, False),
    ]
    assert checks[1].line() == "target single-request ITL over weight-read bound: 12.00 (want <= 10.00) NOT MET"
    text = throughput_report.format_report(report)
    assert "on GPU NVIDIA H200 (capability 9.0, 140 GiB, CUDA 13.0); torch 2.11.0, triton 3.6.0" in text
    assert "target splitserve bfloat16 vs transformers generate_batch: 6.00 (want >= 5.00) MET" in text
    cuda = throughput.Settings.for_device("cuda", hf_batch_size=32)
    assert (cuda.dtypes, cuda.hf_dtype, cuda.hf_batch_size, cuda.single_request_output_len) == (
        ("bfloat16",),
        "bfloat16",
        32,
        128,
    )
    assert cuda.preemption_kv_fraction is None and cuda.observability_repeats == 0


def test_machine_names_the_gpu(monkeypatch):
    """What a CUDA result records of its GPU, from torch.cuda's device queries (stubbed: no GPU here)."""
    import types

    import torch

    props = types.SimpleNamespace(total_memory=150 * 2**30, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    gpu = Machine.current("cuda").gpu
    assert gpu == {
        "name": "NVIDIA H200",
        "capability": "9.0",
        "memory_gib": 150.0,
        "multiprocessors": 132,
        "cuda": "13.0",
    }
    assert Machine.current("cpu").gpu is None


def test_gemv_routes_compute_the_same_products():
    """``benchmarks.gemv``'s float32 routes (the layouts ``Linear`` runs) give one product each, the same one."""
    from benchmarks import gemv
    from core_svc.models.layers import compiled_panel_linear
    from tests.helpers import cpu_kernels_loaded

    kernels = cpu_kernels_loaded()  # as gemv.main loads them: the compiled routes join where they are built
    shapes = ((48, 32), (16, 48))
    by_precision, missing = gemv.routes(5, shapes)
    float32 = by_precision["float32"]
    assert {"packed", "column-major", "mkl"} <= set(float32)
    assert ("panels" in float32) == (kernels and compiled_panel_linear() is not None)
    assert any(line.startswith("float32 gemv:") for line in missing)  # 5 rows: past the kernel's limit
    results = {route: run() for route, run in float32.items()}
    for route, outputs in results.items():
        assert [tuple(o.shape) for o in outputs] == [(5, 48), (5, 16)], route
        for out, expected in zip(outputs, results["mkl"], strict=True):
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_gemv_bfloat16_routes_compute_the_same_products():
    """``benchmarks.gemv``'s bfloat16 routes past the matrix-vector kernel's rows (oneDNN's packed weight, F.linear
    on the dense one, the AMX kernel where it runs) give one product each, up to the order of float32 sums."""
    from benchmarks import gemv
    from core_svc.models.layers import compiled_amx_linear

    by_precision, missing = gemv.routes(5, ((48, 32), (16, 64)))
    bfloat16 = by_precision["bfloat16"]
    assert "dense" in bfloat16
    assert ("amx" in bfloat16) == (compiled_amx_linear() is not None)
    results = {route: run() for route, run in bfloat16.items()}
    for route, outputs in results.items():
        assert [tuple(o.shape) for o in outputs] == [(5, 48), (5, 16)], route
        for out, expected in zip(outputs, results["dense"], strict=True):
            torch.testing.assert_close(out.float(), expected.float(), atol=0.05, rtol=1e-2)
