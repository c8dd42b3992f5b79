"""``import splitserve``: light (neither the frontend nor torch), and vLLM's top-level API names through it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest


def test_importing_splitserve_imports_neither_the_frontend_nor_torch():
    check = "import splitserve, sys; assert 'torch' not in sys.modules and 'frontend_svc' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_python_api_is_importable_from_splitserve():
    import frontend_svc
    import splitserve
    from splitserve import LLM, CompletionOutput, RequestOutput, SamplingParams

    assert (LLM, SamplingParams, RequestOutput, CompletionOutput) == (
        frontend_svc.LLM,
        frontend_svc.SamplingParams,
        frontend_svc.RequestOutput,
        frontend_svc.CompletionOutput,
    )
    assert splitserve.LLM is frontend_svc.LLM
    assert set(frontend_svc.__all__) <= set(splitserve.__all__)
    assert splitserve.__version__ == importlib.metadata.version("splitserve")
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        splitserve.NoSuchName  # noqa: B018
