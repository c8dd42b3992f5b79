"""A pytest plugin (``-p tests.avx2_build_plugin``) that holds the CPU kernels to AVX2 on a CPU that has more: the
kernels built with ``-march=haswell`` (their AVX2 sections, which a ``-march=native`` build on an AVX-512 CPU leaves
out), and the core told the CPU lists only AVX2-era flags, so that the Python side picks the routes an AVX2 CPU
takes (the int8 panels, float32 in place of bfloat16). ``tests/test_avx2_kernels.py`` runs kernel tests under it in
a child process; at the end it prints the loaded binary's path and whether it has the AVX-512-only ``gemv``."""

from __future__ import annotations

from typing import Any

import pytest

import core_svc.cpu_dtype
import core_svc.engine_core
import core_svc.models.quantization
from kernels.attention import cpu_ops

AVX2_FLAGS = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 popcnt".split())
LOADED_LINE = "AVX2 build loaded:"


def _avx2_flags(*args: Any, **kwargs: Any) -> frozenset[str]:
    return AVX2_FLAGS


def pytest_configure(config: pytest.Config) -> None:
    """The patches, for this process only, and only where this module is loaded as a plugin (importing it for
    ``LOADED_LINE`` changes nothing)."""
    for module in (core_svc.cpu_dtype, core_svc.engine_core, core_svc.models.quantization):
        module.cpu_flags = _avx2_flags
    cpu_ops._CFLAGS = [flag.replace("-march=native", "-march=haswell") for flag in cpu_ops._CFLAGS]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import torch

    from splitserve.base import envs

    path = cpu_ops.load(envs.kernel_dir())
    print(f"\n{LOADED_LINE} {path} gemv_available={torch.ops.splitserve_cpu.gemv_available(torch.float32)}")
