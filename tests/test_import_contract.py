"""The import rules of docs/ARCHITECTURE.md hold (``lint-imports`` over ``.importlinter``), the configuration states
the rules we mean, and each contract fails on a copy of the source that breaks it."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("splitserve", "frontend_svc", "core_svc", "kernels", "benchmarks", "tests")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

# contract id -> (file in a copy of the source, an import that breaks that contract, appended to it)
VIOLATIONS = {
    "floors": ("splitserve/base/envs.py", "import splitserve.entrypoints.stack"),
    "frontend": ("frontend_svc/stop_strings.py", "import torch"),
    "core": ("core_svc/request.py", "import frontend_svc.errors"),
    "kernels": ("kernels/__init__.py", "import splitserve.base.envs"),
    "base": ("splitserve/base/tls.py", "import core_svc.errors"),
    "stubs": ("splitserve/stubs/engine/v1/engine_core_pb2_grpc.py", "import splitserve.base.envs"),
    "frontend-clients": ("frontend_svc/core_client.py", "import frontend_svc.grpc_client"),
    "no-tests": ("core_svc/scheduler.py", "import tests.helpers"),
    "acyclic": ("core_svc/block_pool.py", "import core_svc.kv_cache_manager"),
}


def read_contracts(config: Path) -> dict[str, configparser.SectionProxy]:
    parser = configparser.ConfigParser()
    parser.read(config)
    prefix = "importlinter:contract:"
    return {name.removeprefix(prefix): parser[name] for name in parser.sections() if name.startswith(prefix)}


def lines(value: str) -> list[str]:
    return [line.strip() for line in value.strip().splitlines()]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    # A wide console: contract names are not wrapped across lines. The copy's packages come first on the path.
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_are_kept():
    done = lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Contracts: {len(VIOLATIONS)} kept, 0 broken." in done.stdout


def test_the_contracts_state_the_architecture_rules():
    contracts = read_contracts(ROOT / ".importlinter")
    assert set(contracts) == set(VIOLATIONS)
    assert lines(contracts["floors"]["layers"]) == [
        "splitserve.entrypoints : benchmarks",
        "frontend_svc | core_svc",
        "kernels",
        "splitserve.base | splitserve.stubs",
    ]
    frontend = contracts["frontend"]
    assert (lines(frontend["source_modules"]), set(lines(frontend["forbidden_modules"]))) == (
        ["frontend_svc"],
        {"torch", "kernels", "core_svc"},
    )
    # The one edge from the frontend into the core: the in-process client's lazy import.
    assert lines(frontend["ignore_imports"]) == lines(contracts["floors"]["ignore_imports"])
    assert lines(frontend["ignore_imports"]) == ["frontend_svc.inproc_client -> core_svc.inproc"]
    assert lines(contracts["core"]["forbidden_modules"]) == ["frontend_svc"]
    assert {"splitserve", "frontend_svc", "core_svc"} <= set(lines(contracts["kernels"]["forbidden_modules"]))
    base = contracts["base"]
    assert set(lines(base["source_modules"])) == {"splitserve.base", "splitserve.stubs"}
    assert {"frontend_svc", "core_svc", "splitserve.entrypoints"} <= set(lines(base["forbidden_modules"]))
    assert lines(contracts["frontend-clients"]["layers"]) == [
        "core_client_factory",
        "grpc_client | inproc_client",
        "core_client",
    ]
    assert {"splitserve", "frontend_svc", "core_svc", "kernels"} <= set(lines(contracts["acyclic"]["ancestors"]))


def test_each_contract_fails_on_a_source_that_breaks_it(tmp_path):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path)
    for file, statement in VIOLATIONS.values():
        with open(tmp_path / file, "a") as f:
            f.write(f"\n{statement}  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    contracts = read_contracts(tmp_path / ".importlinter")
    for contract_id in VIOLATIONS:
        assert f"{contracts[contract_id]['name']} BROKEN" in done.stdout, contract_id
    assert f"Contracts: 0 kept, {len(VIOLATIONS)} broken." in done.stdout
