"""``splitserve demo`` (``make run``): it says first which model answers and, for the demo model (random weights),
that its text is gibberish by design and how to run a real model; then the demo prompts stream through the stack."""

from __future__ import annotations

import re

import pytest

from splitserve.base import envs
from splitserve.entrypoints.cli import main
from splitserve.entrypoints.demo import DEMO_NAME, is_demo_model, model_notice

GIBBERISH = "Its weights are random (it is built for testing), so the text below is gibberish by design"
REAL_MODEL = "make run MODEL=Qwen/Qwen2.5-0.5B-Instruct (a hub id, needs network)"


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    """A cache folder of its own for the demo model; its ``kernels`` is the real kernel folder (a link), so the
    demo's processes load the CPU kernel that setup built instead of compiling it again (a minute on busy cores)."""
    kernels = envs.kernel_dir()
    (tmp_path / "cache").mkdir()
    if kernels.is_dir():
        (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPLITSERVE_MODEL", raising=False)
    return tmp_path / "cache"


def test_the_demo_model_gets_the_random_weights_notice(cache_dir, monkeypatch):
    demo = cache_dir / DEMO_NAME
    monkeypatch.chdir(cache_dir.parent)
    for spelling in (str(demo), f"cache/{DEMO_NAME}", f"{demo}/"):  # however the path is written
        assert is_demo_model(spelling)
        assert model_notice(spelling) == (
            f"Model: the demo checkpoint ({spelling})\n"
            f"  {GIBBERISH}; every\n"
            "  step (tokenizer, scheduler, KV cache, sampling, streaming) is real.\n"
            f"  For real text: {REAL_MODEL}\n"
            "             or: make run MODEL=/path/to/hf-folder (a local Hugging Face checkpoint)\n"
            "  (splitserve demo --model ... alike)"
        )
    stack_notice = model_notice(str(demo), "stack")
    assert "so the text it generates is gibberish by design" in stack_notice
    assert "make stack MODEL=Qwen/Qwen2.5-0.5B-Instruct" in stack_notice and "(splitserve stack --model" in stack_notice


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "/models/llama", "demo-llama-small-seed0"])
def test_another_model_is_named_without_the_notice(cache_dir, model):
    assert not is_demo_model(model)
    assert model_notice(model) == f"Model: {model}"
    assert model_notice(model, "stack") == f"Model: {model}"


def test_the_demo_says_so_before_its_outputs_and_streams_what_the_llm_returns(cache_dir, capsys):
    """``splitserve demo`` with no model: the demo model (here a tiny stand-in in its cache folder) as two processes;
    the notice comes first, the greedy completion is the in-process LLM's, and both processes exit 0."""
    from frontend_svc import LLM, SamplingParams
    from splitserve.entrypoints.test_model import make_test_model

    demo = make_test_model(cache_dir / DEMO_NAME, "llama", "tiny")
    with LLM(str(demo)) as llm:
        (expected,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=40))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(model_notice(str(demo)) + "\nstarting the split stack (logs in ")
    completion = re.search(r"--- completion: 'The capital of France is'\n(.*?)\n    TTFT ", out, re.DOTALL)
    assert completion is not None and completion.group(1) == expected.outputs[0].text
    assert re.search(r"stopped: frontend-\d+ exited 0, core-\d+ exited 0\n$", out)
