"""Every ``SPLITSERVE_*`` environment variable splitserve reads, in one place (the standard ``OTEL_*`` ones:
``splitserve/base/tracing.py``)."""

from __future__ import annotations

import os
from pathlib import Path

from splitserve.base.cpu_threads import DEFAULT_WAIT_POLICY


def cache_dir() -> Path:
    """SPLITSERVE_CACHE_DIR, default ~/.cache/splitserve: where the demo model is built, and the compiled kernels
    are kept (``kernel_dir``)."""
    return Path(os.environ.get("SPLITSERVE_CACHE_DIR", Path.home() / ".cache" / "splitserve")).expanduser()


def kernel_dir() -> Path:
    """``$SPLITSERVE_CACHE_DIR/kernels``: the compiled CPU attention kernels (``kernels.attention.cpu_ops``), one
    file per build key."""
    return cache_dir() / "kernels"


def log_level() -> str:
    """SPLITSERVE_LOG_LEVEL, default INFO."""
    return os.environ.get("SPLITSERVE_LOG_LEVEL", "INFO").upper()


def configure_logging() -> bool:
    """SPLITSERVE_CONFIGURE_LOGGING, default 1 (vLLM's VLLM_CONFIGURE_LOGGING): 0 leaves logging alone in the
    Python API, which otherwise prints splitserve's lines at SPLITSERVE_LOG_LEVEL to stderr when the application
    has not configured logging (``splitserve.base.logging_config``)."""
    return os.environ.get("SPLITSERVE_CONFIGURE_LOGGING", "1").strip() != "0"


def log_stats_interval() -> float:
    """SPLITSERVE_LOG_STATS_INTERVAL, default 10: seconds between the frontend's stats log lines (vLLM's
    VLLM_LOG_STATS_INTERVAL); 0 or less turns them off."""
    return float(os.environ.get("SPLITSERVE_LOG_STATS_INTERVAL", "10"))


def engine_ready_timeout_s() -> float:
    """SPLITSERVE_ENGINE_READY_TIMEOUT_S, default 60: seconds ``LLM`` / ``LLMEngine`` / ``AsyncLLM`` with a
    ``core_address`` wait for a core to take requests before they fail (vLLM's VLLM_ENGINE_READY_TIMEOUT_S).

    Raises:
        ValueError: not a number above 0.
    """
    value = os.environ.get("SPLITSERVE_ENGINE_READY_TIMEOUT_S", "60")
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"SPLITSERVE_ENGINE_READY_TIMEOUT_S must be a number of seconds above 0, got {value!r}")
    return seconds


def model() -> str | None:
    """SPLITSERVE_MODEL: the default of ``--model`` (a local folder or hub id); unset: the demo model."""
    return os.environ.get("SPLITSERVE_MODEL") or None


def hosts_file() -> Path | None:
    """SPLITSERVE_HOSTS_FILE: a hosts(5) file the frontend reads before DNS when it resolves ``dns:///`` core
    addresses, read again at every refresh (what compose's ``extra_hosts`` does, for a process)."""
    value = os.environ.get("SPLITSERVE_HOSTS_FILE")
    return Path(value) if value else None


def tokenizers_dir() -> Path | None:
    """SPLITSERVE_TOKENIZERS_DIR: a folder of real tokenizers (llama2, gpt2) for the benchmarks and tests."""
    value = os.environ.get("SPLITSERVE_TOKENIZERS_DIR")
    return Path(value) if value else None


def api_key() -> str | None:
    """SPLITSERVE_API_KEY: the default of a frontend's ``--api-key`` (vLLM's VLLM_API_KEY). An environment variable
    (from a Kubernetes Secret, say) keeps the key out of the process list, where a flag's value shows."""
    return os.environ.get("SPLITSERVE_API_KEY")  # set but empty is an error, not "no key" (``api_key.check_api_key``)


def omp_wait_policy() -> str:
    """SPLITSERVE_OMP_WAIT_POLICY, default short-spin: how the core's OpenMP threads wait between parallel regions
    (``splitserve.base.cpu_threads``), unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT. short-spin: a spin of
    3,000 pause loops (some 5 to 150 us by CPU), then sleep; passive: sleep at once; runtime: the OpenMP runtime's
    own default (spinning for milliseconds), to compare against."""
    return os.environ.get("SPLITSERVE_OMP_WAIT_POLICY", DEFAULT_WAIT_POLICY).strip().lower() or DEFAULT_WAIT_POLICY


def cpu_omp_threads_bind() -> str:
    """SPLITSERVE_CPU_OMP_THREADS_BIND, default nobind (vLLM's VLLM_CPU_OMP_THREADS_BIND): the default of a core's
    ``--cpu-omp-threads-bind``. A CPU list (``0-3``), ``auto`` or ``all`` pins the core to those CPUs with one
    OpenMP thread on each; nobind leaves placement to the kernel (``splitserve.base.cpu_threads``)."""
    return os.environ.get("SPLITSERVE_CPU_OMP_THREADS_BIND", "nobind").strip() or "nobind"
