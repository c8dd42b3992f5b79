"""``bench throughput --contend N``: splitserve's throughput while N busy processes compete for its cores.

splitserve runs in a child process (``LLM.generate``, core in-process, float32) on the set's first requests,
pinned to the cores this process may use, once alone and once beside N competitors: processes that spin in a
Python loop, pinned to the same cores. Each under three OpenMP wait policies, since the runtime reads its policy
when torch is loaded (so a child process, not this one): ``runtime`` (the OpenMP runtime's own default, spinning
waits for milliseconds: splitserve before issue 18), ``passive`` (``OMP_WAIT_POLICY=PASSIVE``, no spin) and
``short-spin`` (a spin of tens of microseconds, then sleep: splitserve's default).

What the competitors may fairly take: Linux's scheduler (CFS) shares the cores equally between runnable threads,
so with T compute threads, N competitors and C cores (T + N > C), each thread runs C / (T + N) of the time, and
splitserve keeps ``expected_share`` = T * C / (T + N) / min(T, C) of the CPU it had alone (2 threads and 1
competitor on 2 cores: 2/3; 1 thread and 1 competitor on 1 core: 1/2). The competitors' measured CPU time over
the run (``/proc/<pid>/stat``) says what they did take. A wait policy that holds its throughput near that share
does not collapse; one far below it loses time to threads that spin while their partner waits for a core.

The child is ``python -m benchmarks.contention_child``, which sets the wait policy before anything loads torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from splitserve.base.cpu_threads import DEFAULT_WAIT_POLICY, WAIT_POLICIES

SPIN = "while True:\n    pass\n"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def expected_share(num_threads: int, num_cores: int, num_competitors: int) -> float:
    """The fraction of its unloaded CPU time splitserve keeps when ``num_competitors`` busy single-threaded
    processes share its ``num_cores`` cores with its ``num_threads`` threads, under per-thread fair sharing."""
    if num_threads + num_competitors <= num_cores:
        return 1.0
    return num_threads * num_cores / (num_threads + num_competitors) / min(num_threads, num_cores)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (``/proc/<pid>/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _child_env(policy: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    return env | {"SPLITSERVE_OMP_WAIT_POLICY": policy, "SPLITSERVE_LOG_STATS_INTERVAL": "0"}


def run_one(
    model: Path, prompts_file: Path, policy: str, num_competitors: int, num_threads: int, timeout_s: float
) -> dict[str, Any]:
    """One child run; its output tokens per second (None when it ran past ``timeout_s``, then killed), and the CPU
    share the competitors took of the cores over the run."""
    cores = sorted(os.sched_getaffinity(0))

    def pin() -> None:
        os.sched_setaffinity(0, cores)

    competitors = [subprocess.Popen([sys.executable, "-c", SPIN], preexec_fn=pin) for _ in range(num_competitors)]
    try:
        time.sleep(0.5 if competitors else 0)  # the competitors spinning before the child starts
        cpu_before = [_cpu_seconds(p.pid) for p in competitors]
        start = time.perf_counter()
        command = [sys.executable, "-m", "benchmarks.contention_child", str(model), str(prompts_file), str(num_threads)]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout_s, env=_child_env(policy), preexec_fn=pin
            )
        except subprocess.TimeoutExpired:
            done = None
        wall = time.perf_counter() - start
        taken = sum(_cpu_seconds(p.pid) - before for p, before in zip(competitors, cpu_before, strict=True))
    finally:
        for p in competitors:
            p.kill()
            p.wait()
    result: dict[str, Any] = {
        "policy": policy,
        "competitors": num_competitors,
        "cores": len(cores),
        "competitor_cpu_share": taken / (wall * len(cores)),
        "wall_s": wall,
        "load_average": list(os.getloadavg()),  # at the end of the run
    }
    if done is None:
        return result | {"output_tok_s": None, "note": f"did not finish in {timeout_s:.0f} s"}
    if done.returncode != 0:
        raise RuntimeError(f"the contention child failed ({done.returncode}): {done.stderr[-2000:]}")
    child = json.loads(done.stdout.strip().splitlines()[-1])
    return result | child


def run(model: Path, prompts: list[list[int]], output_len: int, options: dict[str, Any]) -> dict[str, Any]:
    """Each wait policy alone and beside ``options["competitors"]`` competitors, on ``prompts``; options:
    competitors, num_threads, timeout_s. Alone first, then contended, each round through every policy."""
    num_competitors, num_threads = options["competitors"], options["num_threads"]
    with tempfile.TemporaryDirectory() as folder:
        prompts_file = Path(folder) / "prompts.json"
        prompts_file.write_text(json.dumps({"prompts": prompts, "output_len": output_len}))
        runs = [
            run_one(model, prompts_file, policy, n, num_threads, options["timeout_s"])
            for n in (0, num_competitors)
            for policy in WAIT_POLICIES
        ]
    cores = len(os.sched_getaffinity(0))
    summary = {}
    for policy in WAIT_POLICIES:
        alone = next(r for r in runs if r["policy"] == policy and r["competitors"] == 0)
        loaded = next(r for r in runs if r["policy"] == policy and r["competitors"] == num_competitors)
        kept = None
        if alone["output_tok_s"] and loaded["output_tok_s"]:
            kept = loaded["output_tok_s"] / alone["output_tok_s"]
        summary[policy] = {"kept": kept, "competitor_cpu_share": loaded["competitor_cpu_share"]}
    return {
        "competitors": num_competitors,
        "num_threads": num_threads,
        "cores": cores,
        "requests": len(prompts),
        "output_len": output_len,
        "expected_share": expected_share(num_threads, cores, num_competitors),
        "runs": runs,
        "summary": summary,
    }


# issue 18: under a competing busy process taking one of two cores, at least 40% of the unloaded throughput.
KEPT_TARGET = 0.40


def format_lines(contention: dict[str, Any]) -> list[str]:
    c = contention
    lines = [
        f"contention: splitserve float32 on {c['requests']} requests x {c['output_len']} tokens, {c['num_threads']} "
        f"threads on {c['cores']} cores, alone and beside {c['competitors']} busy process(es) on the same cores; "
        f"fair share kept {c['expected_share']:.2f}",
        f"{'wait policy':12} {'alone tok/s':>12} {'contended tok/s':>16} {'kept':>6} {'competitors took':>17}",
    ]
    for policy in c["summary"]:
        alone = next(r for r in c["runs"] if r["policy"] == policy and r["competitors"] == 0)
        loaded = next(r for r in c["runs"] if r["policy"] == policy and r["competitors"] == c["competitors"])

        def tok_s(r: dict[str, Any]) -> str:
            return f"{r['output_tok_s']:.1f}" if r["output_tok_s"] else r.get("note", "-")

        kept = c["summary"][policy]["kept"]
        lines.append(
            f"{policy:12} {tok_s(alone):>12} {tok_s(loaded):>16} {'-' if kept is None else f'{kept:.2f}':>6} "
            f"{100 * loaded['competitor_cpu_share']:16.0f}%"
        )
    kept = c["summary"].get(DEFAULT_WAIT_POLICY, {}).get("kept")
    if kept is not None and c["competitors"] == 1 and c["cores"] == 2:  # the target's setting
        met = "MET" if kept >= KEPT_TARGET else "NOT MET"
        lines.append(
            f"target {DEFAULT_WAIT_POLICY} (the default) throughput kept under contention: {kept:.2f} "
            f"(want >= {KEPT_TARGET}) {met}"
        )
    return lines
