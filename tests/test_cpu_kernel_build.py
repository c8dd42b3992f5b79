"""The CPU kernel's build (``kernels.attention.cpu_ops``): found by its key whatever PATH says, atomic when killed,
once for concurrent processes, and a compiler's error reported with its output.

One real compile for the module (the ``killed_then_built`` fixture: a build killed half-way, then two processes
at once in the same folder); the failure cases use a fake compiler and compile nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernels.attention import cpu_ops

ROOT = Path(__file__).resolve().parents[1]
# A fresh process that loads the kernel from the folder argv[1] and prints the binary's path; logs on stderr.
LOAD_SCRIPT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
from kernels.attention import cpu_ops
print(cpu_ops.load(Path(sys.argv[1])))
"""
COMPILING = "compiling the CPU attention kernel"
LOADED = "loaded the CPU attention kernel from"


def start_loader(build_dir: Path, path_variable: str | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if path_variable is not None:
        env["PATH"] = path_variable
    return subprocess.Popen(
        [sys.executable, "-c", LOAD_SCRIPT, str(build_dir)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: killing it kills its compiler too, as Ctrl-C would
    )


@dataclass
class BuildRun:
    build_dir: Path
    library: Path  # the binary the build made
    files_after_kill: list[str]  # the folder's content once the first build was killed
    stale_temp: Path  # a temporary file left as by a killed build whose compiler went on writing
    logs: list[str]  # stderr of the two concurrent loaders
    printed: list[str]  # what each printed: the path it loaded


@pytest.fixture(scope="module")
def killed_then_built(tmp_path_factory: pytest.TempPathFactory) -> BuildRun:
    build_dir = tmp_path_factory.mktemp("kernels")
    killed = start_loader(build_dir)
    assert killed.stderr is not None
    line = ""
    while COMPILING not in line:
        line = killed.stderr.readline()
        assert line, f"the loader ended without compiling: {killed.communicate()}"
    library = Path(line.rsplit(": ", 1)[1].strip())
    time.sleep(1.0)  # the compiler is running
    os.killpg(killed.pid, signal.SIGKILL)
    killed.communicate()
    files_after_kill = sorted(p.name for p in build_dir.iterdir())
    stale_temp = build_dir / f".{library.name}.999999.tmp"
    stale_temp.write_bytes(b"half a binary")

    loaders = [start_loader(build_dir) for _ in range(2)]
    results = [loader.communicate(timeout=900) for loader in loaders]
    for loader, (_, err) in zip(loaders, results, strict=True):
        assert loader.returncode == 0, err
    return BuildRun(
        build_dir,
        library,
        files_after_kill,
        stale_temp,
        [err for _, err in results],
        [out.strip() for out, _ in results],
    )


def test_a_killed_build_leaves_nothing_to_load(killed_then_built):
    run = killed_then_built
    # Only the lock file, or a temporary file too: never the binary's name, which is all a load looks for.
    assert run.library.name not in run.files_after_kill
    assert all(name.endswith(".lock") or name.endswith(".tmp") for name in run.files_after_kill)


def test_concurrent_processes_compile_once_and_both_load(killed_then_built):
    run = killed_then_built
    assert sum(log.count(COMPILING) for log in run.logs) == 1
    assert sum(log.count("compiled the CPU attention kernel in") for log in run.logs) == 1
    assert sum("waiting for another process's build" in log for log in run.logs) == 1
    for log, printed in zip(run.logs, run.printed, strict=True):
        assert printed == str(run.library)
        assert f"{LOADED} {run.library}" in log
    # The build after the killed one succeeded and removed its leftovers: one binary, its lock, nothing else.
    assert not run.stale_temp.exists()
    assert sorted(p.name for p in run.build_dir.iterdir()) == sorted(
        [run.library.name, run.library.with_suffix(".lock").name]
    )


@pytest.mark.parametrize("path_kind", ["venv_activated", "no_venv_no_ninja"])
def test_a_load_with_another_path_finds_the_build(killed_then_built, tmp_path, path_kind):
    """What rebuilt torch's JIT extension in turn: the same build loaded with and without the virtualenv's bin
    (the ninja wheel) on PATH. Here the binary is found by its key and not touched."""
    run = killed_then_built
    if path_kind == "venv_activated":
        path_variable = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    else:  # a PATH with the compiler and nothing else: no ninja, no virtualenv
        compiler = tmp_path / "bin" / "c++"
        compiler.parent.mkdir()
        compiler.symlink_to(os.path.realpath(subprocess.check_output(["which", "c++"], text=True).strip()))
        path_variable = str(compiler.parent)
    mtime_ns = run.library.stat().st_mtime_ns
    loader = start_loader(run.build_dir, path_variable)
    out, err = loader.communicate(timeout=120)
    assert loader.returncode == 0, err
    assert out.strip() == str(run.library)
    assert f"{LOADED} {run.library}" in err and COMPILING not in err
    assert run.library.stat().st_mtime_ns == mtime_ns
    assert len(list(run.build_dir.glob("*.so"))) == 1


def write_fake_compiler(path: Path, body: str, version: str = "1.0") -> Path:
    """An executable that answers --version and otherwise runs ``body`` (sh)."""
    path.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake c++ {version}"; exit 0; fi\n{body}\n')
    path.chmod(0o755)
    return path


def test_a_compile_error_is_reported_with_the_compilers_last_lines(tmp_path, monkeypatch):
    compiler = write_fake_compiler(
        tmp_path / "fake-c++", 'echo "paged_attention_cpu.cpp:7:1: error: expected declaration" >&2; exit 1'
    )
    monkeypatch.setenv("CXX", str(compiler))
    build_dir = tmp_path / "kernels"
    with pytest.raises(cpu_ops.KernelBuildError) as caught:
        cpu_ops.build(build_dir)
    error = caught.value
    assert error.reason.startswith("compiling paged_attention_cpu.cpp failed (exit 1)")  # the first source's
    assert "error: expected declaration" in error.reason
    assert f"command: {compiler} -O3" in error.details and "error: expected declaration" in error.details
    # Nothing half-made is left: only the lock file.
    assert [p.name for p in build_dir.iterdir()] == [next(build_dir.glob("*.lock")).name]


# A compiler that fails when its arguments hold FAILS_ON and otherwise writes an empty file where -o points.
SELECTIVE_COMPILER = """case "$*" in *FAILS_ON*) echo "broken" >&2; exit 2;; esac
out=""; prev=""; for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done; : > "$out"
"""


@pytest.mark.parametrize(
    ("fails_on", "reason"),
    [
        ("layer_ops_cpu.cpp", "compiling layer_ops_cpu.cpp failed (exit 2)"),
        ("-lc10", "linking paged_attention_cpu.cpp"),
    ],
)
def test_one_failing_step_is_named_and_nothing_is_left(tmp_path, monkeypatch, fails_on, reason):
    """Each source compiles on its own and then they link: a failure names its step, and the objects the other
    steps wrote are removed with it."""
    compiler = write_fake_compiler(tmp_path / "fake-c++", SELECTIVE_COMPILER.replace("FAILS_ON", fails_on))
    monkeypatch.setenv("CXX", str(compiler))
    build_dir = tmp_path / "kernels"
    with pytest.raises(cpu_ops.KernelBuildError) as caught:
        cpu_ops.build(build_dir)
    assert caught.value.reason.startswith(reason)
    assert [p.name for p in build_dir.iterdir()] == [next(build_dir.glob("*.lock")).name]


def test_without_a_compiler_the_error_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(cpu_ops.KernelBuildError, match="no C\\+\\+ compiler: CXX='/nonexistent/c\\+\\+'"):
        cpu_ops.load(tmp_path / "kernels")
    assert not (tmp_path / "kernels").exists()


def test_the_key_changes_with_the_compiler(tmp_path, monkeypatch):
    """Another compiler (or version) makes another binary, kept beside the first: no rebuilds in turn."""
    names = []
    for version in ("1.0", "2.0"):
        compiler = write_fake_compiler(
            tmp_path / f"fake-c++-{version}", 'while [ "$1" != "-o" ]; do shift; done; echo binary > "$2"', version
        )
        monkeypatch.setenv("CXX", str(compiler))
        path, compiled = cpu_ops.build(tmp_path / "kernels")
        assert compiled and path.read_text() == "binary\n"
        assert cpu_ops.build(tmp_path / "kernels") == (path, False)
        names.append(path.name)
    assert names[0] != names[1]
    assert sorted(p.name for p in (tmp_path / "kernels").glob("*.so")) == sorted(names)


def test_loading_the_library_keeps_subnormal_floats():
    """GCC links crtfastmath.o into the -ffast-math library, whose constructor turns on flush-to-zero for the
    loading thread; the load turns it back off (in a fresh process: no other test's load before it)."""
    child = (
        "import torch\n"
        "from kernels.attention import cpu_ops\n"
        "from splitserve.base import envs\n"
        "before = float(torch.tensor(1e-39) * 1.0)\n"
        "cpu_ops.load(envs.kernel_dir())\n"
        "print(before, float(torch.tensor(1e-39) * 1.0))\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600)
    if result.returncode != 0 and "KernelBuildError" in result.stderr:
        pytest.skip("the CPU kernels cannot be built here")
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = (float(v) for v in result.stdout.split())
    assert before == after > 0.0
