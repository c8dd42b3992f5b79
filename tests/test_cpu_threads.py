"""The core's thread count (CPU affinity, cgroup CPU quota, ``--num-threads``, ``OMP_NUM_THREADS``) and OpenMP wait
policy (``splitserve.base.cpu_threads``), on fake cgroup trees; then a real ``splitserve generate`` process."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from splitserve.base.cpu_threads import (
    SHORT_SPIN_COUNT,
    CpuQuota,
    bind_cpus,
    cgroup_cpu_quota,
    choose_threads,
    format_cpu_list,
    omp_bind_env,
    parse_cpu_list,
    prepare_binding,
    prepare_openmp_env,
    usable_cores,
)


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_cgroup(tmp_path: Path, proc_self_cgroup: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    for relative, text in files.items():
        write(root / relative, text)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(proc_self_cgroup)
    return root, proc


def test_v2_quota_of_the_process_cgroup(tmp_path):
    # Docker --cpus=1.5: 150000 us per 100000 us period; the parent has no limit.
    root, proc = fake_cgroup(
        tmp_path,
        "0::/kubepods/pod1/c1\n",
        {"kubepods/pod1/c1/cpu.max": "150000 100000\n", "kubepods/cpu.max": "max 100000\n"},
    )
    quota = cgroup_cpu_quota(root, proc)
    assert quota == CpuQuota(150000, 100000, str(root / "kubepods/pod1/c1/cpu.max"))
    assert quota.cores == 1.5
    # 1.5 cores rounds down to 1 thread (two would be throttled a third of each period), whatever the affinity.
    assert usable_cores(4, quota) == 1
    assert usable_cores(1, quota) == 1


def test_v2_tightest_quota_of_the_ancestors_wins(tmp_path):
    # The container may burst to 3 cores but its pod is capped at 2: 2 threads.
    root, proc = fake_cgroup(
        tmp_path,
        "0::/pod/ctr\n",
        {"pod/ctr/cpu.max": "300000 100000\n", "pod/cpu.max": "200000 100000\n", "cpu.max": "max 100000\n"},
    )
    quota = cgroup_cpu_quota(root, proc)
    assert quota is not None and quota.cores == 2.0 and quota.source == str(root / "pod/cpu.max")
    assert usable_cores(8, quota) == 2
    assert usable_cores(1, quota) == 1  # the affinity mask is tighter than the quota


def test_v2_in_a_container_whose_path_names_the_host_hierarchy(tmp_path):
    # Inside a cgroup namespace the line may name a host path that is not mounted: the mount's root is the cgroup.
    root, proc = fake_cgroup(tmp_path, "0::/system.slice/docker-abc.scope\n", {"cpu.max": "250000 50000\n"})
    quota = cgroup_cpu_quota(root, proc)
    assert quota is not None and quota.cores == 5.0
    assert usable_cores(16, quota) == 5


def test_no_quota(tmp_path):
    root, proc = fake_cgroup(tmp_path, "0::/\n", {"cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root, proc) is None
    assert usable_cores(2, None) == 2
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path / "absent-proc") is None


def test_v1_cfs_quota(tmp_path):
    root, proc = fake_cgroup(
        tmp_path,
        "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n",
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
            "cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    quota = cgroup_cpu_quota(root, proc)
    assert quota == CpuQuota(50000, 100000, str(root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us"))
    assert usable_cores(2, quota) == 1  # half a core: still one thread


def test_v1_without_a_quota(tmp_path):
    root, proc = fake_cgroup(
        tmp_path,
        "4:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
    )
    assert cgroup_cpu_quota(root, proc) is None


def test_choose_threads_order_flag_then_omp_num_threads_then_cores():
    quota = CpuQuota(300000, 100000, "cpu.max")
    assert choose_threads(3, {"OMP_NUM_THREADS": "5"}, 8, quota).num_threads == 3
    assert choose_threads(3, {}, 8, quota).reason == "--num-threads 3"
    chosen = choose_threads(None, {"OMP_NUM_THREADS": "5"}, 8, quota)
    assert (chosen.num_threads, chosen.reason) == (5, "OMP_NUM_THREADS=5")
    chosen = choose_threads(None, {"OMP_NUM_THREADS": "x"}, 8, quota)
    assert (chosen.num_threads, chosen.reason) == (3, "8 CPUs in the affinity mask, cgroup quota 3.00 CPUs (cpu.max)")
    chosen = choose_threads(None, {}, 2, None)
    assert (chosen.num_threads, chosen.reason) == (2, "2 CPUs in the affinity mask, no cgroup CPU quota")
    with pytest.raises(ValueError, match="num_threads must be at least 1, got 0"):
        choose_threads(0, {}, 2, None)


def test_wait_policy_short_spin_or_passive_unless_the_user_set_one():
    environ: dict[str, str] = {}
    assert prepare_openmp_env(environ, "short-spin", torch_loaded=False).startswith(
        f"OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT={SHORT_SPIN_COUNT} (set by splitserve"
    )
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SHORT_SPIN_COUNT)}
    environ = {}
    assert prepare_openmp_env(environ, "passive", torch_loaded=False).startswith("OMP_WAIT_POLICY=PASSIVE (set by")
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "100"}):
        environ = dict(user)
        name, value = next(iter(user.items()))
        for policy in ("short-spin", "passive"):
            assert prepare_openmp_env(environ, policy, torch_loaded=False) == f"{name}={value} (set by the user)"
            assert environ == user
    # Intel's KMP_BLOCKTIME does not stop the policy: libgomp (torch's runtime) ignores it, Intel's reads it first
    environ = {"KMP_BLOCKTIME": "1"}
    assert prepare_openmp_env(environ, "short-spin", torch_loaded=False).startswith(
        f"OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT={SHORT_SPIN_COUNT}, KMP_BLOCKTIME=1 (set by splitserve"
    )
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SHORT_SPIN_COUNT), "KMP_BLOCKTIME": "1"}
    environ = {}
    prepare_openmp_env(environ, "runtime", torch_loaded=False)
    assert environ == {}
    environ = {}
    assert "torch was imported before" in prepare_openmp_env(environ, "short-spin", torch_loaded=True)
    assert environ == {}
    with pytest.raises(
        ValueError, match="SPLITSERVE_OMP_WAIT_POLICY must be one of short-spin, passive, runtime, got 'spin'"
    ):
        prepare_openmp_env({}, "spin", torch_loaded=False)


# A child that runs a parallel sum (two OpenMP threads), then sleeps 5 ms, 100 times: the CPU time its threads other
# than the main one take is the worker's share of the sums (about 0.1 ms each) plus what it spins while the main
# thread sleeps.
IDLE_CHILD = """
import json, os, sys, time
from splitserve.base import cpu_threads
print(cpu_threads.prepare_openmp_env(os.environ, sys.argv[1], "torch" in sys.modules), file=sys.stderr)
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 20)
x.sum()
process, main = time.process_time(), time.thread_time()
for _ in range(100):
    x.sum()
    time.sleep(0.005)
print(json.dumps({"others_cpu_s": (time.process_time() - process) - (time.thread_time() - main)}))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity")
    or len(os.sched_getaffinity(0)) < 2
    or platform.machine().lower() not in ("x86_64", "amd64"),
    reason="needs 2 CPUs, Linux and x86 (libgomp's spin is a loop of pause instructions there; empty on aarch64)",
)
def test_short_spin_threads_sleep_between_regions_where_the_runtime_default_spins():
    """What the default wait policy does to torch's OpenMP runtime, measured: between parallel regions 5 ms apart,
    a worker under ``short-spin`` (3,000 spins, microseconds) takes a small fraction of the CPU time it takes under
    the runtime's default (300,000 spins, milliseconds per gap), however fast this CPU's pause is and however loaded
    the machine (both children run here, now, the same work)."""
    import json

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    others = {}
    for policy in ("short-spin", "runtime"):
        done = subprocess.run(
            [sys.executable, "-c", IDLE_CHILD, policy], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 0, done.stderr
        others[policy] = json.loads(done.stdout)["others_cpu_s"]
    assert others["short-spin"] < 0.08, others  # 100 sums' share (~10 ms) and 100 short spins (~3 ms here)
    assert others["runtime"] > 5 * others["short-spin"], others  # 29x measured on an idle Sapphire Rapids


@pytest.mark.slow  # a whole `splitserve generate` process on one CPU: 5-20 s depending on the machine's load
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_a_core_process_pinned_to_one_cpu_computes_with_one_short_spinning_thread(checkpoint):
    """A real ``splitserve generate`` (in-process core) started on one CPU of the machine, with no thread or wait
    setting in its environment: torch in that process runs 1 thread and OpenMP was given the short spin, as it logs
    from ``torch.get_num_threads()`` and its own environment."""
    model = checkpoint("llama")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "SPLITSERVE_OMP"))}
    env |= {"SPLITSERVE_LOG_LEVEL": "INFO"}
    cpu = min(os.sched_getaffinity(0))
    done = subprocess.run(
        [sys.executable, "-m", "splitserve", "generate", str(model), "--prompt", "hi", "--max-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "CPU threads:" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].split("CPU threads: ", 1)[1].startswith("1 (1 CPUs in the affinity mask, ")
    assert lines[0].endswith(f"; OpenMP wait policy: OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT={SHORT_SPIN_COUNT}")


@pytest.mark.parametrize(
    ("text", "cpus"), [("0", [0]), ("0-3", [0, 1, 2, 3]), ("6,0-2", [0, 1, 2, 6]), (" 4 , 7-8", [4, 7, 8])]
)
def test_cpu_lists_parse_and_print_as_taskset_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "not a CPU list"),
        ("0-", "not a CPU list"),
        ("a", "not a CPU"),
        ("3-1", "runs backwards"),
        ("0,0-1", "names a CPU twice"),
    ],
)
def test_bad_cpu_lists_are_refused_naming_the_variable(text, why):
    with pytest.raises(ValueError, match=why):
        parse_cpu_list(text)
    with pytest.raises(ValueError, match=f"^SPLITSERVE_CPU_OMP_THREADS_BIND: .*{why}"):
        bind_cpus(text, {0, 1}, None, "SPLITSERVE_CPU_OMP_THREADS_BIND")


def test_bind_words_and_lists_against_the_affinity_mask_and_quota():
    allowed = {2, 3, 5, 9}
    assert bind_cpus("nobind", allowed, None, "X") is None
    assert bind_cpus("all", allowed, CpuQuota(150000, 100000, "cpu.max"), "X") == [2, 3, 5, 9]
    # auto: the cores it may keep busy (quota 2.5 -> 2), the lowest of the mask
    assert bind_cpus("AUTO", allowed, CpuQuota(250000, 100000, "cpu.max"), "X") == [2, 3]
    assert bind_cpus("3,5", allowed, None, "X") == [3, 5]
    with pytest.raises(ValueError, match=r"^--cpu-omp-threads-bind=2-4: CPU 4 is not one this process may run on"):
        bind_cpus("2-4", allowed, None, "--cpu-omp-threads-bind")
    assert omp_bind_env([3, 5]) == {"OMP_PLACES": "{3},{5}", "OMP_PROC_BIND": "close", "OMP_NUM_THREADS": "2"}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_binding_sets_the_openmp_places_unless_the_user_bound_threads_already():
    cpus = sorted(os.sched_getaffinity(0))  # all of them: pinning this test process changes nothing
    environ: dict[str, str] = {}
    assert prepare_binding(environ, cpus, torch_loaded=False) == f"one OpenMP thread per CPU of {format_cpu_list(cpus)}"
    assert environ == omp_bind_env(cpus)
    # again, as the in-process core does after the command line: its own variables are no conflict
    assert prepare_binding(environ, cpus, torch_loaded=False) == f"one OpenMP thread per CPU of {format_cpu_list(cpus)}"
    environ = {}
    assert "threads not bound: torch was imported before" in prepare_binding(environ, cpus, torch_loaded=True)
    assert environ == {}
    assert prepare_binding(environ, None, torch_loaded=False) == "not bound (nobind)" and environ == {}
    with pytest.raises(ValueError, match="GOMP_CPU_AFFINITY is set as well"):
        prepare_binding({"GOMP_CPU_AFFINITY": "0"}, cpus, torch_loaded=False)


BOUND_CHILD = """
import json, os, threading
from splitserve.base import cpu_threads
cpu_threads.prepare_process("passive", os.environ["SPLITSERVE_CPU_OMP_THREADS_BIND"])
import torch
from core_svc.device import set_compute_threads
line = set_compute_threads(None)
a = torch.randn(256, 256)
def work():
    for _ in range(3):
        a @ a
work()
t = threading.Thread(target=work)
t.start()
t.join()
masks = {}
for tid in os.listdir("/proc/self/task"):
    try:
        status = open(f"/proc/self/task/{tid}/status").read()
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended since the listing (ESRCH mid-exit)
        continue
    masks[tid] = [v.split()[1] for v in status.splitlines() if v.startswith("Cpus_allowed_list")][0]
print(json.dumps({"line": line, "masks": masks, "main": masks[str(os.getpid())]}))
"""


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs and Linux"
)
def test_a_bound_core_process_runs_one_openmp_thread_per_listed_cpu():
    """A process bound to two CPUs (as ``splitserve core`` binds itself before torch loads): every thread is
    allowed on those two only, each worker thread of a parallel region is on one CPU of its own, and the thread
    that loaded torch is allowed on both again (the runtime had bound it to the first)."""
    import json

    cpus = sorted(os.sched_getaffinity(0))[:2]
    text = format_cpu_list(cpus)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env["SPLITSERVE_CPU_OMP_THREADS_BIND"] = text
    done = subprocess.run([sys.executable, "-c", BOUND_CHILD], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["line"].startswith(f"CPU threads: 2 (one per CPU of SPLITSERVE_CPU_OMP_THREADS_BIND={text}); ")
    assert f"binding: CPUs {text}, OMP_PLACES={{{cpus[0]}}},{{{cpus[1]}}} OMP_PROC_BIND=close" in report["line"]
    masks = [parse_cpu_list(mask) for mask in report["masks"].values()]
    assert all(set(mask) <= set(cpus) for mask in masks)
    assert parse_cpu_list(report["main"]) == cpus
    assert [cpus[1]] in masks  # a worker thread of each team on the second CPU only


def test_an_invalid_binding_is_refused_at_startup_in_one_line(monkeypatch, capsys):
    from splitserve.entrypoints.cli import main

    monkeypatch.setenv("SPLITSERVE_CPU_OMP_THREADS_BIND", "0-x")
    assert main(["core", "--model", "nowhere"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: SPLITSERVE_CPU_OMP_THREADS_BIND: '0-x' is not a CPU list such as 0-3,6; or one of nobind, auto, all"
    ]
    assert main(["core", "--model", "nowhere", "--cpu-omp-threads-bind", "4096"]) == 2
    assert capsys.readouterr().err.startswith("error: --cpu-omp-threads-bind=4096: CPU 4096 is not one this process")


FREED_CHILD = """
import ctypes, os, sys
if sys.argv[1] == "keep":
    from core_svc.device import keep_freed_memory
    print(keep_freed_memory(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
size = 20 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
before = rss()
libc.free(block)
print(before - rss())
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="reads /proc; glibc's mallopt"
)
def test_a_cpu_core_keeps_the_memory_a_step_frees():
    """glibc maps a fresh 20 MiB block for itself and gives it back on free (the process's resident memory falls
    by it); after ``keep_freed_memory`` (what a CPU core does at start) the block comes from the heap and stays."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    run = [sys.executable, "-c", FREED_CHILD]
    default = subprocess.run([*run, "default"], capture_output=True, text=True, timeout=120, env=env, check=True)
    kept = subprocess.run([*run, "keep"], capture_output=True, text=True, timeout=120, env=env, check=True)
    assert int(default.stdout) >= 19 << 20  # given back
    assert "up to 1 GiB of freed memory kept" in kept.stderr
    assert int(kept.stdout) < 1 << 20  # kept


def test_glibc_s_own_malloc_settings_are_left_alone(monkeypatch):
    from core_svc.device import keep_freed_memory

    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert keep_freed_memory() == "malloc: as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set"


def _thp_mode() -> str | None:
    """Linux's transparent huge page mode ("always", "madvise", "never"), None where it has none to say."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.is_file() or not Path("/proc/self/smaps_rollup").is_file():
        return None
    return path.read_text().split("[", 1)[-1].split("]", 1)[0]


def _huge_bytes(tensor: Any) -> int:
    """Bytes in transparent huge pages of the mapping that holds ``tensor``'s memory (/proc/self/smaps)."""
    address, mapping = tensor.data_ptr(), None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if match := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
            mapping = (int(match[1], 16), int(match[2], 16))
        elif line.startswith("AnonHugePages:") and mapping and mapping[0] <= address < mapping[1]:
            return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_fallbacks() -> int:
    """The kernel's count of huge-page faults that fell back to small pages (a fragmented or limited host)."""
    vmstat = dict(line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return int(vmstat.get("thp_fault_fallback", 0))


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="Linux with transparent huge pages")
def test_the_cpu_kv_cache_asks_for_huge_pages():
    """The advice reaches the kernel: the tensor's pages are huge ones (or, on a host with no 2 MiB page to spare,
    the kernel counted a fallback), whatever memory the process's allocator holds already; where huge pages are only
    given on advice, a plain tensor of the same size gets none. The tensor is zeroed, writable, and outlives the
    call that made it."""
    import torch

    from core_svc.device import keep_freed_memory, zeros_in_huge_pages

    shape = (8, 1 << 20)  # 32 MiB of float32
    keep_freed_memory()  # as a core at start: what a step frees stays in the heap, its pages touched
    scratch = torch.ones(2 * shape[0], shape[1])
    del scratch
    fallbacks = _thp_fallbacks()
    tensor, advised = zeros_in_huge_pages(shape, torch.float32)
    assert advised
    assert _huge_bytes(tensor) >= 16 << 20 or _thp_fallbacks() > fallbacks
    assert torch.count_nonzero(tensor) == 0 and tensor.shape == shape and tensor.dtype == torch.float32
    tensor[3, 5] = 2.0
    assert float(tensor.sum()) == 2.0
    if _thp_mode() == "madvise":
        assert _huge_bytes(torch.zeros(shape)) == 0


@pytest.mark.parametrize("mode", ["never", None])
def test_the_cpu_kv_cache_says_no_huge_pages_where_linux_gives_none(monkeypatch: pytest.MonkeyPatch, mode: str | None):
    """madvise(MADV_HUGEPAGE) is accepted under "never" too, so the mode itself decides what the startup line says:
    with huge pages off (or no THP at all) the cache is still a zeroed, writable tensor, and not called huge."""
    import torch

    from core_svc import device

    monkeypatch.setattr(device, "transparent_huge_pages_mode", lambda: mode)
    tensor, advised = device.zeros_in_huge_pages((4, 1024), torch.float32)
    assert not advised
    assert torch.count_nonzero(tensor) == 0 and tensor.shape == (4, 1024)
    tensor[1, 2] = 3.0
    assert float(tensor.sum()) == 3.0


@pytest.mark.skipif(_thp_mode() is None, reason="Linux with transparent huge pages")
def test_transparent_huge_pages_mode_reads_the_bracketed_word():
    from core_svc.device import transparent_huge_pages_mode

    assert transparent_huge_pages_mode() == _thp_mode()


def test_the_cpu_kv_cache_falls_back_to_torch_where_the_mapping_is_refused(monkeypatch: pytest.MonkeyPatch):
    import mmap

    import torch

    from core_svc.device import zeros_in_huge_pages

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    tensor, advised = zeros_in_huge_pages((3, 256), torch.bfloat16)
    assert not advised
    assert tensor.shape == (3, 256) and tensor.dtype == torch.bfloat16 and torch.count_nonzero(tensor) == 0


def test_a_process_with_thp_turned_off_reads_never(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """prctl(PR_SET_THP_DISABLE) shows as ``THP_enabled: 0`` in /proc/self/status, whatever the system's mode."""
    from core_svc import device

    system, status = tmp_path / "enabled", tmp_path / "status"
    system.write_text("always [madvise] never\n")
    real_path = device.Path

    def fake_path(name: str) -> Path:
        return {"/sys/kernel/mm/transparent_hugepage/enabled": system, "/proc/self/status": status}.get(
            name, real_path(name)
        )

    monkeypatch.setattr(device, "Path", fake_path)
    status.write_text("Name:\tpython\nTHP_enabled:\t1\nThreads:\t3\n")
    assert device.transparent_huge_pages_mode() == "madvise"
    status.write_text("Name:\tpython\nTHP_enabled:\t0\nThreads:\t3\n")
    assert device.transparent_huge_pages_mode() == "never"
    status.write_text("Name:\tpython\n")  # an older kernel: no such line
    assert device.transparent_huge_pages_mode() == "madvise"
