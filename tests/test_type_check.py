"""The packages type-check (mypy with ``[tool.mypy]`` of pyproject.toml, as ``make lint`` runs it), the configuration
states the checks we mean, and every ``type: ignore`` names its error code and says why on its line.

mypy keeps its cache in ``.cache/mypy`` (the config's ``cache_dir``): a first run takes about 35 s of CPU (75 s
on two busy cores), a run after it a second or two.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["splitserve", "frontend_svc", "core_svc", "kernels", "benchmarks"]
# "# type: ignore[code]  # reason": the codes in brackets, then a comment of its own.
IGNORE_WITH_REASON = re.compile(r"# type: ignore\[[a-z-]+(, [a-z-]+)*\]  # \S")


def mypy_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


@pytest.mark.slow
def test_the_packages_type_check():
    done = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("Success: no issues found"), done.stdout


def test_the_config_checks_every_package_strictly():
    config = mypy_config()
    assert config["packages"] == PACKAGES
    assert config["python_version"] == "3.11"
    for flag in (
        "check_untyped_defs",
        "disallow_untyped_defs",
        "disallow_incomplete_defs",
        "no_implicit_optional",
        "warn_unused_ignores",
        "warn_redundant_casts",
    ):
        assert config[flag] is True, flag
    assert "ignore_missing_imports" not in config  # only per module, for the libraries listed
    overrides = config["overrides"]
    ignored = {module for override in overrides if override.get("ignore_errors") for module in override["module"]}
    assert ignored == {
        "splitserve.stubs.engine.v1.engine_core_pb2_grpc",
        "splitserve.stubs.frontend.v1.generation_pb2_grpc",
    }


def test_every_type_ignore_gives_its_code_and_reason():
    bare = []
    for package in [*PACKAGES, "tests"]:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(("_pb2_grpc.py", "_pb2.py")) or path == Path(__file__):
                continue  # generated, or this test's own pattern
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "type: ignore" in line and not IGNORE_WITH_REASON.search(line):
                    bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not bare, "\n".join(bare)
