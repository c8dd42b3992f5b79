"""``splitserve bench throughput``: offline throughput of splitserve against transformers on one request set.

Backends run one after another in this process, on the same checkpoint, requests and torch thread count:
- ``splitserve``: ``LLM.generate`` with the core in-process (frontend work included: detokenization, outputs);
- ``hf-generate``: transformers ``generate`` in static, left-padded batches of ``--hf-batch-size`` requests in
  request order;
- ``hf-generate-batch``: transformers ``generate_batch`` (continuous batching over a paged KV cache).
All decode greedily and generate exactly ``output_len`` tokens per request (EOS ignored). Model FLOP utilization
(MFU) is model FLOPs (``workload.ModelFlops``) per second over the fp32 (or bf16) ``torch.mm`` peak measured in
the same run.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.workload import Machine, ModelFlops, RequestSet, matmul_peak_flops, pyplot, write_json

logger = logging.getLogger(__name__)

BACKENDS = ("splitserve", "hf-generate", "hf-generate-batch")


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
    the core's Prometheus metrics and a span per request (exported in memory), as a traced server runs."""
    from frontend_svc import LLM, SamplingParams
    from frontend_svc.inproc_client import InprocClient
    from frontend_svc.input_processor import TokensPrompt

    llm = LLM(str(model), dtype=dtype, **core_config)
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
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        hooks = hook_s[0]
        info = engine.engine_info
        client = engine.engine_core
        if not isinstance(client, InprocClient):
            raise TypeError(f"the core must run in this process, not behind {type(client).__name__}")
        core = client.engine_core  # the in-process EngineCore
        kv_bytes = sum(t.numel() * t.element_size() for t in core.model_runner.kv_caches)
        facts = {
            "num_kv_blocks": info.num_kv_blocks,
            "block_size": info.block_size,
            "kv_cache_tokens": info.kv_cache_tokens,
            "kv_cache_bytes": kv_bytes,
            "kv_bytes_per_token": kv_bytes // (info.num_kv_blocks * info.block_size),
            "num_preemptions": engine.num_preemptions - preemptions_before,
            "attention_backend": core.model_runner.model.model.layers[0].self_attn.backend.name,
        }
        if observed:
            facts["observability_hook_s"] = hooks
        return wall, [list(o.outputs[0].token_ids) for o in outputs], facts
    finally:
        llm.close()
        if provider is not None:
            provider.shutdown()


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


def observability_cost(model: Path, requests: RequestSet, repeats: int) -> dict[str, Any]:
    """splitserve float32 with observability off (the default: no tracing, no metrics) and on, ``repeats`` runs
    each, alternating. The ratio of medians is what turning it on costs; off, the engine makes no call into it."""
    off: list[float] = []
    on: list[float] = []
    hook_fraction: list[float] = []  # of each "on" run's wall time, spent in the engine's observability hooks
    for _ in range(repeats):
        for observed, tok_s in ((False, off), (True, on)):
            wall, outputs, facts = run_splitserve(model, requests, "float32", observed=observed)
            tok_s.append(sum(len(o) for o in outputs) / wall)
            if observed:
                hook_fraction.append(facts["observability_hook_s"] / wall)
            gc.collect()
    median_off, median_on = sorted(off)[len(off) // 2], sorted(on)[len(on) // 2]
    return {"off_tok_s": off, "on_tok_s": on, "on_over_off": median_on / median_off, "hook_fraction": hook_fraction}


def _load_hf(model: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as ignore_eos
    return hf.eval()


def _hf_config(output_len: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)


def run_hf_generate(model: Path, requests: RequestSet, dtype: str, batch_size: int) -> tuple[float, list[list[int]]]:
    """transformers ``generate`` over static batches, left-padded with id 0 and masked."""
    import torch

    hf = _load_hf(model, dtype)

    def generate(prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=_hf_config(max_new_tokens))
        return out[:, width:].tolist()

    generate(requests.prompts[:2], 4)
    start = time.perf_counter()
    outputs: list[list[int]] = []
    for i in range(0, len(requests.prompts), batch_size):
        outputs += generate(requests.prompts[i : i + batch_size], requests.output_len)
    return time.perf_counter() - start, outputs


def run_hf_generate_batch(model: Path, requests: RequestSet, dtype: str) -> tuple[float, list[list[int]]]:
    """transformers ``generate_batch``: its continuous batching with paged attention."""
    import torch

    hf = _load_hf(model, dtype)
    with torch.inference_mode():
        hf.generate_batch(requests.prompts[:2], generation_config=_hf_config(4), progress_bar=False)
        start = time.perf_counter()
        # warmup=False: the call above already ran transformers' warm-up, which is not part of the work
        results = hf.generate_batch(
            requests.prompts, generation_config=_hf_config(requests.output_len), progress_bar=False, warmup=False
        )
        wall = time.perf_counter() - start
    # generate_batch names requests req_<i> in input order
    outputs = [list(results[f"req_{i}"].generated_tokens) for i in range(len(requests.prompts))]
    return wall, outputs


def bfloat16_logprob_drift(model: Path, requests: RequestSet, num_requests: int = 8) -> dict[str, float]:
    """How far bfloat16 logprobs are from float32's: prompt logprobs (each prompt token given its prefix, the
    same tokens for both dtypes, so no divergence compounds) of the first ``num_requests`` prompts, as the max,
    mean and 99th percentile of the absolute difference in nats."""
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
    for dtype in ("float32", "bfloat16"):
        with LLM(str(model), dtype=dtype) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        per_dtype.append([logprob for output in outputs for logprob in token_logprobs(output)])
    diff = np.abs(np.asarray(per_dtype[0]) - np.asarray(per_dtype[1]))
    return {
        "positions": len(diff),
        "max_abs_nats": float(diff.max()),
        "mean_abs_nats": float(diff.mean()),
        "p99_abs_nats": float(np.percentile(diff, 99)),
    }


def run(
    model: Path,
    requests: RequestSet,
    backends: list[str],
    dtypes: list[str],
    hf_batch_size: int = 16,
    preemption_kv_fraction: float | None = 0.25,
    observability_repeats: int = 3,
) -> dict[str, Any]:
    """Every backend in ``backends`` (splitserve in each of ``dtypes``, transformers in float32), then
    splitserve float32 under a KV budget of ``preemption_kv_fraction`` of what the whole set needs at once,
    then ``observability_cost`` (0 repeats: skipped). Returns the report ``write_report`` saves."""
    import torch

    flops = ModelFlops.from_checkpoint(model)
    peaks = {dt: matmul_peak_flops(dt) for dt in sorted({"float32", *dtypes})}
    logger.info("matmul peak: %s", ", ".join(f"{dt} {p / 1e9:.0f} GFLOP/s" for dt, p in peaks.items()))
    results: list[BackendResult] = []
    for backend in backends:
        for dtype in dtypes if backend == "splitserve" else ["float32"]:
            logger.info("running %s (%s) on %d requests", backend, dtype, len(requests.prompts))
            if backend == "splitserve":
                wall, outputs, facts = run_splitserve(model, requests, dtype)
                results.append(
                    _result(
                        backend, dtype, f"splitserve {dtype}", requests, outputs, wall, flops, peaks[dtype], **facts
                    )
                )
            elif backend == "hf-generate":
                wall, outputs = run_hf_generate(model, requests, dtype, hf_batch_size)
                label = f"transformers generate (batch {hf_batch_size})"
                results.append(
                    _result(
                        backend, dtype, label, requests, outputs, wall, flops, peaks[dtype], batch_size=hf_batch_size
                    )
                )
            elif backend == "hf-generate-batch":
                wall, outputs = run_hf_generate_batch(model, requests, dtype)
                results.append(
                    _result(backend, dtype, "transformers generate_batch", requests, outputs, wall, flops, peaks[dtype])
                )
            else:
                raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
            gc.collect()
            logger.info("  %.1f output tok/s, MFU %.1f%%", results[-1].output_tok_s, 100 * results[-1].mfu)
    if preemption_kv_fraction and "splitserve" in backends:
        block_size = 16
        need = sum(-(-(n + requests.output_len) // block_size) for n in requests.prompt_lens)
        biggest = max(-(-(n + requests.output_len) // block_size) for n in requests.prompt_lens)
        num_blocks = max(biggest + 1, int(need * preemption_kv_fraction)) + 1
        logger.info(
            "running splitserve float32 with %d KV blocks (%.0f%% of the set's need)",
            num_blocks,
            100 * preemption_kv_fraction,
        )
        wall, outputs, facts = run_splitserve(model, requests, "float32", num_kv_blocks=num_blocks)
        label = f"splitserve float32, KV {100 * preemption_kv_fraction:.0f}%"
        results.append(
            _result(
                "splitserve",
                "float32",
                label,
                requests,
                outputs,
                wall,
                flops,
                peaks["float32"],
                kv_fraction=preemption_kv_fraction,
                **facts,
            )
        )
    observability = None
    if observability_repeats and "splitserve" in backends:
        logger.info("running splitserve float32 with observability off and on, %d times each", observability_repeats)
        observability = observability_cost(model, requests, observability_repeats)
        logger.info("  observability on / off: %.3f", observability["on_over_off"])
    # The peak again, after the runs: a shared machine's speed drifts; MFU is over the higher of the two.
    peaks_after = {dt: matmul_peak_flops(dt) for dt in peaks}
    peak = {dt: max(peaks[dt], peaks_after[dt]) for dt in peaks}
    for r in results:
        r.mfu_lm_head_every_token *= peaks[r.dtype] / peak[r.dtype]
        r.mfu *= peaks[r.dtype] / peak[r.dtype]
    _compare(results)
    drift = None
    if "splitserve" in backends and "bfloat16" in dtypes:
        drift = bfloat16_logprob_drift(model, requests)
        logger.info("bfloat16 prompt logprobs against float32: %s", drift)
    return {
        "benchmark": "throughput",
        "model": str(model),
        "machine": Machine.current().to_dict(),
        "torch_threads": torch.get_num_threads(),
        "request_set": requests.summary(),
        "model_flops": asdict(flops),
        "matmul_peak_gflops": {dt: p / 1e9 for dt, p in peak.items()},
        "matmul_peak_gflops_before_after": {dt: [peaks[dt] / 1e9, peaks_after[dt] / 1e9] for dt in peaks},
        "results": [_public(r) for r in results],
        "bfloat16_logprob_drift": drift,
        "observability_cost": observability,
    }


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


TARGETS = {
    "mfu": 0.40,
    "vs transformers generate_batch": 2.5,
    "vs transformers generate": 3.0,
    "bfloat16 over float32": 1.5,
}


def check_targets(report: dict[str, Any]) -> list[tuple[str, float, float, bool]]:
    """(target, measured, wanted, met) for each target the report can speak to."""
    rows = []
    by_label = {r["label"]: r for r in report["results"]}
    fp32 = by_label.get("splitserve float32")
    bf16 = by_label.get("splitserve bfloat16")
    if fp32:
        rows.append(("splitserve float32 MFU", fp32["mfu"], TARGETS["mfu"], fp32["mfu"] >= TARGETS["mfu"]))
        for label, ratio in fp32["ratios"].items():
            key = "vs transformers generate_batch" if "generate_batch" in label else "vs transformers generate"
            rows.append((f"splitserve float32 {key}", ratio, TARGETS[key], ratio >= TARGETS[key]))
    if fp32 and bf16:
        ratio = bf16["output_tok_s"] / fp32["output_tok_s"]
        rows.append(("splitserve bfloat16 over float32", ratio, TARGETS["bfloat16 over float32"], ratio >= 1.5))
    return rows


def format_report(report: dict[str, Any]) -> str:
    peak, rs = report["matmul_peak_gflops"], report["request_set"]
    lines = [
        f"model {report['model']}, {rs['num_requests']} requests, prompt mean {rs['prompt_len_mean']:.0f} tokens, "
        f"{rs['output_len']} output tokens each",
        "matmul peak: " + ", ".join(f"{dt} {g:.0f} GFLOP/s" for dt, g in peak.items()),
        f"{'backend':42} {'wall s':>8} {'out tok/s':>10} {'total tok/s':>12} {'MFU':>6} {'MFU*':>6} {'match':>6}  "
        "ratios",
    ]
    for r in report["results"]:
        ratios = ", ".join(f"{v:.2f}x {k}" for k, v in r["ratios"].items())
        match = "" if r["exact_match"] is None else f"{100 * r['exact_match']:.0f}%"
        lines.append(
            f"{r['label']:42} {r['wall_s']:8.2f} {r['output_tok_s']:10.1f} {r['total_tok_s']:12.1f} "
            f"{100 * r['mfu']:5.1f}% {100 * r['mfu_lm_head_every_token']:5.1f}% {match:>6}  {ratios}"
        )
    lines.append("MFU*: the LM head counted for prompt tokens too (work an engine that skips prompt logits never does)")
    drift = report.get("bfloat16_logprob_drift")
    if drift:
        lines.append(
            f"bfloat16 prompt logprobs vs float32 over {drift['positions']} positions: max |diff| "
            f"{drift['max_abs_nats']:.3f}, p99 {drift['p99_abs_nats']:.3f}, mean {drift['mean_abs_nats']:.4f} nats"
        )
    cost = report.get("observability_cost")
    if cost:
        lines.append(
            "observability (core metrics + a span per request) on / off: "
            f"{cost['on_over_off']:.3f} (median of {len(cost['on_tok_s'])} alternating runs each; off: "
            + ", ".join(f"{x:.0f}" for x in cost["off_tok_s"])
            + " tok/s; on: "
            + ", ".join(f"{x:.0f}" for x in cost["on_tok_s"])
            + " tok/s)"
        )
        lines.append(
            "engine time inside the observability hooks, per observed run: "
            + ", ".join(f"{100 * x:.2f}%" for x in cost["hook_fraction"])
        )
    for name, measured, wanted, met in check_targets(report):
        lines.append(f"target {name}: {measured:.2f} (want >= {wanted:.2f}) {'MET' if met else 'NOT MET'}")
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """``<name>.json`` and ``<name>.png`` (output tok/s and MFU per backend) in ``out_dir``."""
    plt = pyplot()
    json_path, png_path = write_json(report, out_dir, name)
    results = report["results"]
    labels = [r["label"] for r in results]
    fig, (ax_tok, ax_mfu) = plt.subplots(1, 2, figsize=(12, 0.6 * len(labels) + 2), sharey=True)
    ax_tok.barh(labels, [r["output_tok_s"] for r in results], color="tab:blue")
    ax_tok.set_xlabel("output tokens / s")
    ax_tok.invert_yaxis()
    ax_mfu.barh(labels, [100 * r["mfu"] for r in results], color="tab:orange")
    ax_mfu.axvline(100 * TARGETS["mfu"], color="gray", linestyle="--", label="40% target")
    ax_mfu.set_xlabel("MFU, % of measured matmul peak")
    ax_mfu.legend(loc="lower right")
    rs = report["request_set"]
    fig.suptitle(
        f"{Path(report['model']).name}: {rs['num_requests']} requests, mean prompt {rs['prompt_len_mean']:.0f}, "
        f"{rs['output_len']} output tokens; {report['torch_threads']} threads"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
