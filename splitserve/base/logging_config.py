"""Logging for the Python API: splitserve's INFO lines on stderr by default, as vLLM's ``vllm/logger.py``.

The command line configures the root logger itself (``splitserve.entrypoints.cli.main``); this is for a program
that uses ``LLM``, ``LLMEngine`` or ``AsyncLLM`` without configuring logging, where Python would show warnings
only.
"""

from __future__ import annotations

import logging

from splitserve.base import envs

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The top-level packages whose modules log (each module's logger is named after it).
LOGGER_NAMES = ("splitserve", "frontend_svc", "core_svc", "kernels", "benchmarks")


def configure_library_logging() -> None:
    """Give splitserve's loggers a stderr handler at SPLITSERVE_LOG_LEVEL (default INFO), as vLLM configures its
    ``vllm`` logger at import: the model's size and load time, the KV cache size, warnings.

    Does nothing when SPLITSERVE_CONFIGURE_LOGGING=0, when the application has configured logging (the root
    logger has a handler: its configuration decides), or when it has already run. The loggers then do not
    propagate to the root logger, as vLLM's, so a later ``logging.basicConfig`` does not print each line twice.

    Raises:
        ValueError: SPLITSERVE_LOG_LEVEL is not a logging level name.
    """
    if not envs.configure_logging() or logging.getLogger().handlers:
        return
    loggers = [logging.getLogger(name) for name in LOGGER_NAMES]
    if any(logger.handlers for logger in loggers):
        return
    level = envs.log_level()
    handler = logging.StreamHandler()  # sys.stderr
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for logger in loggers:
        logger.setLevel(level)  # ValueError for an unknown name
        logger.addHandler(handler)
        logger.propagate = False
