"""The core's admin RPCs (``ResetPrefixCache``, ``StartProfile``, ``StopProfile``, ``Sleep``, ``WakeUp``): off
unless the core runs with ``--enable-admin-rpcs``, and profiles written only under one directory (``--profile-dir``).

A core's port is for frontends: anything that reaches it can add requests, so the calls that change the engine's
state for everyone (dropping the prefix cache; putting the core to sleep, which ends every request in it and
refuses the next ones) or write files (a profile, where the caller says) are off by default, as vLLM serves its
``/reset_prefix_cache``, ``/sleep`` and ``/wake_up`` routes only in its dev mode and ``/start_profile`` with a
profiler configured. ``IsSleeping`` changes nothing and is always on.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from core_svc.errors import InvalidRequestError

ENABLE_FLAG = "--enable-admin-rpcs"


@dataclass(frozen=True)
class AdminPolicy:
    """Whether the admin RPCs are on, and the one directory profiles go under.

    Raises:
        ValueError: from the constructor, when they are on without a ``profile_dir`` (``enabled_with`` makes one).
    """

    enabled: bool = False
    profile_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.enabled and self.profile_dir is None:
            raise ValueError("the admin RPCs need a profile directory")

    @classmethod
    def enabled_with(cls, profile_dir: str | Path | None) -> AdminPolicy:
        """Admin RPCs on, profiles under ``profile_dir`` (made if missing), or, when it is None, under a new private
        temporary directory (mode 0700, ``tempfile.mkdtemp``)."""
        if profile_dir is None:
            return cls(True, Path(tempfile.mkdtemp(prefix="splitserve-profiles-")))
        path = Path(profile_dir).expanduser()
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return cls(True, path)

    def profile_output_dir(self, output_dir: str) -> Path:
        """Where a ``StartProfile(output_dir)`` writes: ``output_dir`` taken relative to ``profile_dir`` (empty: the
        directory itself; an absolute path must lie inside it), with symbolic links resolved.

        Raises:
            InvalidRequestError: ``output_dir`` has a ``..`` part, or resolves (through a link too) outside
                ``profile_dir``.
        """
        if self.profile_dir is None:
            raise ValueError("the admin RPCs are off")
        if "\x00" in output_dir:
            raise InvalidRequestError("output_dir", "must not contain a NUL character")
        requested = Path(output_dir)
        if ".." in requested.parts:
            raise InvalidRequestError("output_dir", f"{output_dir!r} must not contain '..'")
        root = self.profile_dir.resolve()
        target = (root / requested).resolve()  # an absolute output_dir replaces root here, and is checked as such
        if not target.is_relative_to(root):
            raise InvalidRequestError(
                "output_dir", f"{output_dir!r} is outside the core's profile directory {root} (--profile-dir)"
            )
        return target


def disabled_message(method: str) -> str:
    return f"{method} is an admin RPC, off on this engine core; start it with {ENABLE_FLAG} to allow it"
