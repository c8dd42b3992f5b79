"""The CPU kernels' AVX2 sections on a CPU with AVX-512. The suite builds the kernels with ``-march=native``, so an
AVX-512 machine compiles the AVX-512 passes and leaves out the AVX2 ones (``panel_linear``'s second section, the row
quantization's, ``argmax_rows``' and decode attention's AVX2 passes), which only an AVX2-only CPU then runs. Here
the kernel tests run again in a child process against a ``-march=haswell`` build, with the core's routes those of an
AVX2 CPU (``tests/avx2_build_plugin.py``). On an AVX2-only CPU the suite's own build is that one: skipped."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core_svc.cpu_dtype import cpu_flags
from tests.avx2_build_plugin import LOADED_LINE

ROOT = Path(__file__).resolve().parents[1]
# The tests of the kernels with AVX2 sections, and of the one-call decoder over their AVX2 routes.
KERNEL_TESTS = (
    "tests/test_panel_linear.py",
    "tests/test_int8_panel_linear.py",
    "tests/test_sampler.py::test_argmax_equals_torch_argmax_with_ties",
    "tests/test_one_call_decoder.py",
    "tests/test_attention.py::test_paged_attention_matches_dense",
    "tests/test_attention.py::test_decode_kernel_over_many_slots_matches_dense",
    "tests/test_attention.py::test_decode_kernel_with_scores_far_apart_matches_dense",
    "tests/test_attention.py::test_prefill_kernel_over_many_tiles_matches_dense",
)
HASWELL_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2"}  # what -march=haswell code may use (and movbe, lzcnt)


def test_the_kernels_avx2_sections_pass_the_kernel_tests():
    flags = cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or not HASWELL_FLAGS <= flags:
        pytest.skip("this CPU does not run AVX2 (Haswell) code")
    if "avx512f" not in flags:
        pytest.skip("this CPU has no AVX-512: the suite's own build of the kernels is the AVX2 one")
    child = [sys.executable, "-m", "pytest", "-q", "-p", "tests.avx2_build_plugin", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*child, *KERNEL_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    tail = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, tail
    # the binary the child loaded is the AVX2 build: gemv, AVX-512F only, is not in it
    [loaded] = [line for line in result.stdout.splitlines() if line.startswith(LOADED_LINE)]
    assert loaded.endswith("gemv_available=False"), loaded
    # and the tests ran rather than skipped: the panel tests, the argmax cases, the decoder's comparisons, attention
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed is not None and int(passed.group(1)) >= 100, tail
