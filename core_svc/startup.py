"""Where a core's start goes: the phases ``EngineCore`` times, and the time the process spent before it (the
interpreter and imports, mostly), for the one startup log line."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StartupPhase:
    name: str
    seconds: float
    note: str = ""  # what the phase made, e.g. "12.3 MiB"


@dataclass
class StartupTimes:
    """The engine core's start, phase by phase (``phase``), and the process's age when it began."""

    before_engine_core_s: float | None = field(default_factory=lambda: process_age_s())  # None: unknown (no /proc)
    phases: list[StartupPhase] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[StartupPhase]:
        """Time the block as phase ``name``; set the yielded phase's ``note`` to say what it made."""
        phase = StartupPhase(name, 0.0)
        start = time.perf_counter()
        try:
            yield phase
        finally:
            phase.seconds = time.perf_counter() - start
            self.phases.append(phase)

    @property
    def engine_core_s(self) -> float:
        return sum(phase.seconds for phase in self.phases)

    def summary(self) -> str:
        """One line, e.g. ``engine core ready in 0.47 s (3.52 s since the process started, 3.05 s of it before the
        engine core: interpreter, imports, server setup): model files 0.00 s, kernel 0.00 s, model config 0.38 s,
        weights 0.02 s (4.8 MiB), KV cache 0.07 s (0.250 GiB)``. In-process, the time before the engine core includes
        the frontend's start."""
        parts = ", ".join(f"{p.name} {p.seconds:.2f} s" + (f" ({p.note})" if p.note else "") for p in self.phases)
        if self.before_engine_core_s is None:
            return f"engine core ready in {self.engine_core_s:.2f} s: {parts}"
        total = self.before_engine_core_s + self.engine_core_s
        return (
            f"engine core ready in {self.engine_core_s:.2f} s ({total:.2f} s since the process started, "
            f"{self.before_engine_core_s:.2f} s of it before the engine core: interpreter, imports, server setup): "
            f"{parts}"
        )


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start time in ``/proc/self/stat``, 10 ms resolution);
    None where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text()
        # Fields after the command name, which may hold spaces and ends with ")"; the start time is field 22.
        start_ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
