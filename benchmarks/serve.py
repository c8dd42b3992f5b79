"""``splitserve bench serve``: online latency and throughput through the public gRPC API under a request rate.

An asyncio client sends the request set to a frontend with Poisson arrivals (exponential gaps at ``rate``
requests/s; ``inf`` sends everything at once), streams each response, and records per request the time to first
token (TTFT), the gaps between streamed tokens (ITL; a message carrying k tokens counts as k gaps of 1/k of its
interval), the time per output token after the first (TPOT) and the end-to-end latency. The wrapper runs the same
rates against the split stack (core and frontend as separate processes) and against ``splitserve serve`` (core
in-process), alternating between them run by run, and reports the split's cost as ratios.

With ``--api http`` the same frontend is measured through both of its APIs instead: gRPC ``Generate`` and the
OpenAI-compatible HTTP API (``/v1/completions``, streamed as server-sent events, read with the official ``openai``
client; vLLM's ``continuous_usage_stats`` gives each chunk's token count), at the same rates, alternating run by
run, and the report gives HTTP over gRPC as ratios.

With ``--images-per-request N`` (``image_workload``) every request carries N PNG images through ``Generate``
on a LLaVA checkpoint, new images every run, and the report adds the frontend's preprocessing rate on one thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from benchmarks.image_workload import with_fresh_images
from benchmarks.workload import Machine, RequestSet, pyplot, write_json
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)


@dataclass
class RequestTiming:
    ttft: float = math.nan
    e2e: float = math.nan
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


async def _one(
    stub: api_grpc.GenerationStub, prompt: list[int], images: list[bytes], output_len: int, timing: RequestTiming
) -> None:
    request = api.GenerateRequest(
        prompt_token_ids=prompt,
        sampling_params=api.SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0),
        images=[api.Image(data=data, mime_type="image/png") for data in images],
    )
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(request):
            now = time.perf_counter()
            new = sum(len(o.token_ids) for o in response.outputs)
            if new:
                if timing.output_tokens == 0:
                    timing.ttft = now - start
                else:
                    timing.itl += [(now - last) / new] * new
                timing.output_tokens += new
                last = now
        timing.e2e = time.perf_counter() - start
        if timing.output_tokens != output_len:
            timing.error = f"ended after {timing.output_tokens} of {output_len} tokens"
    except grpc.aio.AioRpcError as e:
        timing.error = f"{e.code().name}: {e.details()}"


async def _one_http(client: Any, model: str, prompt: list[int], output_len: int, timing: RequestTiming) -> None:
    """As ``_one``, through the OpenAI-compatible API: a streamed completion of the token-id prompt."""
    import openai

    start = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=output_len,
            temperature=0.0,
            stream=True,
            # vLLM's extra: every chunk carries the usage so far, hence its token count.
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            total = chunk.usage.completion_tokens if chunk.usage is not None else timing.output_tokens
            new = total - timing.output_tokens
            if new > 0:
                if timing.output_tokens == 0:
                    timing.ttft = now - start
                else:
                    timing.itl += [(now - last) / new] * new
                timing.output_tokens = total
                last = now
        timing.e2e = time.perf_counter() - start
        if timing.output_tokens != output_len:
            timing.error = f"ended after {timing.output_tokens} of {output_len} tokens"
    except openai.APIError as e:
        timing.error = f"{type(e).__name__}: {e}"


async def send_all(address: str, requests: RequestSet, rate: float, seed: int = 0) -> tuple[list[RequestTiming], float]:
    """Send every request at Poisson arrivals of ``rate`` per second (math.inf: all at once); return each
    request's timing and the wall seconds from the first send to the last response. ``address``: a gRPC
    ``host:port``, or the HTTP API's ``http://host:port`` (text prompts only)."""
    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(requests.prompts)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(requests.prompts))
    timings = [RequestTiming() for _ in requests.prompts]
    images = requests.images or [[] for _ in requests.prompts]
    if address.startswith("http"):
        return await _send_all_http(address, requests, gaps, timings)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_grpc.GenerationStub(channel)
        await channel.channel_ready()
        start = time.perf_counter()
        tasks = []
        for prompt, prompt_images, gap, timing in zip(requests.prompts, images, gaps, timings, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one(stub, prompt, prompt_images, requests.output_len, timing)))
        await asyncio.gather(*tasks)
        return timings, time.perf_counter() - start


async def _send_all_http(
    base_url: str, requests: RequestSet, gaps: np.ndarray, timings: list[RequestTiming]
) -> tuple[list[RequestTiming], float]:
    import httpx2
    import openai

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # no line per request
    # One connection per request in flight, as many as the gRPC channel multiplexes streams.
    limits = httpx2.Limits(max_connections=len(requests.prompts), max_keepalive_connections=len(requests.prompts))
    http_client = openai.DefaultAsyncHttpxClient(limits=limits, timeout=600)
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", http_client=http_client) as client:
        (model,) = (await client.models.list()).data  # the name it serves the model by
        start = time.perf_counter()
        tasks = []
        for prompt, gap, timing in zip(requests.prompts, gaps, timings, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(_one_http(client, model.id, prompt, requests.output_len, timing)))
        await asyncio.gather(*tasks)
        return timings, time.perf_counter() - start


def summarize(rate: float, runs: list[tuple[list[RequestTiming], float]]) -> dict[str, Any]:
    """One deployment at one rate over its repeated runs: latency percentiles (ms) over every request of every
    run, throughput as the median over runs, errors."""
    timings = [t for run_timings, _ in runs for t in run_timings]
    ok = [t for t in timings if t.error is None]
    per_run = [sum(t.output_tokens for t in ts if t.error is None) / wall for ts, wall in runs]
    summary: dict[str, Any] = {
        "rate": "inf" if math.isinf(rate) else rate,
        "runs": len(runs),
        "duration_s": [wall for _, wall in runs],
        "completed": len(ok),
        "errors": [t.error for t in timings if t.error is not None],
        "output_tokens": sum(t.output_tokens for t in ok),
        "output_tok_s": float(np.median(per_run)),
        "output_tok_s_runs": per_run,
    }
    series = {
        "ttft": [t.ttft for t in ok],
        "tpot": [t.tpot for t in ok if not math.isnan(t.tpot)],
        "itl": [x for t in ok for x in t.itl],
        "e2e": [t.e2e for t in ok],
    }
    for name, values in series.items():
        for p in PERCENTILES:
            summary[f"{name}_p{p}_ms"] = float(np.percentile(values, p) * 1000) if values else math.nan
        summary[f"{name}_mean_ms"] = float(np.mean(values) * 1000) if values else math.nan
    summary["samples_ms"] = {"ttft": [x * 1000 for x in series["ttft"]], "e2e": [x * 1000 for x in series["e2e"]]}
    return summary


def run_interleaved(
    addresses: dict[str, str], requests: RequestSet, rates: list[float], repeats: int
) -> dict[str, list[dict[str, Any]]]:
    """For each rate, ``repeats`` rounds in which every deployment runs the request set once, in turn, so a
    shared machine's drifting speed falls on all deployments alike."""
    warmup = requests.head(2, output_len=4)
    for address in addresses.values():
        asyncio.run(send_all(address, warmup, math.inf))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in addresses}
    num_runs = 0
    for rate in rates:
        runs: dict[str, list[tuple[list[RequestTiming], float]]] = {name: [] for name in addresses}
        for round_index in range(repeats):
            for name, address in addresses.items():
                num_runs += 1
                # Images: new ones every run (made before the clock starts), so each run encodes all of them.
                run_requests = with_fresh_images(requests, num_runs) if requests.images else requests
                runs[name].append(asyncio.run(send_all(address, run_requests, rate, seed=round_index)))
        for name in addresses:
            results[name].append(summarize(rate, runs[name]))
            r = results[name][-1]
            logger.info(
                "%s at rate %s: %.1f output tok/s, TTFT p50 %.1f ms, %d errors",
                name,
                r["rate"],
                r["output_tok_s"],
                r["ttft_p50_ms"],
                len(r["errors"]),
            )
    return results


def run_http(
    model: Path, requests: RequestSet, rates: list[float], core_args: list[str], log_dir: Path, repeats: int = 3
) -> dict[str, Any]:
    """Start the split stack with the frontend's HTTP API on, and run ``run_interleaved`` on its two APIs: "grpc"
    (``Generate``) and "http" (``/v1/completions``), the same frontend, core and requests."""
    from splitserve.entrypoints import stack

    if requests.images:
        raise ValueError("--api http measures text prompts only (images go through chat's image_url parts)")
    processes: list[stack.ServiceProcess] = []
    load_before = os.getloadavg()  # the machine may be shared: the report says how busy it was
    try:
        core = stack.start_core(str(model), log_dir, core_args)
        processes.append(core)
        core.wait_serving()
        http_port = stack.free_port()
        frontend = stack.start_frontend(str(model), [core.address], log_dir, ["--http-port", str(http_port)])
        processes.append(frontend)
        frontend.wait_serving()
        addresses = {"grpc": frontend.address, "http": f"http://127.0.0.1:{http_port}"}
        deployments = run_interleaved(addresses, requests, rates, repeats)
    finally:
        for process in reversed(processes):
            process.stop()
    return {
        "benchmark": "serve",
        "api": "http",
        "model": str(model),
        "machine": Machine.current().to_dict(),
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},  # 1, 5, 15 min
        "request_set": requests.summary(),
        "core_args": core_args,
        "repeats": repeats,
        "deployments": deployments,
        "comparison": compare(deployments, "http", "grpc"),
    }


def run(
    model: Path, requests: RequestSet, rates: list[float], core_args: list[str], log_dir: Path, repeats: int = 3
) -> dict[str, Any]:
    """Start the split stack (core and frontend processes) and ``splitserve serve`` (core in-process) with
    ``core_args``, both at once (an idle stack costs memory only), and run ``run_interleaved`` on them.
    The caller adds ``preprocessing`` (``image_workload.preprocess_rate``) to an image workload's report."""
    from splitserve.entrypoints import stack

    processes: list[stack.ServiceProcess] = []
    try:
        core = stack.start_core(str(model), log_dir, core_args)
        processes.append(core)
        serve = stack.start_service("serve", ["serve", "--model", str(model), *core_args], stack.free_port(), log_dir)
        processes.append(serve)
        core.wait_serving()
        frontend = stack.start_frontend(str(model), [core.address], log_dir)
        processes.append(frontend)
        frontend.wait_serving()
        serve.wait_serving()
        deployments = run_interleaved({"split": frontend.address, "inproc": serve.address}, requests, rates, repeats)
    finally:
        for process in reversed(processes):
            process.stop()
    return {
        "benchmark": "serve",
        "model": str(model),
        "machine": Machine.current().to_dict(),
        "request_set": requests.summary(),
        "core_args": core_args,
        "repeats": repeats,
        "deployments": deployments,
        "comparison": compare(deployments),
    }


def compare(
    deployments: dict[str, list[dict[str, Any]]], measured: str = "split", baseline: str = "inproc"
) -> list[dict[str, Any]]:
    """Per rate: ``measured``'s throughput over ``baseline``'s, its median TTFT over the baseline's, and what it
    adds to the median TTFT, TPOT and e2e (ms)."""
    rows = []
    for split, inproc in zip(deployments[measured], deployments[baseline], strict=True):
        rows.append(
            {
                "rate": split["rate"],
                "throughput_ratio": split["output_tok_s"] / inproc["output_tok_s"],
                "ttft_p50_ratio": split["ttft_p50_ms"] / inproc["ttft_p50_ms"],
                "ttft_p50_overhead_ms": split["ttft_p50_ms"] - inproc["ttft_p50_ms"],
                "tpot_p50_overhead_ms": split["tpot_p50_ms"] - inproc["tpot_p50_ms"],
                "e2e_p50_overhead_ms": split["e2e_p50_ms"] - inproc["e2e_p50_ms"],
            }
        )
    return rows


def check_targets(report: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """Split throughput at saturation >= 90% of in-process; median TTFT overhead at the lowest rate <= 5 ms.
    None for ``--api http`` (a comparison of two APIs, not a target)."""
    rows: list[tuple[str, float, float, bool]] = []
    if report.get("api") == "http":
        return rows
    comparison = report["comparison"]
    saturated = [c for c in comparison if c["rate"] == "inf"]
    if saturated:
        ratio = saturated[0]["throughput_ratio"]
        rows.append(("split/in-process throughput at rate inf", ratio, 0.90, ratio >= 0.90))
    finite = [c for c in comparison if c["rate"] != "inf"]
    if finite:
        lowest = min(finite, key=lambda c: c["rate"])
        overhead = lowest["ttft_p50_overhead_ms"]
        rows.append((f"split median TTFT overhead at {lowest['rate']} req/s (ms)", overhead, 5.0, overhead <= 5.0))
    return rows


def format_report(report: dict[str, Any]) -> str:
    rs = report["request_set"]
    lines = [
        f"CPU {report['machine']['cpu']} ({report['machine']['cores']} cores)"
        + (
            f", load average {report['load_average']['before'][0]:.1f} before, "
            f"{report['load_average']['after'][0]:.1f} after (1 min)"
            if "load_average" in report
            else ""
        ),
        f"model {report['model']}, {rs['num_requests']} requests, prompt mean {rs['prompt_len_mean']:.0f} tokens, "
        f"{rs['output_len']} output tokens each"
        + (
            f", {rs['images_per_request']} PNG images each ({_sizes(rs['image_sizes'])}, cycling)"
            if rs.get("images_per_request")
            else ""
        ),
        f"{'deployment':10} {'rate':>6} {'out tok/s':>10} {'TTFT p50/p90/p99 ms':>22} {'TPOT p50 ms':>12} "
        f"{'ITL p50/p99 ms':>16} {'e2e p50/p99 ms':>18} {'errors':>6}",
    ]
    for name, results in report["deployments"].items():
        for r in results:
            lines.append(
                f"{name:10} {r['rate']!s:>6} {r['output_tok_s']:10.1f} "
                f"{r['ttft_p50_ms']:8.1f}/{r['ttft_p90_ms']:6.1f}/{r['ttft_p99_ms']:6.1f} {r['tpot_p50_ms']:12.1f} "
                f"{r['itl_p50_ms']:8.1f}/{r['itl_p99_ms']:7.1f} {r['e2e_p50_ms']:9.0f}/{r['e2e_p99_ms']:8.0f} "
                f"{len(r['errors']):6d}"
            )
    names = "HTTP vs gRPC" if report.get("api") == "http" else "split vs in-process"
    for c in report["comparison"]:
        lines.append(
            f"{names} at {c['rate']}: throughput {c['throughput_ratio']:.3f}x, median TTFT "
            f"{c['ttft_p50_ratio']:.3f}x ("
            f"{c['ttft_p50_overhead_ms']:+.1f} ms), TPOT {c['tpot_p50_overhead_ms']:+.2f} ms, e2e "
            f"{c['e2e_p50_overhead_ms']:+.0f} ms"
        )
    if (pre := report.get("preprocessing")) is not None:
        by_size = ", ".join(f"{size} {rate:.0f}" for size, rate in pre["images_per_s_by_size"].items())
        lines.append(
            f"frontend preprocessing on one thread ({pre['processor']}: decode + hash + image processor): "
            f"{pre['images_per_s']:.1f} images/s ({by_size}); {pre['cpu_s_per_image'] * 1000:.1f} CPU-ms per "
            f"image, CPU/wall {pre['cpu_over_wall']:.2f}; CPU {report['machine']['cpu']}"
        )
    for name, measured, wanted, met in check_targets(report):
        op = ">=" if "throughput" in name else "<="
        lines.append(f"target {name}: {measured:.3f} (want {op} {wanted:.2f}) {'MET' if met else 'NOT MET'}")
    return "\n".join(lines)


def _sizes(sizes: list[list[int]]) -> str:
    return ", ".join(f"{w}x{h}" for w, h in sizes)


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """``<name>.json`` and ``<name>.png``: CDFs of TTFT and e2e latency per deployment and rate."""
    plt = pyplot()
    json_path, png_path = write_json(report, out_dir, name)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"split": "-", "inproc": "--", "grpc": "--", "http": "-"}
    for deployment, results in report["deployments"].items():
        for i, r in enumerate(results):
            for ax, metric in zip(axes, ("ttft", "e2e"), strict=True):
                values = np.sort(r["samples_ms"][metric])
                if len(values):
                    ax.plot(
                        values,
                        np.arange(1, len(values) + 1) / len(values),
                        styles.get(deployment, "-"),
                        color=f"C{i}",
                        label=f"{deployment}, rate {r['rate']}",
                    )
    for ax, title in zip(axes, ("time to first token", "end-to-end latency"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=8)
    rs = report["request_set"]
    fig.suptitle(f"{Path(report['model']).name}: {rs['num_requests']} requests, {rs['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
