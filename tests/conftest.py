"""Shared fixtures: seeded tiny checkpoints (built once per session) and the transformers reference."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

# The real tokenizers: ../shared/tokenizers beside the checkout, or SPLITSERVE_TOKENIZERS_DIR.
SHARED_TOKENIZERS = Path(
    os.environ.get("SPLITSERVE_TOKENIZERS_DIR", Path(__file__).resolve().parents[2] / "shared" / "tokenizers")
)
_DIVERGENCE_REPORT: list[str] = []  # the end-of-run summary's lines (in the controller, under pytest-xdist)
_PENDING_DIVERGENCES: list[str] = []  # recorded by the running test, not yet in its report
_DIVERGENCE_PROPERTY = "greedy divergence"

# Triton decides when a kernel is decorated (its module first imported) whether to compile it for the GPU or
# interpret it on CPU tensors: without a GPU, interpret, so that any test reaching the triton attention backend
# runs. Decided without importing torch (nvidia-smi comes with the NVIDIA driver).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def shared_tokenizer(name: str) -> Path:
    """A real tokenizer folder (llama2, gpt2), or skip the test with the reason. "builtin" is the project's own
    tokenizer, always available, so tests parametrized over tokenizers still run in a bare clone."""
    if name == "builtin":
        return builtin_tokenizer_dir()
    path = SHARED_TOKENIZERS / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"real tokenizer {name!r} not found at {path}")
    return path


@cache
def builtin_tokenizer_dir() -> Path:
    from splitserve.entrypoints.builtin_tokenizer import save_builtin_tokenizer

    path = Path(tempfile.mkdtemp(prefix="splitserve-builtin-tokenizer-"))
    save_builtin_tokenizer(path)
    return path


def real_or_builtin(name: str) -> Path:
    """The real tokenizer when present, else the builtin one (for tests that need some real-world tokenizer)."""
    path = SHARED_TOKENIZERS / name
    return path if (path / "tokenizer.json").is_file() else builtin_tokenizer_dir()


@pytest.fixture
def threads() -> Iterator[None]:
    """torch's thread count, as it was before the test, restored after it (for tests that set it)."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(arch, preset="tiny", **make_test_model kwargs) -> path, built once per distinct argument set."""
    from splitserve.entrypoints.test_model import make_test_model

    built: dict[str, Path] = {}

    def get(arch: str = "llama", preset: str = "tiny", **kwargs: Any) -> Path:
        key = json.dumps([arch, preset, kwargs], sort_keys=True, default=str)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{arch}-{preset}")
            built[key] = make_test_model(out, arch=arch, preset=preset, **kwargs)
        return built[key]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``cuda`` where torch sees no CUDA device, saying so (torch is imported only when
    such a test was collected)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    reason = f"needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__})"
    for item in cuda_items:
        item.add_marker(pytest.mark.skip(reason=reason))


def report_divergence(line: str) -> None:
    """Record a greedy divergence between splitserve and transformers for the end-of-run summary."""
    _PENDING_DIVERGENCES.append(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Divergences recorded by a test travel in its report's ``user_properties``, so that the summary also has
    those of tests run by pytest-xdist workers (the controller sees only the reports)."""
    report = yield
    while _PENDING_DIVERGENCES:
        report.user_properties.append((_DIVERGENCE_PROPERTY, _PENDING_DIVERGENCES.pop(0)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Called in the process that prints the summary for every report, its own or a worker's."""
    _DIVERGENCE_REPORT.extend(value for name, value in report.user_properties if name == _DIVERGENCE_PROPERTY)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _DIVERGENCE_REPORT:
        terminalreporter.section("greedy near-tie divergences vs transformers")
        for line in _DIVERGENCE_REPORT:
            terminalreporter.write_line(line)


# A generation config as a checkpoint's author would ship it: top_k=1 makes unset sampling fields greedy.
GENERATION_CONFIG_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 1}


@pytest.fixture(scope="session")
def generation_config_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint whose generation_config.json also sets ``GENERATION_CONFIG_DEFAULTS``."""
    from splitserve.entrypoints.test_model import make_test_model

    path = make_test_model(tmp_path_factory.mktemp("generation-config-model"), "llama", "tiny", seed=0)
    config_file = path / "generation_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **GENERATION_CONFIG_DEFAULTS}))
    return path
