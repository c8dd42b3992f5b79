"""The core's thread count (CPU affinity, cgroup CPU quota, ``--num-threads``, ``OMP_NUM_THREADS``) and OpenMP wait
policy (``splitserve.base.cpu_threads``), on fake cgroup trees; then a real ``splitserve generate`` process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.base.cpu_threads import (
    CpuQuota,
    cgroup_cpu_quota,
    choose_threads,
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


def test_wait_policy_passive_unless_the_user_set_one():
    environ: dict[str, str] = {}
    assert prepare_openmp_env(environ, "passive", torch_loaded=False).startswith("OMP_WAIT_POLICY=PASSIVE (set by")
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    environ = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert prepare_openmp_env(environ, "passive", torch_loaded=False) == "OMP_WAIT_POLICY=ACTIVE (set by the user)"
    assert environ == {"OMP_WAIT_POLICY": "ACTIVE"}
    environ = {}
    prepare_openmp_env(environ, "runtime", torch_loaded=False)
    assert environ == {}
    environ = {}
    assert "torch was imported before" in prepare_openmp_env(environ, "passive", torch_loaded=True)
    assert environ == {}
    with pytest.raises(ValueError, match="SPLITSERVE_OMP_WAIT_POLICY must be one of passive, runtime, got 'spin'"):
        prepare_openmp_env({}, "spin", torch_loaded=False)


@pytest.mark.slow  # a whole `splitserve generate` process on one CPU: 5-20 s depending on the machine's load
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")
def test_a_core_process_pinned_to_one_cpu_computes_with_one_passive_thread(checkpoint):
    """A real ``splitserve generate`` (in-process core) started on one CPU of the machine, with no thread or wait
    setting in its environment: torch in that process runs 1 thread and OpenMP was given PASSIVE, as it logs from
    ``torch.get_num_threads()`` and its own environment."""
    model = checkpoint("llama")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env |= {"SPLITSERVE_LOG_LEVEL": "INFO", "SPLITSERVE_OMP_WAIT_POLICY": "passive"}
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
    assert lines[0].endswith("; OpenMP wait policy: OMP_WAIT_POLICY=PASSIVE")
