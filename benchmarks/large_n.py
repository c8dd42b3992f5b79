"""``splitserve bench n``: what one request with a large n costs, its own caller and everyone else on the frontend.

For each n (default 1024, 4096, 16384), one request as issue 13 sent it: prompt "hello", temperature 1, DELTA
outputs, with a client deadline (``deadline_s``); ``max_tokens`` (EOS ignored) is large enough that no child
finishes before the deadline, so the whole request is in flight when it passes. Measured the same way for the
split stack (core and frontend processes, the public gRPC API) and for the in-process engine (``AsyncLLM`` with
its core on the engine thread, in this process):

- ``add_s``: from the call until the core holds all n children (the core's ``GetLoad``; in-process, its
  ``get_load``), polled every 20 ms;
- ``first_output_s``: until the first streamed token;
- ``abort_s``: from the deadline until the core holds none of them and every KV block is free (in-process: and
  the output processor is empty);
- liveness, from the call until 1 s after the abort: split, the time the frontend takes to answer
  ``grpc.health.v1`` ``Check("")`` (what a Kubernetes liveness probe does), asked every 100 ms from another
  thread; in-process, how late the event loop runs a 10 ms timer (what a Check would wait): max and p99;
- ``peak_rss_mib``: the frontend process's resident memory at its highest, over its size before the call
  (split: the frontend process; in-process: this process, core included).

Each (deployment, n) runs ``repeats`` times: the report gives the median of each time, the worst liveness answer
of all runs, and every run's values (the machine is shared: one run can be slowed by others' work).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.workload import Machine, pyplot, write_json
from splitserve.stubs.engine.v1 import engine_core_pb2 as core_pb
from splitserve.stubs.engine.v1 import engine_core_pb2_grpc as core_grpc
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

logger = logging.getLogger(__name__)

PROMPT = "hello"
LOAD_POLL_S = 0.02
LIVENESS_POLL_S = 0.1
TICK_S = 0.01
# The core's settings (both deployments): a context long enough that max_tokens outlasts the deadline, and KV
# blocks for the running children (preemption, should it come, only recomputes).
CORE_CONFIG: dict[str, Any] = {"max_model_len": 2048, "num_kv_blocks": 8192}
CORE_ARGS = [arg for name, value in CORE_CONFIG.items() for arg in (f"--{name.replace('_', '-')}", str(value))]
# Times reported as the median over the repeats; liveness as the worst over them.
MEDIAN_FIELDS = ("add_s", "first_output_s", "abort_s")


@dataclass(frozen=True)
class Settings:
    ns: tuple[int, ...] = (1024, 4096, 16384)
    deadline_s: float = 10.0  # the client's deadline (issue 13 used 10 s)
    max_tokens: int = 2000  # per completion, EOS ignored: no child finishes before the deadline
    repeats: int = 3  # runs of each (deployment, n)
    max_wait_s: float = 900.0  # give up on an abort after this long


@dataclass
class Load:
    num_requests: int  # running + waiting
    num_free_kv_blocks: int
    num_usable_kv_blocks: int


@dataclass
class NResult:
    deployment: str
    n: int
    add_s: float = math.nan  # until the core held all n (nan: it never did)
    peak_core_requests: int = 0
    first_output_s: float = math.nan  # nan: no token before the deadline
    abort_s: float = math.nan  # from the deadline until the core is empty, all blocks free (nan: never)
    liveness_max_s: float = math.nan
    liveness_p99_s: float = math.nan
    peak_rss_mib: float = math.nan
    finished_before_deadline: bool = False
    error: str | None = None
    liveness_samples_s: list[float] = field(default_factory=list, repr=False)


class LoadWatch:
    """Polls the core's load while a request runs: when it first held ``n`` requests, and when it is empty
    again with every block free after ``mark_deadline``."""

    def __init__(self, n: int, get_load: Callable[[], Any], start: float) -> None:
        self.n, self.get_load, self.start = n, get_load, start
        self.add_s = math.nan
        self.peak = 0
        self.deadline: float | None = None
        self.empty_at: float | None = None

    async def run(self, idle: Callable[[], bool] = lambda: True) -> None:
        while self.empty_at is None:
            load: Load = await self.get_load()
            now = time.perf_counter()
            self.peak = max(self.peak, load.num_requests)
            if math.isnan(self.add_s) and load.num_requests >= self.n:
                self.add_s = now - self.start
            if (
                self.deadline is not None
                and load.num_requests == 0
                and load.num_free_kv_blocks == load.num_usable_kv_blocks
                and idle()
            ):
                self.empty_at = now
            await asyncio.sleep(LOAD_POLL_S)


def _request(n: int, max_tokens: int) -> api.GenerateRequest:
    params = api.SamplingParams(
        n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, output_kind=api.OUTPUT_KIND_DELTA
    )
    return api.GenerateRequest(prompt=PROMPT, sampling_params=params)


class LivenessProbe:
    """``Check("")`` on the frontend every ``LIVENESS_POLL_S`` from its own thread and channel, as a kubelet
    would; also samples the frontend process's RSS."""

    def __init__(self, address: str, pid: int) -> None:
        self.address, self.process = address, psutil.Process(pid)
        self.latencies: list[float] = []
        self.base_rss = self.process.memory_info().rss
        self.peak_rss = self.base_rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LivenessProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=600)
                except grpc.RpcError as e:
                    logger.warning("liveness check failed: %s", e.code().name)
                self.latencies.append(time.perf_counter() - start)
                self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
                self._stop.wait(LIVENESS_POLL_S)


async def split_one(core_address: str, frontend: Any, n: int, settings: Settings) -> NResult:
    """One request of ``n`` through ``frontend`` (a ``stack.ServiceProcess``) to the core at ``core_address``."""
    result = NResult("split", n)
    frontend_address, deadline_s, max_wait_s = frontend.address, settings.deadline_s, settings.max_wait_s
    async with (
        grpc.aio.insecure_channel(frontend_address) as frontend_channel,
        grpc.aio.insecure_channel(core_address) as core_channel,
    ):
        core = core_grpc.EngineCoreStub(core_channel)

        async def get_load() -> Load:
            load = await core.GetLoad(core_pb.GetLoadRequest(), timeout=60)
            return Load(
                load.num_running_reqs + load.num_waiting_reqs, load.num_free_kv_blocks, load.num_usable_kv_blocks
            )

        with LivenessProbe(frontend_address, frontend.process.pid) as probe:
            start = time.perf_counter()
            watch = LoadWatch(n, get_load, start)
            watcher = asyncio.create_task(watch.run())
            try:
                request = _request(n, settings.max_tokens)
                call = api_grpc.GenerationStub(frontend_channel).Generate(request, timeout=deadline_s)
                async for response in call:
                    if math.isnan(result.first_output_s) and any(o.token_ids for o in response.outputs):
                        result.first_output_s = time.perf_counter() - start
                result.finished_before_deadline = True
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    result.error = f"{e.code().name}: {e.details()}"
            watch.deadline = start + deadline_s
            try:
                await asyncio.wait_for(watcher, max_wait_s)
            except TimeoutError:
                result.error = result.error or f"the core still held requests {max_wait_s:.0f} s after the deadline"
            await asyncio.sleep(1.0)
        _fill(result, watch, probe.latencies, (probe.peak_rss - probe.base_rss) / 2**20)
    return result


def _fill(result: NResult, watch: LoadWatch, latencies: list[float], peak_rss_mib: float) -> None:
    result.add_s, result.peak_core_requests = watch.add_s, watch.peak
    if watch.empty_at is not None and watch.deadline is not None and not result.finished_before_deadline:
        result.abort_s = max(0.0, watch.empty_at - watch.deadline)
    if latencies:
        result.liveness_max_s = float(max(latencies))
        result.liveness_p99_s = float(np.percentile(latencies, 99))
    result.liveness_samples_s = latencies
    result.peak_rss_mib = peak_rss_mib


def run_split(model: Path, settings: Settings, log_dir: Path) -> list[NResult]:
    from splitserve.entrypoints import stack

    processes: list[stack.ServiceProcess] = []
    try:
        core = stack.start_core(str(model), log_dir, CORE_ARGS)
        processes.append(core)
        core.wait_serving()
        frontend = stack.start_frontend(str(model), [core.address], log_dir)
        processes.append(frontend)
        frontend.wait_serving()
        asyncio.run(_warm_up(frontend.address))
        results = []
        for n in settings.ns:
            for _ in range(settings.repeats):
                results.append(asyncio.run(split_one(core.address, frontend, n, settings)))
                logger.info("split n=%d: %s", n, _line(results[-1]))
        return results
    finally:
        for process in reversed(processes):
            process.stop()


async def _warm_up(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        async for _ in api_grpc.GenerationStub(channel).Generate(_request(2, 2)):
            pass


async def inproc_one(llm: Any, n: int, settings: Settings) -> NResult:
    """One request of ``n`` through ``llm`` (an ``AsyncLLM`` with its core in this process)."""
    from frontend_svc import RequestOutputKind, SamplingParams

    result = NResult("in-process", n)
    deadline_s, max_wait_s = settings.deadline_s, settings.max_wait_s
    engine_core = llm.engine_core.engine_core  # read from this thread while the engine thread runs: counts only
    process = psutil.Process()
    base_rss = peak_rss = process.memory_info().rss
    latencies: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        nonlocal peak_rss
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            latencies.append(max(0.0, time.perf_counter() - before - TICK_S))
            peak_rss = max(peak_rss, process.memory_info().rss)

    async def get_load() -> Load:
        load = engine_core.get_load()
        return Load(load.num_running_reqs + load.num_waiting_reqs, load.num_free_kv_blocks, load.num_usable_kv_blocks)

    params = SamplingParams(
        n=n, temperature=1.0, max_tokens=settings.max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    start = time.perf_counter()

    async def consume() -> None:
        async for output in llm.generate(PROMPT, params, f"bench-n-{n}"):
            if math.isnan(result.first_output_s) and any(c.token_ids for c in output.outputs):
                result.first_output_s = time.perf_counter() - start
        result.finished_before_deadline = True

    ticker = asyncio.create_task(tick())
    watch = LoadWatch(n, get_load, start)
    watcher = asyncio.create_task(watch.run(idle=lambda: not llm.output_processor.has_unfinished_requests()))
    consumer = asyncio.create_task(consume())
    done, _ = await asyncio.wait({consumer}, timeout=deadline_s)
    if not done:
        consumer.cancel()
    await asyncio.gather(consumer, return_exceptions=True)
    watch.deadline = start + deadline_s
    try:
        await asyncio.wait_for(watcher, max_wait_s)
    except TimeoutError:
        result.error = f"the core still held requests {max_wait_s:.0f} s after the deadline"
    await asyncio.sleep(1.0)
    stop.set()
    await ticker
    _fill(result, watch, latencies, (peak_rss - base_rss) / 2**20)
    return result


def run_inproc(model: Path, settings: Settings) -> list[NResult]:
    from frontend_svc.async_llm import AsyncLLM

    async def run_all() -> list[NResult]:
        llm = AsyncLLM(str(model), **CORE_CONFIG)
        gc.collect()
        gc.freeze()  # as the servers do once started (frontend_svc.server)
        try:
            async for _ in llm.generate(PROMPT, _warm_up_params(), "warm-up"):
                pass
            results = []
            for n in settings.ns:
                for _ in range(settings.repeats):
                    results.append(await inproc_one(llm, n, settings))
                    logger.info("in-process n=%d: %s", n, _line(results[-1]))
            return results
        finally:
            llm.close()
            gc.unfreeze()

    return asyncio.run(run_all())


def _warm_up_params() -> Any:
    from frontend_svc import SamplingParams

    return SamplingParams(n=2, temperature=1.0, max_tokens=2)


def _line(r: NResult) -> str:
    return (
        f"add {r.add_s:.2f} s, first output {r.first_output_s:.2f} s, abort {r.abort_s:.2f} s, "
        f"liveness max {r.liveness_max_s:.3f} s, RSS +{r.peak_rss_mib:.0f} MiB"
    )


def run(
    model: Path, settings: Settings, deployments: list[str], log_dir: Path, baseline: Path | None = None
) -> dict[str, Any]:
    """Run each deployment over ``settings.ns``, one after the other (the split stack's processes are stopped
    before the in-process engine starts), and report them side by side; ``baseline``: an earlier report (other
    code, the same command) to show beside it."""
    runs: list[NResult] = []
    if "split" in deployments:
        runs += run_split(model, settings, log_dir)
    if "in-process" in deployments:
        runs += run_inproc(model, settings)
    return {
        "benchmark": "n",
        "model": str(model),
        "machine": Machine.current().to_dict(),
        "request": {
            "prompt": PROMPT,
            "temperature": 1.0,
            "max_tokens": settings.max_tokens,
            "ignore_eos": True,
            "output_kind": "DELTA",
            "deadline_s": settings.deadline_s,
        },
        "core_args": CORE_ARGS,
        "repeats": settings.repeats,
        "results": summarize(runs),
        "runs": [_run_record(r) for r in runs],
        "baseline": _baseline(baseline) if baseline is not None else None,
    }


def _run_record(result: NResult) -> dict[str, Any]:
    """One run as the JSON keeps it: the liveness samples counted, not listed (their max and p99 are kept)."""
    record = asdict(result)
    record["liveness_num_samples"] = len(record.pop("liveness_samples_s"))
    return record


def summarize(runs: list[NResult]) -> list[dict[str, Any]]:
    """One row per (deployment, n), in run order: the median of each time over its runs (nan when none had it),
    the worst liveness answer and memory of all of them, the fewest requests the core held, the first error."""
    groups: dict[tuple[str, int], list[NResult]] = {}
    for r in runs:
        groups.setdefault((r.deployment, r.n), []).append(r)
    rows = []
    for (deployment, n), group in groups.items():
        row: dict[str, Any] = {"deployment": deployment, "n": n, "runs": len(group)}
        for key in MEDIAN_FIELDS:
            values = [getattr(r, key) for r in group]
            finite = [v for v in values if not math.isnan(v)]
            row[key] = float(np.median(finite)) if finite else math.nan
            row[f"{key}_runs"] = values
        samples = [x for r in group for x in r.liveness_samples_s]
        row["liveness_max_s"] = max(samples) if samples else math.nan
        row["liveness_p99_s"] = float(np.percentile(samples, 99)) if samples else math.nan
        row["liveness_max_s_runs"] = [r.liveness_max_s for r in group]
        row["peak_rss_mib"] = max(r.peak_rss_mib for r in group)
        row["peak_core_requests"] = min(r.peak_core_requests for r in group)
        row["finished_before_deadline"] = any(r.finished_before_deadline for r in group)
        row["error"] = next((r.error for r in group if r.error), None)
        rows.append(row)
    return rows


def _baseline(path: Path) -> dict[str, Any]:
    """An earlier report's summary rows."""
    return {"path": str(path), "results": json.loads(path.read_text())["results"]}


def format_report(report: dict[str, Any]) -> str:
    req = report["request"]
    lines = [
        f"model {report['model']}; one request: prompt {req['prompt']!r}, temperature 1, max_tokens "
        f"{req['max_tokens']} (EOS ignored), DELTA, deadline {req['deadline_s']:.0f} s; {report['repeats']} runs "
        "each: times are medians, liveness the worst answer of all runs",
        f"{'deployment':11} {'n':>6} {'add s':>8} {'first out s':>12} {'abort s':>9} {'live max s':>11} "
        f"{'live p99 s':>11} {'RSS +MiB':>9}  note",
    ]
    for r in report["results"]:
        note = r["error"] or ("finished before the deadline" if r["finished_before_deadline"] else "")
        if not note and r["peak_core_requests"] < r["n"]:
            note = f"the core held at most {r['peak_core_requests']}"
        lines.append(
            f"{r['deployment']:11} {r['n']:6d} {r['add_s']:8.2f} {r['first_output_s']:12.2f} {r['abort_s']:9.2f} "
            f"{r['liveness_max_s']:11.3f} {r['liveness_p99_s']:11.3f} {r['peak_rss_mib']:9.0f}  {note}"
        )
    lines.append('liveness: split, Check("") answer time on the frontend; in-process, event-loop lateness')
    baseline = report.get("baseline")
    if baseline:
        lines.append(f"against {baseline['path']}:")
        before = {(r["deployment"], r["n"]): r for r in baseline["results"]}
        for r in report["results"]:
            b = before.get((r["deployment"], r["n"]))
            if b is not None:
                changes = ", ".join(f"{name} {b[key]:.2f} -> {r[key]:.2f} s" for key, name in _COMPARED)
                lines.append(f"  {r['deployment']:11} n={r['n']:<6d} {changes}")
    return "\n".join(lines)


_COMPARED = (
    ("add_s", "add"),
    ("first_output_s", "first output"),
    ("abort_s", "abort"),
    ("liveness_max_s", "liveness max"),
)


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """``<name>.json`` and ``<name>.png``: the four times against n, per deployment (log-log)."""
    plt = pyplot()
    json_path, png_path = write_json(report, out_dir, name)
    metrics = (
        ("add_s", "add: core holds all n"),
        ("first_output_s", "first output"),
        ("abort_s", "abort after the deadline"),
        ("liveness_max_s", "liveness: worst answer"),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(16, 4))
    deployments = sorted({r["deployment"] for r in report["results"]})
    baseline = report.get("baseline") or {"results": []}
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, deployment in enumerate(deployments):
            rows = [r for r in report["results"] if r["deployment"] == deployment]
            ax.plot([r["n"] for r in rows], [r[key] for r in rows], "o-", color=f"C{i}", label=deployment)
            before = [r for r in baseline["results"] if r["deployment"] == deployment]
            if before:
                xs, ys = [r["n"] for r in before], [r[key] for r in before]
                ax.plot(xs, ys, "x--", color=f"C{i}", alpha=0.6, label=f"{deployment}, baseline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n")
        ax.set_ylabel("s")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    req = report["request"]
    fig.suptitle(f"one request of n completions (max_tokens {req['max_tokens']}, deadline {req['deadline_s']:.0f} s)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
