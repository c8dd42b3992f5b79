"""``splitserve bench throughput``: offline throughput of splitserve against transformers on one request set.

Backends run one after another in this process, on the same checkpoint, requests and torch thread count:
- ``splitserve``: ``LLM.generate`` with the core in-process (frontend work included: detokenization, outputs);
- ``hf-generate``: transformers ``generate`` in static, left-padded batches of ``--hf-batch-size`` requests in
  request order;
- ``hf-generate-batch``: transformers ``generate_batch`` (continuous batching over a paged KV cache);
- ``ctranslate2``, ``llama.cpp``: the CPU engines users pick instead, each converted from the same checkpoint
  (``peers``), in float32 and int8 (CTranslate2) and f32, f16 and q8_0 (llama.cpp); skipped, with the reason in the
  report, when their packages (the ``bench`` extra) are not installed.
All decode greedily and generate exactly ``output_len`` tokens per request (EOS ignored). Model FLOP utilization
(MFU) is model FLOPs (``workload.ModelFlops``) per second over the ``torch.mm`` peak of the same dtype on the same
device, measured in the same run (``device_limits.matmul_peak``).

``--device cuda`` runs every backend on the GPU, transformers in the dtype splitserve runs in (bfloat16 by
default), and adds the single-request inter-token latency against the weight-read bound (``single_request``);
the targets are then the issue's GPU ones (``throughput_report.GPU_TARGETS``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import peers, single_request
from benchmarks.device_limits import copy_bandwidth, matmul_peak
from benchmarks.hf_backends import run_hf_generate, run_hf_generate_batch
from benchmarks.workload import Machine, ModelFlops, RequestSet, matmul_dtype, splitserve_precision
from splitserve.base import cpu_threads

logger = logging.getLogger(__name__)

BACKENDS = ("splitserve", "hf-generate", "hf-generate-batch", *peers.PEERS)


@dataclass(frozen=True)
class Settings:
    """What ``run`` runs; ``for_device`` fills the device's defaults."""

    backends: tuple[str, ...] = BACKENDS
    # splitserve's (benchmarks.workload.splitserve_precision)
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "int8")
    # Runs of each splitserve precision, interleaved (``_splitserve_rounds``), a shared machine's speed moving by
    # 20-50% between minutes (docs/benchmarks.md, "int8's KV cache bfloat16 by default")
    rounds: int = 1
    device: str = "cpu"
    hf_dtype: str = "float32"  # transformers'
    hf_batch_size: int = 16  # static batch of transformers generate
    preemption_kv_fraction: float | None = 0.25  # also run splitserve float32 under this KV budget; None: skip
    observability_repeats: int = 3  # 0: skip
    single_request_output_len: int = 0  # single-request ITL against the weight-read bound; 0: skip
    core_config: dict[str, Any] = field(default_factory=dict)  # more CoreConfig fields for splitserve
    matmul_sizes: tuple[int, ...] | None = None  # None: device_limits.DEFAULT_MATMUL_SIZES
    copy_bytes: int | None = None  # None: device_limits.DEFAULT_COPY_BYTES
    num_threads: int | None = None  # CPU threads of every backend; None: the cores this process may use
    contend: int = 0  # busy competitor processes for the contention runs (``contention``); 0: skip
    contend_num_prompts: int = 16  # the set's first requests, for each contention run
    contend_timeout_s: float = 600.0  # a contention run still going then is stopped and reported as such

    def __post_init__(self) -> None:
        if "splitserve" in self.backends and not self.dtypes:
            raise ValueError("splitserve needs at least one precision in dtypes")
        if len(set(self.dtypes)) != len(self.dtypes):
            raise ValueError(f"dtypes names a precision more than once: {','.join(self.dtypes)}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {self.rounds}")

    @classmethod
    def for_device(cls, device: str, **overrides: Any) -> Settings:
        """CPU: the defaults above. CUDA: splitserve and transformers in bfloat16, static batches of 64, the
        single-request ITL over 128 tokens, no preemption or observability runs (CPU questions). ``overrides``
        (fields, None values ignored) win."""
        defaults: dict[str, Any] = {"device": device}
        if device == "cuda":
            defaults |= {
                "dtypes": ("bfloat16",),
                "hf_dtype": "bfloat16",
                "hf_batch_size": 64,
                "preemption_kv_fraction": None,
                "observability_repeats": 0,
                "single_request_output_len": 128,
            }
        return cls(**(defaults | {k: v for k, v in overrides.items() if v is not None}))


@dataclass
class BackendResult:
    backend: str
    dtype: str
    label: str  # backend and setting, for tables and charts
    requests: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    model_tflop: float
    mfu: float  # model FLOP/s over the matmul peak of the same dtype
    mfu_lm_head_every_token: float  # the same with the LM head counted for prompt tokens too
    ratios: dict[str, float] = field(default_factory=dict)  # output tok/s over each transformers backend's
    exact_match: float | None = None  # fraction of requests whose tokens equal splitserve float32's
    extra: dict[str, Any] = field(default_factory=dict)


def _result(
    backend: str,
    dtype: str,
    label: str,
    requests: RequestSet,
    outputs: list[list[int]],
    wall_s: float,
    flops: ModelFlops,
    peak: float,
    **extra: Any,
) -> BackendResult:
    num_out = sum(len(o) for o in outputs)
    if num_out != len(requests.prompts) * requests.output_len:
        raise RuntimeError(
            f"{label} generated {num_out} tokens, expected {len(requests.prompts)} x {requests.output_len}"
        )
    input_tokens = sum(requests.prompt_lens)
    model_flops = flops.total(requests)
    return BackendResult(
        backend=backend,
        dtype=dtype,
        label=label,
        requests=len(requests.prompts),
        input_tokens=input_tokens,
        output_tokens=num_out,
        wall_s=wall_s,
        output_tok_s=num_out / wall_s,
        total_tok_s=(num_out + input_tokens) / wall_s,
        model_tflop=model_flops / 1e12,
        mfu=model_flops / wall_s / peak,
        mfu_lm_head_every_token=flops.total(requests, lm_head_on_every_token=True) / wall_s / peak,
        extra={"outputs": outputs, **extra},
    )


def run_splitserve(
    model: Path, requests: RequestSet, dtype: str, observed: bool = False, **core_config: Any
) -> tuple[float, list[list[int]], dict]:
    """Wall seconds, token ids per request, and engine facts, after a two-request warm-up. ``observed``: with
    the core's Prometheus metrics and a span per request (exported in memory), as a traced server runs.
    ``core_config``: more ``CoreConfig`` fields (``device``, ``num_kv_blocks``, ...).

    The timed run has the heap built so far left out of garbage collection (``startup_heap_frozen``), as both
    servers have it once loaded (``splitserve.base.server_lifecycle``): in this process, holding the command's
    imports, full collections otherwise walked some 330,000 objects during the run (0.15-0.18 s of collections,
    5-15% of the float32 run's time; docs/benchmarks.md)."""
    from frontend_svc import LLM, SamplingParams
    from frontend_svc.inproc_client import InprocClient
    from frontend_svc.input_processor import TokensPrompt

    llm = LLM(str(model), **splitserve_precision(dtype), **core_config)
    provider = None
    hook_s = [0.0]  # engine-thread seconds inside the observability hooks
    try:
        if observed:
            provider = _observe(llm, str(model), hook_s)
        params = SamplingParams(max_tokens=requests.output_len, ignore_eos=True, temperature=0.0)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in requests.prompts]
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), use_tqdm=False)
        engine = llm.llm_engine
        preemptions_before = engine.num_preemptions
        hook_s[0] = 0.0
        with startup_heap_frozen():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
        hooks = hook_s[0]
        info = engine.engine_info
        client = engine.engine_core
        if not isinstance(client, InprocClient):
            raise TypeError(f"the core must run in this process, not behind {type(client).__name__}")
        core = client.engine_core  # the in-process EngineCore
        facts = {
            "num_kv_blocks": info.num_kv_blocks,
            "block_size": info.block_size,
            "kv_cache_tokens": info.kv_cache_tokens,
            **_runner_facts(core, info.num_kv_blocks * info.block_size),
            "num_preemptions": engine.num_preemptions - preemptions_before,
            "device": core.config.device,
            "enforce_eager": core.config.enforce_eager,
            "max_num_seqs": core.config.max_num_seqs,
        }
        if observed:
            facts["observability_hook_s"] = hooks
        return wall, [list(o.outputs[0].token_ids) for o in outputs], facts
    finally:
        llm.close()
        if provider is not None:
            provider.shutdown()


@contextlib.contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Inside: every object alive on entry is left out of garbage collection (``gc.collect()``, then
    ``gc.freeze()``), as the servers leave their startup heap once loaded; on exit they are given back
    (``gc.unfreeze()``), so that what dies later is collected."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _runner_facts(core: Any, num_slots: int) -> dict[str, Any]:
    """The KV cache's bytes (and per token slot) and the attention backend's name, read off the in-process core's
    model runner; None where a runner keeps them elsewhere, so that a run of minutes never fails on a fact."""
    runner = core.model_runner
    caches = getattr(runner, "kv_caches", None)
    kv_bytes = None if caches is None else sum(t.numel() * t.element_size() for t in caches)
    try:
        backend = runner.model.model.layers[0].self_attn.backend.name
    except AttributeError:
        backend = None
    return {
        "kv_cache_dtype": None if not caches else str(caches[0].dtype).removeprefix("torch."),
        "kv_cache_bytes": kv_bytes,
        "kv_bytes_per_token": None if kv_bytes is None else kv_bytes // num_slots,
        "attention_backend": backend,
    }


def _observe(llm: Any, model: str, hook_s: list[float]) -> Any:
    """Turn on the in-process core's metrics and request spans (to an in-memory exporter); returns the tracer
    provider. The time the engine spends in the hooks (add, step, abort) is added to ``hook_s[0]``."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from core_svc.observability import observe_engine_core
    from splitserve.base import metrics, tracing

    provider = tracing.init_tracer_provider("splitserve-bench", exporter=InMemorySpanExporter())
    core = llm.llm_engine.engine_core.engine_core
    observe_engine_core(core, model, metrics.make_registry(), provider)
    tracker = core.stats_tracker
    for name in ("on_add", "on_step", "on_abort"):
        method = getattr(tracker, name)

        def timed(*args: Any, _method: Any = method) -> Any:
            start = time.perf_counter()
            try:
                return _method(*args)
            finally:
                hook_s[0] += time.perf_counter() - start

        setattr(tracker, name, timed)
    return provider


def observability_cost(
    model: Path, requests: RequestSet, repeats: int, core_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """splitserve float32 with observability off (the default: no tracing, no metrics) and on, ``repeats`` runs
    each, alternating. The ratio of medians is what turning it on costs; off, the engine makes no call into it.
    ``core_config``: more ``CoreConfig`` fields of every run (``device``, ``num_threads``, ...)."""
    off: list[float] = []
    on: list[float] = []
    hook_fraction: list[float] = []  # of each "on" run's wall time, spent in the engine's observability hooks
    for _ in range(repeats):
        for observed, tok_s in ((False, off), (True, on)):
            wall, outputs, facts = run_splitserve(model, requests, "float32", observed=observed, **(core_config or {}))
            tok_s.append(sum(len(o) for o in outputs) / wall)
            if observed:
                hook_fraction.append(facts["observability_hook_s"] / wall)
            gc.collect()
    median_off, median_on = sorted(off)[len(off) // 2], sorted(on)[len(on) // 2]
    return {"off_tok_s": off, "on_tok_s": on, "on_over_off": median_on / median_off, "hook_fraction": hook_fraction}


def _release(device: str) -> None:
    """Free what the last backend left: Python garbage and, on CUDA, the caching allocator's blocks, so the next
    backend sizes its KV cache from the whole GPU."""
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _peak_dtype(precision: str, device: str) -> str:
    """The dtype whose matmul peak splitserve's ``precision``'s MFU is over (``matmul_dtype``), as the core computes
    it on ``device``: float32 for a 16-bit dtype on a CPU without arithmetic in it, where the core loads float32
    (``core_svc.cpu_dtype``; timing the emulated 16-bit product for a peak took over 20 minutes held to AVX2).
    transformers' runs are over the peak of the dtype they are asked for, which they compute in."""
    import torch

    from core_svc.cpu_dtype import cpu_compute_dtype, cpu_flags

    dtype = matmul_dtype(precision)
    if torch.device(device).type != "cpu":
        return dtype
    computed, _ = cpu_compute_dtype(getattr(torch, dtype), cpu_flags())
    return str(computed).removeprefix("torch.")


def logprob_drift(
    model: Path, requests: RequestSet, precision: str, num_requests: int = 8, device: str = "cpu"
) -> dict[str, float]:
    """How far splitserve's logprobs in ``precision`` (bfloat16, int8: ``splitserve_precision``) are from
    float32's: prompt logprobs (each prompt token given its prefix, the same tokens in both, so no divergence
    compounds) of the first ``num_requests`` prompts, as the max, mean and 99th percentile of the absolute
    difference in nats."""
    import numpy as np

    from frontend_svc import LLM, SamplingParams
    from frontend_svc.input_processor import TokensPrompt
    from frontend_svc.outputs import RequestOutput

    def token_logprobs(output: RequestOutput) -> list[float]:
        """Each prompt token's logprob given its prefix (the first token has none)."""
        positions = output.prompt_logprobs or []  # asked for: a list as long as the prompt
        pairs = zip(output.prompt_token_ids[1:], positions[1:], strict=True)
        return [position[token].logprob for token, position in pairs if position is not None]

    prompts = [TokensPrompt(prompt_token_ids=p) for p in requests.prompts[:num_requests]]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    per_dtype = []
    for name in ("float32", precision):
        with LLM(str(model), device=device, **splitserve_precision(name)) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        per_dtype.append([logprob for output in outputs for logprob in token_logprobs(output)])
    diff = np.abs(np.asarray(per_dtype[0]) - np.asarray(per_dtype[1]))
    return {
        "positions": len(diff),
        "max_abs_nats": float(diff.max()),
        "mean_abs_nats": float(diff.mean()),
        "p99_abs_nats": float(np.percentile(diff, 99)),
    }


def run(model: Path, requests: RequestSet, settings: Settings) -> dict[str, Any]:
    """Every backend in ``settings.backends`` (splitserve in each of its dtypes, transformers in ``hf_dtype``) on
    ``settings.device``; then splitserve float32 under a KV budget of ``preemption_kv_fraction`` of what the
    whole set needs at once, ``observability_cost``, and the single-request ITL, each when asked for. Returns the
    report ``write_report`` saves.

    Raises:
        ValueError: an unknown backend.
        DeviceUnavailableError: device cuda where torch cannot use a GPU (``core_svc.device.check_device``).
        RuntimeError: a backend generated other than ``output_len`` tokens per request.
    """
    import torch

    from core_svc.device import check_device

    device = settings.device
    check_device(device)  # --device cuda where torch cannot use a GPU: the reason and its fix, before any work
    load_before = list(os.getloadavg())  # the machine is shared: how busy it was, beside the results
    flops = ModelFlops.from_checkpoint(model)
    num_threads = cpu_threads.detect_threads(settings.num_threads).num_threads
    # Before the peak: MFU's denominator is the peak of the threads every backend runs on (on this project's 2-vCPU
    # machine two threads measured about 2x one thread's float32 peak: 244-300 against 117-141 GFLOP/s)
    torch.set_num_threads(num_threads)  # transformers' too
    hf = any(b.startswith("hf-") for b in settings.backends)  # transformers computes in hf_dtype as asked

    def peak_key(backend: str, precision: str) -> str:
        return precision if backend.startswith("hf-") else _peak_dtype(precision, device)

    peak_dtypes = sorted(
        {_peak_dtype(d, device) for d in ("float32", *settings.dtypes)} | ({settings.hf_dtype} if hf else set())
    )
    peaks = {dt: matmul_peak(dt, device, settings.matmul_sizes).flops_per_s for dt in peak_dtypes}
    logger.info(
        "matmul peak on %d threads: %s",
        num_threads,
        ", ".join(f"{dt} {p / 1e9:.0f} GFLOP/s" for dt, p in peaks.items()),
    )
    core_config = {"device": device, "num_threads": num_threads, **settings.core_config}
    results: list[BackendResult] = []
    skipped: dict[str, str] = {}  # backend -> why it did not run
    for backend in settings.backends:
        if backend in peers.PEERS:
            reason = peers.missing_reason(backend)
            if reason is not None:
                logger.warning("skipping %s: %s", backend, reason)
                skipped[backend] = reason
            else:
                results += _peer_runs(model, requests, backend, num_threads, flops, peaks["float32"])
            continue
        if backend == "splitserve":
            dtype_peaks = {dtype: peaks[peak_key(backend, dtype)] for dtype in settings.dtypes}
            results += _splitserve_rounds(model, requests, settings, core_config, flops, dtype_peaks)
            continue
        if backend not in ("hf-generate", "hf-generate-batch"):
            raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
        dtype = settings.hf_dtype
        logger.info("running %s (%s) on %d requests on %s", backend, dtype, len(requests.prompts), device)
        dtype_peak = peaks[peak_key(backend, dtype)]
        if backend == "hf-generate":
            wall, outputs = run_hf_generate(model, requests, dtype, settings.hf_batch_size, device)
            label = f"transformers generate (batch {settings.hf_batch_size})"
            extra = {"batch_size": settings.hf_batch_size}
            results.append(_result(backend, dtype, label, requests, outputs, wall, flops, dtype_peak, **extra))
        else:
            wall, outputs = run_hf_generate_batch(model, requests, dtype, device)
            label = "transformers generate_batch"
            results.append(_result(backend, dtype, label, requests, outputs, wall, flops, dtype_peak))
        _release(device)
        logger.info("  %.1f output tok/s, MFU %.1f%%", results[-1].output_tok_s, 100 * results[-1].mfu)
    fraction = settings.preemption_kv_fraction
    if fraction and "splitserve" in settings.backends:
        results.append(_preemption_run(model, requests, fraction, flops, peaks["float32"], core_config))
        _release(device)
    observability = None
    if settings.observability_repeats and "splitserve" in settings.backends:
        logger.info(
            "running splitserve float32 with observability off and on, %d times each", settings.observability_repeats
        )
        observability = observability_cost(model, requests, settings.observability_repeats, core_config)
        logger.info("  observability on / off: %.3f", observability["on_over_off"])
    latency = None
    if settings.single_request_output_len:
        latency = _single_request(model, requests, settings, core_config)
    contended = None
    if settings.contend:
        from benchmarks import contention

        head = requests.head(settings.contend_num_prompts, requests.output_len)
        options = {"competitors": settings.contend, "num_threads": num_threads, "timeout_s": settings.contend_timeout_s}
        logger.info("running splitserve float32 alone and beside %d busy processes, per wait policy", settings.contend)
        contended = contention.run(model, head.prompts, head.output_len, options)
    # The peak again, after the runs: a shared machine's speed drifts; MFU is over the higher of the two.
    peaks_after = {dt: matmul_peak(dt, device, settings.matmul_sizes).flops_per_s for dt in peak_dtypes}
    peak = {dt: max(peaks[dt], peaks_after[dt]) for dt in peaks}
    for r in results:
        dtype = peak_key(r.backend, r.dtype)
        r.mfu_lm_head_every_token *= peaks[dtype] / peak[dtype]
        r.mfu *= peaks[dtype] / peak[dtype]
    _compare(results)
    drift: dict[str, dict[str, float]] = {}  # precision -> its logprob drift against float32
    if "splitserve" in settings.backends and "float32" in settings.dtypes:
        for precision in [d for d in settings.dtypes if d != "float32"]:
            drift[precision] = logprob_drift(model, requests, precision, device=device)
            logger.info("%s prompt logprobs against float32: %s", precision, drift[precision])
    return {
        "benchmark": "throughput",
        "model": str(model),
        "device": device,
        "machine": Machine.current(device).to_dict(),
        "torch_threads": torch.get_num_threads(),
        "num_threads": num_threads,
        "omp_wait_policy": cpu_threads.wait_policy_text(os.environ),
        "load_average_before_after": [load_before, list(os.getloadavg())],
        "request_set": requests.summary(),
        "model_flops": asdict(flops),
        "matmul_peak_gflops": {dt: p / 1e9 for dt, p in peak.items()},
        "matmul_peak_gflops_before_after": {dt: [peaks[dt] / 1e9, peaks_after[dt] / 1e9] for dt in peaks},
        "results": [_public(r) for r in results],
        "logprob_drift": drift,
        "observability_cost": observability,
        "single_request": latency,
        "skipped": skipped,
        "contention": contended,
    }


def round_order(n: int, r: int) -> list[int]:
    """The order of ``n`` runs in round ``r`` (0-based): a Williams design (E. J. Williams, "Experimental designs
    balanced for the estimation of residual effects of treatments", 1949), the sequence 0, 1, n-1, 2, n-2, ...
    shifted by r mod n, and for an odd n reversed in rounds n .. 2n-1 (and so on alternately). Over n rounds each
    run takes every position once and, for an even n, follows every other exactly once (for an odd n, over 2n
    rounds), so a machine's drift and one run's after-effects on the next fall on all of them alike."""
    base = [0]
    low, high = 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    order = [(b + r) % n for b in base]
    return order[::-1] if n % 2 and (r // n) % 2 else order


def _splitserve_rounds(
    model: Path,
    requests: RequestSet,
    settings: Settings,
    core_config: dict[str, Any],
    flops: ModelFlops,
    peaks: dict[str, float],
) -> list[BackendResult]:
    """splitserve in each of ``settings.dtypes``, ``settings.rounds`` times, a fresh engine each run (so no run
    finds the last one's prefix cache), the rounds in the orders of ``round_order``. Each precision's result is its
    median run by wall time (the slower of the two middle ones for an even count), over ``peaks[dtype]`` (FLOP/s);
    with more than one round ``extra["rounds_output_tok_s"]`` holds every run's output tok/s in round order, which
    the report pairs by round for the ratios between precisions (``throughput_report.check_targets``)."""
    dtypes, rounds = list(settings.dtypes), settings.rounds
    num_out = len(requests.prompts) * requests.output_len
    runs: dict[str, list[tuple[float, list[list[int]], dict]]] = {dtype: [] for dtype in dtypes}
    for r in range(rounds):
        for dtype in (dtypes[i] for i in round_order(len(dtypes), r)):
            logger.info(
                "running splitserve (%s) on %d requests on %s%s",
                dtype,
                len(requests.prompts),
                settings.device,
                f", round {r + 1} of {rounds}" if rounds > 1 else "",
            )
            runs[dtype].append(run_splitserve(model, requests, dtype, **core_config))
            _release(settings.device)
            logger.info("  %.1f output tok/s", num_out / runs[dtype][-1][0])
    results = []
    for dtype in dtypes:
        wall, outputs, facts = sorted(runs[dtype], key=lambda run: run[0])[len(runs[dtype]) // 2]
        if rounds > 1:
            facts = facts | {"rounds_output_tok_s": [num_out / run[0] for run in runs[dtype]]}
        label = f"splitserve {dtype}"
        results.append(_result("splitserve", dtype, label, requests, outputs, wall, flops, peaks[dtype], **facts))
        logger.info("%s: %.1f output tok/s, MFU %.1f%%", label, results[-1].output_tok_s, 100 * results[-1].mfu)
    return results


def _peer_runs(
    model: Path, requests: RequestSet, peer: str, num_threads: int, flops: ModelFlops, peak: float
) -> list[BackendResult]:
    """``peer`` in each of its precisions (``peers.PEER_PRECISIONS``) on the whole set, after a two-request warm-up;
    MFU over the float32 matmul peak (the peers' int8 and f16 paths compute in other units, so it is a ratio of
    work done, not of their own peak)."""
    results = []
    max_context = max(requests.prompt_lens) + requests.output_len + 1
    for precision in peers.PEER_PRECISIONS[peer]:
        logger.info("running %s %s on %d requests, %d threads", peer, precision, len(requests.prompts), num_threads)
        engine = peers.load_peer(model, peer, precision, num_threads, max_context)
        engine.generate_batch(requests.prompts[:2], 4)
        start = time.perf_counter()
        outputs = engine.generate_batch(requests.prompts, requests.output_len)
        wall = time.perf_counter() - start
        extra = {"num_threads": num_threads, "precision": precision, "note": engine.note}
        results.append(_result(peer, "float32", engine.label, requests, outputs, wall, flops, peak, **extra))
        del engine
        gc.collect()
        logger.info("  %.1f output tok/s", results[-1].output_tok_s)
    return results


def _preemption_run(
    model: Path, requests: RequestSet, fraction: float, flops: ModelFlops, peak: float, core_config: dict[str, Any]
) -> BackendResult:
    """splitserve float32 with a KV cache of ``fraction`` of what the whole set needs at once (at least what the
    longest request needs, plus the null block)."""
    block_size = 16
    need = sum(-(-(n + requests.output_len) // block_size) for n in requests.prompt_lens)
    biggest = max(-(-(n + requests.output_len) // block_size) for n in requests.prompt_lens)
    num_blocks = max(biggest + 1, int(need * fraction)) + 1
    logger.info("running splitserve float32 with %d KV blocks (%.0f%% of the set's need)", num_blocks, 100 * fraction)
    wall, outputs, facts = run_splitserve(model, requests, "float32", **core_config, num_kv_blocks=num_blocks)
    label = f"splitserve float32, KV {100 * fraction:.0f}%"
    return _result("splitserve", "float32", label, requests, outputs, wall, flops, peak, kv_fraction=fraction, **facts)


def _single_request(
    model: Path, requests: RequestSet, settings: Settings, core_config: dict[str, Any]
) -> dict[str, Any]:
    """The first request alone, ``single_request_output_len`` tokens, splitserve in its first dtype, against the
    weight-read bound from the device's copy bandwidth measured now."""
    bandwidth = copy_bandwidth(settings.device, settings.copy_bytes)
    logger.info("copy bandwidth (read + written): %.1f GB/s", bandwidth.bytes_per_s / 1e9)
    latency = single_request.measure(
        model,
        requests.prompts[0],
        settings.single_request_output_len,
        bandwidth,
        **splitserve_precision(settings.dtypes[0]),
        **core_config,
    )
    logger.info(
        "  single request: ITL median %.3f ms, weight-read bound %.3f ms (%.1fx)",
        latency.itl_median_ms,
        latency.weight_read_bound_ms,
        latency.itl_over_bound,
    )
    return {**latency.to_dict(), "copy_bandwidth": asdict(bandwidth)}


def _compare(results: list[BackendResult]) -> None:
    """Ratios to each transformers backend and token agreement with splitserve float32."""
    reference = next((r for r in results if r.backend == "splitserve" and r.dtype == "float32"), None)
    hf = [r for r in results if r.backend != "splitserve"]
    for r in results:
        r.ratios = {h.label: r.output_tok_s / h.output_tok_s for h in hf if h is not r}
        if reference is not None and r is not reference:
            pairs = zip(r.extra["outputs"], reference.extra["outputs"], strict=True)
            r.exact_match = sum(a == b for a, b in pairs) / r.requests


def _public(r: BackendResult) -> dict[str, Any]:
    data = asdict(r)
    data["extra"] = {k: v for k, v in r.extra.items() if k != "outputs"}
    return data
