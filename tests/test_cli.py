"""``splitserve generate``: offline runs through the engine core, checked against transformers."""

from __future__ import annotations

import io
import json
import logging
import re
import sys

from splitserve.entrypoints.cli import main
from tests.helpers import hf_greedy


def test_generate_json_matches_transformers(checkpoint, capsys):
    from transformers import AutoTokenizer

    path = checkpoint("llama")
    prompts = ["The capital of France is", "def add(a, b):"]
    args = ["generate", "--model", str(path), "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--json"]
    for prompt in prompts:
        args += ["--prompt", prompt]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert [line["prompt"] for line in lines] == prompts
    for line in lines:
        assert line["prompt_token_ids"] == tokenizer(line["prompt"]).input_ids
        output = line["outputs"][0]
        assert output["index"] == 0 and output["finish_reason"] == "length"
        assert output["token_ids"] == hf_greedy(path, line["prompt_token_ids"], 12).token_ids
        assert output["text"] == tokenizer.decode(output["token_ids"], skip_special_tokens=True)


def test_generate_seeded_sampling_is_reproducible(checkpoint, capsys):
    path = checkpoint("llama")
    args = [
        "generate",
        "--model",
        str(path),
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "10",
        "--seed",
        "7",
        "--top-k",
        "20",
        "--json",
    ]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == first


def test_generate_reports_errors_cleanly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == f"error: no such folder: {tmp_path / 'missing'}\n"


def test_generate_n_stop_logprobs_and_chat(checkpoint, capsys):
    from transformers import AutoTokenizer

    path = checkpoint("llama")
    base = ["generate", "--model", str(path), "--prompt", "Once upon a time", "--max-tokens", "16", "--json"]
    assert main(base + ["--n", "3", "--seed", "1", "--logprobs", "2"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert sorted(o["index"] for o in line["outputs"]) == [0, 1, 2]
    for output in line["outputs"]:
        assert len(output["logprobs"]) == len(output["token_ids"])
        assert all(
            position[0]["token_id"] == token
            for position, token in zip(output["logprobs"], output["token_ids"], strict=True)
        )
        assert output["cumulative_logprob"] == sum(p[0]["logprob"] for p in output["logprobs"])

    assert main(base + ["--temperature", "0", "--ignore-eos"]) == 0
    free_text = json.loads(capsys.readouterr().out)["outputs"][0]["text"]
    stop = free_text[4:6]
    assert main(base + ["--temperature", "0", "--ignore-eos", "--stop", stop]) == 0
    stopped = json.loads(capsys.readouterr().out)["outputs"][0]
    assert stopped["text"] == free_text[: free_text.index(stop)] and stopped["stop_reason"] == stop

    assert main(base + ["--chat", "--temperature", "0"]) == 0
    chat = json.loads(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert chat["prompt_token_ids"] == tokenizer.apply_chat_template(
        [{"role": "user", "content": "Once upon a time"}], tokenize=True, add_generation_prompt=True, return_dict=False
    )


class _Writes(io.StringIO):
    """A stdout that keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    def write(self, text: str) -> int:
        self.pieces.append(text)
        return super().write(text)


def test_generate_streams_one_prompt_and_shows_a_progress_bar_for_several(checkpoint, capsys, monkeypatch, caplog):
    """One prompt: its text goes to stdout piece by piece as it is generated, then a newline, and is the text the
    non-streamed path gives (--json, LLM.generate). Several prompts: vLLM's progress bar on stderr, then the
    results as before."""
    monkeypatch.delenv("COLUMNS", raising=False)  # tqdm cuts its line to $COLUMNS when it cannot ask the terminal
    path = checkpoint("llama")
    prompts = ["The capital of France is", "def add(a, b):"]
    base = ["generate", "--model", str(path), "--max-tokens", "24", "--temperature", "0", "--ignore-eos"]

    assert main(base + ["--prompt", prompts[0], "--prompt", prompts[1], "--json"]) == 0
    captured = capsys.readouterr()
    texts = [json.loads(line)["outputs"][0]["text"] for line in captured.out.splitlines()]
    assert re.search(
        r"Processed prompts: 100%.* 2/2 \[.*est\. speed input: [0-9.]+ toks/s, output: [0-9.]+ toks/s", captured.err
    )

    assert main(base + ["--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [f"{p!r} -> {t!r} (length)" for p, t in zip(prompts, texts, strict=True)]
    assert "Processed prompts: 100%" in captured.err

    for chat in ([], ["--chat"]):
        assert main(base + ["--prompt", prompts[0], "--json", *chat]) == 0
        expected = json.loads(capsys.readouterr().out)
        stdout = _Writes()
        caplog.clear()
        with monkeypatch.context() as patch, caplog.at_level(logging.INFO, logger="splitserve"):
            patch.setattr(sys, "stdout", stdout)
            assert main(base + ["--prompt", prompts[0], *chat]) == 0
        assert stdout.getvalue() == expected["outputs"][0]["text"] + "\n"
        assert len([piece for piece in stdout.pieces if piece]) > 3  # streamed, not written at the end
        assert "Processed prompts" not in capsys.readouterr().err
        num_prompt_tokens = len(expected["prompt_token_ids"])
        summary = [r.getMessage() for r in caplog.records if r.name == "splitserve"]
        assert len(summary) == 1
        assert re.fullmatch(
            rf"finished \(length\): {num_prompt_tokens} prompt tokens, 24 output tokens in [0-9.]+ s "
            r"\([0-9.]+ toks/s\)",
            summary[0],
        )


def test_generate_sampling_flags_default_to_the_models_generation_config(generation_config_model, capsys):
    """Flags not given take the model's defaults (top_k 1: greedy), flags given override them, and
    --generation-config vllm leaves vLLM's defaults."""
    base = ["generate", "--model", str(generation_config_model), "--prompt", "Once upon a time", "--json"]
    base += ["--ignore-eos", "--max-tokens", "10"]

    def run(*flags: str) -> list[int]:
        assert main(base + list(flags)) == 0
        return json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]

    greedy = run("--temperature", "0")
    assert run() == greedy
    overridden = run("--top-k", "0", "--seed", "3")
    assert overridden == run("--generation-config", "vllm", "--temperature", "0.7", "--top-p", "0.9", "--seed", "3")
    assert overridden != greedy
    assert run("--generation-config", "vllm", "--seed", "3") == run(
        "--temperature", "1", "--top-p", "1", "--top-k", "0", "--seed", "3"
    )


def test_bad_flags_fail_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """A sampling flag or --generation-config that cannot work fails at once, naming itself: before, generate loaded
    the model first and a split frontend waited for a core before reading --generation-config."""
    import splitserve.entrypoints.cli as cli

    def no_model(*args: object, **kwargs: object) -> str:
        raise AssertionError("the model was looked up")

    monkeypatch.setattr(cli, "resolve_model_arg", no_model)
    cases = [
        (["generate", "--temperature", "5"], "error: temperature: must be a finite number in [0, 2], got 5.0"),
        (["generate", "--generation-config", "vlm"], "error: generation_config: must be 'auto', 'vllm' or a folder"),
        (["serve", "--generation-config", str(tmp_path)], f"generation_config.json; {tmp_path} holds none"),
        (["frontend", "--core", "localhost:1", "--generation-config", "vlm"], "error: generation_config: "),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
