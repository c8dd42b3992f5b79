"""How many CPU threads the core computes with, and how its OpenMP threads wait between parallel regions.

Threads: the cores this process may use, which on a shared host or in a container is not ``os.cpu_count()`` (the
host's count). It is the smaller of the CPU affinity (``os.sched_getaffinity``: taskset, cpusets, Kubernetes'
static CPU manager) and the cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``:
Docker's ``--cpus``, Kubernetes' CPU limit), rounded down and at least 1. Rounded down because the threads of one
OpenMP region finish together: with a quota of 1.5 cores, two threads exhaust it two thirds into each period and
both wait out the rest (CFS throttling), while one thread never is throttled (as Go's automaxprocs rounds down).
``--num-threads`` (``CoreConfig.num_threads``) overrides it, then ``OMP_NUM_THREADS``.

Wait policy: by default an OpenMP runtime keeps the threads of a finished region spinning for a while (GNU
libgomp: 300,000 spins, about 3 ms; Intel's: ``KMP_BLOCKTIME`` 200 ms) so the next region starts without a
wake-up. On cores that another process also wants, the spinning threads take the time that process (or this
process's own other threads) needed, and a step stretches from tens to hundreds of milliseconds (issue 18: 790 ms
against 83 ms per batch-1 step under one competing process). Passive waiting (``OMP_WAIT_POLICY=PASSIVE``: no spin
at all) fixes that, but then every parallel region wakes its worker thread from a futex sleep, tens of
microseconds each, and a decode step runs some sixty regions: a 64-row decode step of ``small`` on two threads took
23.4 ms passive against 19.6 ms with a short spin (docs/benchmarks.md, "A short spin between parallel regions").
So the core's default, ``short-spin``, is both: ``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=3000`` (libgomp,
torch's runtime in its pip wheels: 3,000 ``pause`` loops, 32 us on the Xeon measured, 5-150 us by CPU, then sleep;
libgomp's spin count wins over the policy, except where it runs more threads than the CPUs it may use, when the
passive policy's spin of 0 applies; Intel's runtime, which ignores it, waits passively). That covers the gap between
one region and the next (a few microseconds of serial code and the threads' uneven finish) and wastes at most
that much of a core another process wants. The runtime reads these once, when it is loaded: when torch is first
imported. ``prepare_openmp_env`` therefore runs in the command line's ``main`` before any subcommand imports
torch. A variable the user set wins; ``SPLITSERVE_OMP_WAIT_POLICY`` ``passive`` waits with no spin, ``runtime``
keeps the runtime's own default (for comparison: ``splitserve bench throughput --contend``).

Binding (``SPLITSERVE_CPU_OMP_THREADS_BIND`` or ``--cpu-omp-threads-bind``, as vLLM's CPU backend's
``VLLM_CPU_OMP_THREADS_BIND``): ``nobind`` (the default) leaves placement to the kernel's scheduler; a CPU list
(``0-3,6``), ``auto`` (the first ``usable_cores`` CPUs of the affinity mask) or ``all`` (every CPU of the mask)
pins the process to those CPUs (``os.sched_setaffinity`` on each of its threads) and gives it one OpenMP thread per
CPU, each worker thread on its own CPU: ``OMP_PLACES={0},{1},...`` with ``OMP_PROC_BIND=close`` (OpenMP 4.0, read
by libgomp and Intel's runtime when they are loaded), set with the wait policy before torch is imported. A runtime
binding binds the thread that loads it to the first place, and the threads it creates inherit that one CPU, so
once torch is loaded ``pin_threads`` gives every thread of the process the whole list again
(``core_svc.device.set_compute_threads``); each parallel region's worker threads are then bound by the runtime.

This module imports nothing heavy: the command line calls it before torch is loaded.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")

# What SPLITSERVE_OMP_WAIT_POLICY may say: short-spin (the default), passive, or runtime (the OpenMP runtime's own).
WAIT_POLICIES = ("short-spin", "passive", "runtime")
DEFAULT_WAIT_POLICY = "short-spin"
# short-spin's libgomp spin count: 3,000 pause loops, 32 us on a Sapphire Rapids Xeon (10.7 ns each, measured), as
# fast as spinning for the ~60 parallel regions of a 64-row decode step on two threads, where 1,000 lost a third of
# that gain (docs/benchmarks.md, "A short spin between parallel regions"). A pause takes about 10 to 140 cycles
# depending on the CPU, so the spin lasts some 5 to 150 us.
SHORT_SPIN_COUNT = 3000
# The variables libgomp (torch's runtime in its pip wheels) waits by: a user who set either chose the policy.
# KMP_BLOCKTIME, Intel's and LLVM's, is not among them: libgomp ignores it, and those runtimes read it over a
# passive policy, so a user's KMP_BLOCKTIME stands beside the policy set here.
GOMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# What the startup log names of the wait: libgomp's variables and Intel's.
WAIT_VARIABLES = (*GOMP_WAIT_VARIABLES, "KMP_BLOCKTIME")
PROC_SELF_TASK = Path("/proc/self/task")
# SPLITSERVE_CPU_OMP_THREADS_BIND's words besides a CPU list (vLLM's VLLM_CPU_OMP_THREADS_BIND: auto, nobind).
BIND_WORDS = ("nobind", "auto", "all")
# The OpenMP variables a binding sets; a binding is refused when the user set any of them (or GOMP_CPU_AFFINITY).
OMP_BIND_VARIABLES = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


@dataclass(frozen=True)
class CpuQuota:
    """A cgroup's CPU bandwidth limit: ``quota_us`` of CPU time per ``period_us`` of wall time."""

    quota_us: int
    period_us: int
    source: str  # the file it was read from

    @property
    def cores(self) -> float:
        return self.quota_us / self.period_us


def _cgroup_paths(proc_self_cgroup: Path) -> tuple[str | None, dict[str, str]]:
    """This process's cgroup v2 path (the ``0::`` line) and its v1 paths by controller (``cpu`` -> ``/docker/x``)."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None, {}
    v2: str | None = None
    v1: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        for controller in controllers.split(","):
            if controller:
                v1[controller] = path
    return v2, v1


def _ancestors(root: Path, path: str) -> list[Path]:
    """``root/a/b``, ``root/a``, ``root`` for ``/a/b``: a quota anywhere above the process's cgroup applies too. In a
    container the process's path often names the host's hierarchy, not the namespace's, so the folders that do
    not exist are skipped and ``root`` (the container's own cgroup, as mounted) is always looked at."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read_v2(folder: Path) -> CpuQuota | None:
    """``cpu.max``: ``"$MAX $PERIOD"``, ``max`` for no limit."""
    try:
        fields = (folder / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    return CpuQuota(int(fields[0]), int(fields[1]), str(folder / "cpu.max"))


def _read_v1(folder: Path) -> CpuQuota | None:
    """``cpu.cfs_quota_us`` (-1 for no limit) over ``cpu.cfs_period_us``."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text().strip())
        period = int((folder / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return CpuQuota(quota, period, str(folder / "cpu.cfs_quota_us"))


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> CpuQuota | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, v2 (``root/<path>/cpu.max``) or v1
    (``root/cpu,cpuacct/<path>/cpu.cfs_quota_us``, or under ``root/cpu``); None when there is none, or no cgroup
    file can be read (not Linux)."""
    v2_path, v1_paths = _cgroup_paths(proc_self_cgroup)
    found: list[CpuQuota] = []
    if v2_path is not None:
        found += [q for folder in _ancestors(root, v2_path) if (q := _read_v2(folder)) is not None]
    if "cpu" in v1_paths:
        for mount in ("cpu,cpuacct", "cpuacct,cpu", "cpu"):
            if (root / mount).is_dir():
                folders = _ancestors(root / mount, v1_paths["cpu"])
                found += [q for folder in folders if (q := _read_v1(folder)) is not None]
                break
    return min(found, key=lambda q: q.cores, default=None)


def affinity_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where there is no such call)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadChoice:
    """The core's compute threads and why."""

    num_threads: int
    reason: str  # e.g. "--num-threads 1", "2 CPUs in the affinity mask, cgroup quota 1.00 CPUs (cpu.max)"


def usable_cores(num_affinity_cpus: int, quota: CpuQuota | None) -> int:
    """The cores this process may keep busy: the affinity count, capped by the quota rounded down, at least 1."""
    if quota is None:
        return max(1, num_affinity_cpus)
    return max(1, min(num_affinity_cpus, math.floor(quota.cores)))


def choose_threads(
    num_threads: int | None,
    environ: MutableMapping[str, str],
    num_affinity_cpus: int,
    quota: CpuQuota | None,
) -> ThreadChoice:
    """``num_threads`` when given (``--num-threads``), else a valid ``OMP_NUM_THREADS``, else ``usable_cores``.

    Raises:
        ValueError: ``num_threads`` below 1.
    """
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {num_threads}")
        return ThreadChoice(num_threads, f"--num-threads {num_threads}")
    value = environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) >= 1:
        return ThreadChoice(int(value), f"OMP_NUM_THREADS={value}")
    cores = usable_cores(num_affinity_cpus, quota)
    quota_text = "no cgroup CPU quota" if quota is None else f"cgroup quota {quota.cores:.2f} CPUs ({quota.source})"
    return ThreadChoice(cores, f"{num_affinity_cpus} CPUs in the affinity mask, {quota_text}")


def detect_threads(num_threads: int | None = None) -> ThreadChoice:
    """``choose_threads`` for this process: its environment, affinity and cgroup quota."""
    return choose_threads(num_threads, os.environ, affinity_cpus(), cgroup_cpu_quota())


def prepare_openmp_env(environ: MutableMapping[str, str], policy: str, torch_loaded: bool) -> str:
    """Set the wait policy ``policy`` (one of ``WAIT_POLICIES``) in ``environ`` unless the user set one of
    ``GOMP_WAIT_VARIABLES`` or ``policy`` is ``runtime``; returns the policy in words, for the startup log.
    ``short-spin``: ``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=SHORT_SPIN_COUNT``; ``passive``:
    ``OMP_WAIT_POLICY=PASSIVE`` alone. ``torch_loaded``: torch (and so its OpenMP runtime) was imported before, so
    a variable set now would not be read: none is set, and the words say why.

    Raises:
        ValueError: ``policy`` not one of ``WAIT_POLICIES``.
    """
    if policy not in WAIT_POLICIES:
        raise ValueError(f"SPLITSERVE_OMP_WAIT_POLICY must be one of {', '.join(WAIT_POLICIES)}, got {policy!r}")
    if any(name in environ for name in GOMP_WAIT_VARIABLES):
        return f"{wait_policy_text(environ)} (set by the user)"
    if policy == "runtime":
        return "the OpenMP runtime's default (spinning; SPLITSERVE_OMP_WAIT_POLICY=runtime)"
    if torch_loaded:  # the runtime has read its environment: setting it now would only mislead the logs
        return f"the OpenMP runtime's default: torch was imported before splitserve could set its {policy} policy"
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if policy == "passive":
        return "OMP_WAIT_POLICY=PASSIVE (set by splitserve: waiting threads sleep rather than spin)"
    environ["GOMP_SPINCOUNT"] = str(SHORT_SPIN_COUNT)
    return (
        f"{wait_policy_text(environ)} (set by splitserve: a waiting thread spins {SHORT_SPIN_COUNT} pause loops, "
        "some 5 to 150 microseconds by CPU, then sleeps)"
    )


def wait_policy_text(environ: MutableMapping[str, str]) -> str:
    """The wait policy this process's OpenMP runtime was given, from its environment, for the startup log."""
    given = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    return ", ".join(given) if given else "the OpenMP runtime's default (spinning)"


def parse_cpu_list(text: str) -> list[int]:
    """The CPUs of a Linux CPU list (``0-3,6``, the syntax of taskset and ``Cpus_allowed_list``), ascending.

    Raises:
        ValueError: empty, a part that is not ``N`` or ``N-M`` with ``N <= M``, or a CPU named twice.
    """
    cpus: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,6")
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise ValueError(f"{text!r} is not a CPU list: the range {part.strip()} runs backwards")
        cpus.extend(range(low, high + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{text!r} names a CPU twice")
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 6]`` -> ``0-2,6``."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def check_bind(value: str, source: str) -> None:
    """Refuse a binding that is neither one of ``BIND_WORDS`` nor a CPU list, whatever the CPUs.

    Raises:
        ValueError: naming ``source`` (the variable or flag it came from).
    """
    if value.strip().lower() not in BIND_WORDS:
        try:
            parse_cpu_list(value)
        except ValueError as e:
            raise ValueError(f"{source}: {e}; or one of {', '.join(BIND_WORDS)}") from None


def bind_cpus(value: str, allowed: set[int], quota: CpuQuota | None, source: str) -> list[int] | None:
    """The CPUs a binding ``value`` pins the process and its OpenMP threads to, one thread each, from the CPUs the
    process may run on (``allowed``, its affinity mask) and its cgroup ``quota``: None for ``nobind``; ``auto``:
    the first ``usable_cores`` CPUs of ``allowed``; ``all``: all of them; else the CPU list.

    Raises:
        ValueError: naming ``source``: not a word or CPU list, or a CPU outside ``allowed``.
    """
    word = value.strip().lower()
    check_bind(value, source)
    if word == "nobind":
        return None
    ordered = sorted(allowed)
    if word == "auto":
        return ordered[: usable_cores(len(ordered), quota)]
    if word == "all":
        return ordered
    cpus = parse_cpu_list(value)
    outside = [cpu for cpu in cpus if cpu not in allowed]
    if outside:
        raise ValueError(
            f"{source}={value}: CPU {format_cpu_list(outside)} is not one this process may run on "
            f"(its affinity mask: {format_cpu_list(ordered)})"
        )
    return cpus


def omp_bind_env(cpus: list[int]) -> dict[str, str]:
    """The OpenMP variables that bind one thread to each of ``cpus``: ``OMP_PLACES`` (one place per CPU),
    ``OMP_PROC_BIND=close`` (thread i of a team on place i) and ``OMP_NUM_THREADS``."""
    return {
        "OMP_PLACES": ",".join(f"{{{cpu}}}" for cpu in cpus),
        "OMP_PROC_BIND": "close",
        "OMP_NUM_THREADS": str(len(cpus)),
    }


def places_cpus(environ: MutableMapping[str, str]) -> list[int] | None:
    """The CPUs of an ``OMP_PLACES`` that ``omp_bind_env`` wrote (``{0},{1}``: one CPU per place), else None. Once
    torch is loaded, the calling thread's affinity is the first place only: this is the list that was bound."""
    places = environ.get("OMP_PLACES", "")
    parts = places.split(",")
    if not places or not all(p.startswith("{") and p.endswith("}") and p[1:-1].isdigit() for p in parts):
        return None
    return [int(p[1:-1]) for p in parts]


def allowed_cpus(environ: MutableMapping[str, str]) -> set[int]:
    """The CPUs this process may run on: the calling thread's affinity mask, and the CPUs of a binding prepared
    before torch loaded (``places_cpus``: the OpenMP runtime has since bound the loading thread to the first)."""
    mask = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    return mask | set(places_cpus(environ) or [])


def thread_ids(task_dir: Path = PROC_SELF_TASK) -> list[int]:
    """The ids of this process's threads (Linux ``/proc/self/task``); empty where there is no such folder."""
    try:
        return sorted(int(entry.name) for entry in task_dir.iterdir() if entry.name.isdigit())
    except OSError:
        return []


def pin_threads(cpus: list[int]) -> None:
    """Let every thread of this process run on ``cpus`` only (``os.sched_setaffinity`` per thread id; threads
    created later inherit their creator's). A thread that ended meanwhile is skipped.

    Raises:
        OSError: the kernel refused the mask (e.g. a CPU outside the process's cpuset).
    """
    for tid in thread_ids() or [0]:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue


def prepare_binding(environ: MutableMapping[str, str], cpus: list[int] | None, torch_loaded: bool) -> str:
    """Pin this process to ``cpus`` and set ``omp_bind_env(cpus)`` in ``environ`` (call it before torch is
    imported: the OpenMP runtime reads them once, when it is loaded); returns the binding in words, for the startup
    log. None: nothing is done. Where torch was imported before, the process is pinned but its threads are not
    bound one per CPU, and the words say so. Called again with the same CPUs (the command line, then the
    in-process core), it finds its own variables and changes nothing.

    Raises:
        ValueError: the user set one of ``OMP_BIND_VARIABLES`` as well (two bindings; keep one).
    """
    if cpus is None:
        return "not bound (nobind)"
    wanted = omp_bind_env(cpus)
    if all(environ.get(name) == value for name, value in wanted.items()):  # prepared before (the command line)
        return f"one OpenMP thread per CPU of {format_cpu_list(cpus)}"
    conflicting = [name for name in OMP_BIND_VARIABLES if name in environ]
    if conflicting:
        raise ValueError(
            f"SPLITSERVE_CPU_OMP_THREADS_BIND / --cpu-omp-threads-bind binds the threads, and {conflicting[0]} is "
            "set as well: unset one of them"
        )
    if hasattr(os, "sched_setaffinity"):
        pin_threads(cpus)
    if torch_loaded:
        return f"process pinned to CPUs {format_cpu_list(cpus)}; threads not bound: torch was imported before"
    environ.update(wanted)
    return f"one OpenMP thread per CPU of {format_cpu_list(cpus)}"


def prepare_process(policy: str, bind: str = "nobind", bind_source: str = "SPLITSERVE_CPU_OMP_THREADS_BIND") -> str:
    """``prepare_openmp_env`` and ``prepare_binding`` for this process (call it before importing torch): the
    wait policy and the binding ``bind`` (from ``bind_source``, named in errors) in words.

    Raises:
        ValueError: a policy or binding that is refused.
    """
    torch_loaded = "torch" in sys.modules
    policy_text = prepare_openmp_env(os.environ, policy, torch_loaded)
    cpus = bind_cpus(bind, allowed_cpus(os.environ), cgroup_cpu_quota(), bind_source)
    return f"{policy_text}; binding: {prepare_binding(os.environ, cpus, torch_loaded)}"
