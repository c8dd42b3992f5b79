"""benchmarks.decode_profile: the breakdown's arithmetic by hand, and one child measurement and a whole run on a tiny
checkpoint (checking what they report, never how fast anything ran)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import decode_profile
from benchmarks.decode_profile import PHASES, breakdown, format_table, summarize
from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.request import Request
from core_svc.sampling_params import SamplingParams
from tests.helpers import cpu_kernels_loaded


def test_breakdown_by_hand():
    """Two steps' seconds: measured parts per step in ms, the rest by difference."""
    table = {
        "step": 0.020,  # 10 ms per step
        "schedule": 0.001,
        "update": 0.0006,
        "execute": 0.018,
        "update_states": 0.0002,
        "prepare": 0.0004,
        "forward": 0.012,
        "decoder": 0.002,  # a step of the one-call decoder beside a step layer by layer
        "linear": 0.006,
        "attention": 0.001,
        "lm_head": 0.004,
        "output": 0.0002,
    }
    table |= {"cpu:" + key: value / 2 for key, value in table.items()}  # half the wall time on the CPU
    parts = breakdown(table, 2)
    assert breakdown(table, 2, "cpu:") == pytest.approx({key: value / 2 for key, value in parts.items()})
    expected = {
        "schedule": 0.5,
        "inputs": 0.3,
        "decoder": 1.0,
        "linear": 3.0,
        "attention": 0.5,
        "forward_rest": 1.5,  # 6 - 1 - 3 - 0.5
        "lm_head": 2.0,
        "sampling": 0.6,  # 9 - 0.1 - 0.2 - 6 - 2 - 0.1
        "output": 0.1,
        "update": 0.3,
        "step_rest": 0.2,  # 10 - 0.5 - 9 - 0.3
    }
    assert list(parts) == list(PHASES)
    assert parts == pytest.approx(expected)
    assert sum(parts.values()) == pytest.approx(10.0)  # the parts add up to the step


def test_summary_takes_medians_over_runs():
    runs = [
        {
            "ms_per_token": t,
            "cpu_ms_per_token": t / 2,
            "breakdown_ms": dict.fromkeys(PHASES, t / 10),
            "breakdown_cpu_ms": dict.fromkeys(PHASES, t / 20),
        }
        for t in (10.0, 30.0, 20.0)
    ]
    summary = summarize(runs)
    assert (summary["ms_per_token"], summary["cpu_ms_per_token"]) == (20.0, 10.0)
    assert summary["breakdown_ms"] == dict.fromkeys(PHASES, 2.0)
    assert summary["breakdown_cpu_ms"] == dict.fromkeys(PHASES, 1.0)
    [header, wall, cpu] = format_table({"after": summary})
    assert header.split()[:4] == ["tree", "ms/token", "CPU", "ms"]
    assert wall.split()[:4] == ["after", "20.00", "10.00", "wall"] and wall.split()[4:] == ["2.000"] * len(PHASES)
    assert cpu.split() == ["CPU"] + ["1.000"] * len(PHASES)


def _greedy_reference(path: Path, prompt: list[int], output_len: int) -> list[int]:
    """The same request decoded by a plain EngineCore, no timers."""
    core = EngineCore(CoreConfig(model=str(path), num_kv_blocks=64))
    core.add_request(Request("ref", prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        tokens += [t for output in core.step().outputs for t in output.new_token_ids]
    return tokens


def test_measure_times_every_decode_step_and_keeps_the_tokens(checkpoint):
    path = checkpoint("llama", "tiny")
    prompt, output_len = list(range(3, 40)), 6
    result = decode_profile.measure(path, "float32", prompt, output_len)
    assert result["tokens"] == _greedy_reference(path, prompt, output_len)
    assert result["same_tokens_profiled"]
    assert len(result["step_ms"]) == output_len - 1  # the prefill step gives the first token and is left out
    parts = result["breakdown_ms"]
    assert list(parts) == list(PHASES) and all(parts[k] > 0 for k in ("lm_head", "schedule"))
    if cpu_kernels_loaded():  # the decode steps are one call each (core_svc/models/one_call_decoder.py)
        assert parts["decoder"] > 0 and parts["linear"] == parts["attention"] == 0
    else:
        assert parts["decoder"] == 0 and parts["linear"] > 0 and parts["attention"] > 0
    assert list(result["breakdown_cpu_ms"]) == list(PHASES)
    # the parts add up to the instrumented step, which lies inside the time around it
    assert 0 < sum(parts.values()) <= result["profiled_ms_per_token_mean"]


def test_a_run_against_a_baseline_tree_writes_both(checkpoint, tmp_path, capsys):
    """This checkout as its own baseline: the children import the tree given, and the report has both."""
    path = checkpoint("llama", "tiny")
    source = Path(decode_profile.__file__).resolve().parents[1]
    argv = ["--model", str(path), "--baseline-source", str(source), "--repeats", "1", "--threads", "1"]
    report = decode_profile.main([*argv, "--prompt-len", "20", "--output-len", "4", "--out", str(tmp_path)])
    assert list(report["summaries"]) == ["before", "after"] and report["same_tokens"]
    assert all(
        len(run["tokens"]) == 4 and run["torch_threads"] == 1 for runs in report["runs"].values() for run in runs
    )
    saved = json.loads((tmp_path / "decode-profile-small.json").read_text())
    assert saved["summaries"] == report["summaries"]
    assert (tmp_path / "decode-profile-small.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens identical across trees and passes: True" in capsys.readouterr().out
