"""Shared fixtures: seeded tiny checkpoints (built once per session) and the transformers reference."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

SHARED_TOKENIZERS = Path(__file__).resolve().parents[2] / "shared" / "tokenizers"
_DIVERGENCE_REPORT: list[str] = []


def shared_tokenizer(name: str) -> Path:
    """A real tokenizer folder from ../shared/tokenizers, or skip the test with the reason."""
    path = SHARED_TOKENIZERS / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"real tokenizer {name!r} not found at {path}")
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(arch, preset="tiny", **make_test_model kwargs) -> path, built once per distinct argument set."""
    from splitserve.test_model import make_test_model

    built: dict[str, Path] = {}

    def get(arch: str = "llama", preset: str = "tiny", **kwargs: Any) -> Path:
        key = json.dumps([arch, preset, kwargs], sort_keys=True, default=str)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}")
            built[key] = make_test_model(out, arch=arch, preset=preset, **kwargs)
        return built[key]

    return get


def report_divergence(line: str) -> None:
    """Record a greedy divergence between splitserve and transformers for the end-of-run summary."""
    _DIVERGENCE_REPORT.append(line)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _DIVERGENCE_REPORT:
        terminalreporter.section("greedy near-tie divergences vs transformers")
        for line in _DIVERGENCE_REPORT:
            terminalreporter.write_line(line)
