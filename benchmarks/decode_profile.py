"""One request's decode step, timed and split: ms per output token and where a step's time goes, for this checkout
and, alternately in the same run, another source tree (the code before a change).

    python -m benchmarks.decode_profile [--baseline-source DIR] [--preset small] [--dtype float32] [--threads N]
        [--prompt-len 128] [--output-len 128] [--repeats 3] [--core-options JSON] [--name decode-profile-small]

Each run is a child process (this file run as a script, the tree under test first on ``PYTHONPATH``) with an
in-process ``EngineCore``: a warm-up request, then one greedy request (seeded random prompt ids, EOS ignored)
decoded twice. The first pass is timed plainly, per ``EngineCore.step`` (wall and process CPU time): its median
decode step is the ms per output token. The second pass wraps the step's parts in timers and gives the breakdown
of a decode step: scheduler, input preparation, the forward split into the decoder's linear layers, attention
(KV write included) and the rest of the forward (norms, RoPE, residuals, activation, embedding, Python), the LM
head (``compute_logits``), sampling, output building, the scheduler's update, and the rest of the step. Where a
step runs the whole decoder in one compiled call (``OneCallDecoder``, core_svc/models/one_call_decoder.py), that call
is the ``decoder`` part (its products, attention and norms together) and linear and attention are 0. The trees
run alternately, ``--repeats`` children each, so a shared machine's drift falls on both; the load average is
recorded with each child.

The child only calls what every tree since the CPU kernel has (``EngineCore``, ``ModelRunner`` and ``Scheduler``
methods by name), so an older checkout (``git archive <commit> | tar -x -C DIR``) can be the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

# Parts of a decode step, in the order they run; ms per step each (the breakdown's keys).
PHASES = (
    "schedule",
    "inputs",
    "decoder",
    "linear",
    "attention",
    "forward_rest",
    "lm_head",
    "sampling",
    "output",
    "update",
    "step_rest",
)


def _timed(table: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` adding its wall seconds to ``table[key]`` and its process CPU seconds to ``table["cpu:" + key]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.perf_counter() - start
            table["cpu:" + key] += time.process_time() - cpu

    return wrapper


def instrument(core: Any) -> dict[str, float]:
    """Wrap ``core``'s step parts (instance attributes, so only this core) in timers adding seconds into the
    returned table: ``step`` ``schedule`` ``update`` ``execute`` ``update_states`` ``prepare`` ``forward``
    ``decoder`` (the one-call decoder's) ``linear`` (the decoder's, not the LM head) ``attention`` ``lm_head``
    ``output``."""
    from core_svc.models.layers import Linear

    table: dict[str, float] = defaultdict(float)
    runner, model = core.model_runner, core.model_runner.model
    core.step = _timed(table, "step", core.step)
    core.scheduler.schedule = _timed(table, "schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = _timed(table, "update", core.scheduler.update_from_output)
    runner.execute_model = _timed(table, "execute", runner.execute_model)
    runner._update_states = _timed(table, "update_states", runner._update_states)
    runner._prepare_inputs = _timed(table, "prepare", runner._prepare_inputs)
    runner._make_output = _timed(table, "output", runner._make_output)
    model.compute_logits = _timed(table, "lm_head", model.compute_logits)
    model.forward = _timed(table, "forward", model.forward)
    inner: Any = getattr(model, "model", None)
    if hasattr(inner, "one_call_decoder"):  # trees since the one-call decoder (core_svc/models/one_call_decoder.py)
        one_call_decoder = inner.one_call_decoder

        def timed_decoder() -> Any:
            decoder = one_call_decoder()
            return None if decoder is None else _TimedDecoder(decoder, table)

        inner.one_call_decoder = timed_decoder
    backends = set()
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name != "lm_head":
            module.forward = _timed(table, "linear", module.forward)  # type: ignore[method-assign]  # this instance
        backend = getattr(module, "backend", None)
        if backend is not None and id(backend) not in backends:
            backends.add(id(backend))
            backend.forward = _timed(table, "attention", backend.forward)
    return table


class _TimedDecoder:
    """A ``OneCallDecoder`` (a torch script object, whose methods cannot be replaced) whose ``forward`` adds its time
    to the ``instrument`` table's ``decoder``."""

    def __init__(self, decoder: Any, table: dict[str, float]) -> None:
        self.forward = _timed(table, "decoder", decoder.forward)


def breakdown(table: dict[str, float], num_steps: int, prefix: str = "") -> dict[str, float]:
    """ms per step of each of ``PHASES`` from an ``instrument`` table summed over ``num_steps`` steps (its wall
    times; ``prefix`` "cpu:": its CPU times): the measured parts as they are, and by difference ``forward_rest``
    (forward less linear and attention), ``sampling`` (the runner's step less its other measured parts) and
    ``step_rest`` (the step less the scheduler and the runner)."""
    ms = {key.removeprefix(prefix): 1e3 * value / num_steps for key, value in table.items() if key.startswith(prefix)}

    def get(key: str) -> float:
        return ms.get(key, 0.0)

    return {
        "schedule": get("schedule"),
        "inputs": get("update_states") + get("prepare"),
        "decoder": get("decoder"),
        "linear": get("linear"),
        "attention": get("attention"),
        "forward_rest": get("forward") - get("decoder") - get("linear") - get("attention"),
        "lm_head": get("lm_head"),
        "sampling": get("execute")
        - get("update_states")
        - get("prepare")
        - get("forward")
        - get("lm_head")
        - get("output"),
        "output": get("output"),
        "update": get("update"),
        "step_rest": get("step") - get("schedule") - get("execute") - get("update"),
    }


def decode(
    core: Any, request_id: str, prompt: list[int], output_len: int, table: dict[str, float] | None = None
) -> tuple[list[int], list[float], float]:
    """Greedy-decode ``output_len`` tokens of ``prompt`` alone on ``core``: the tokens, each decode step's wall
    seconds (the prefill step left out) and their process CPU seconds together. ``table`` (an ``instrument``
    table) is cleared after the prefill step, so it holds the decode steps only."""
    from core_svc.request import Request
    from core_svc.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core.add_request(Request(request_id, list(prompt), params))
    tokens: list[int] = []
    step_s: list[float] = []
    cpu_s = 0.0
    while core.has_unfinished_requests():
        start, cpu = time.perf_counter(), time.process_time()
        outputs = core.step()
        if tokens:  # a decode step: the prefill step gave the first token
            step_s.append(time.perf_counter() - start)
            cpu_s += time.process_time() - cpu
        elif table is not None:
            table.clear()
        for output in outputs.outputs:
            tokens += output.new_token_ids
    return tokens, step_s, cpu_s


def measure(
    model: Path, dtype: str, prompt: list[int], output_len: int, core_options: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One child's measurement (see the module docstring) on an ``EngineCore`` of ``model`` in ``dtype``, with a
    KV cache of the blocks one request needs (its size does not change a decode step's work) and ``core_options``
    (more ``CoreConfig`` fields)."""
    import torch

    from core_svc.config import CoreConfig, DType
    from core_svc.engine_core import EngineCore

    load_before = os.getloadavg()
    num_kv_blocks = -(-(len(prompt) + output_len) // 16) + 1  # + the null block
    core = EngineCore(
        CoreConfig(
            model=str(model),
            dtype=cast(DType, dtype),
            block_size=16,
            num_kv_blocks=num_kv_blocks,
            **(core_options or {}),
        )
    )
    decode(core, "warmup", prompt[:16], 8)
    tokens, step_s, cpu_s = decode(core, "plain", prompt, output_len)
    table = instrument(core)
    profiled_tokens, profiled_step_s, _ = decode(core, "profiled", prompt, output_len, table)
    return {
        "ms_per_token": 1e3 * statistics.median(step_s),
        "ms_per_token_mean": 1e3 * statistics.fmean(step_s),
        "cpu_ms_per_token": 1e3 * cpu_s / len(step_s),
        "step_ms": [1e3 * s for s in step_s],
        "breakdown_ms": breakdown(table, len(profiled_step_s)),
        "breakdown_cpu_ms": breakdown(table, len(profiled_step_s), "cpu:"),
        "profiled_ms_per_token": 1e3 * statistics.median(profiled_step_s),
        "profiled_ms_per_token_mean": 1e3 * statistics.fmean(profiled_step_s),
        "tokens": tokens,
        "same_tokens_profiled": profiled_tokens == tokens,
        "torch_threads": torch.get_num_threads(),
        "load_average": [list(load_before), list(os.getloadavg())],
    }


def run_child(
    source: Path,
    model: Path,
    dtype: str,
    prompt: list[int],
    output_len: int,
    threads: int | None,
    core_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``measure`` in a fresh process importing ``source``'s code (this file run as a script, ``-P``: nothing
    but ``PYTHONPATH`` ahead of the standard library).

    Raises:
        RuntimeError: the child failed; its last output lines say why.
    """
    env = {**os.environ, "PYTHONPATH": str(source), "SPLITSERVE_LOG_STATS_INTERVAL": "0"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    request = json.dumps(
        {"model": str(model), "dtype": dtype, "prompt": prompt, "output_len": output_len, "core_options": core_options}
    )
    done = subprocess.run(
        [sys.executable, "-P", __file__, "--child"], input=request, capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"the measurement of {source} failed ({done.returncode}):\n{tail}")
    return dict(json.loads(done.stdout.splitlines()[-1]))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One tree's runs: the median over runs of ms per output token, CPU ms per token and each breakdown part
    (wall and CPU)."""
    return {
        "ms_per_token": statistics.median(r["ms_per_token"] for r in runs),
        "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in runs),
        **{
            key: {k: statistics.median(r[key][k] for r in runs) for k in PHASES}
            for key in ("breakdown_ms", "breakdown_cpu_ms")
        },
    }


def format_table(summaries: dict[str, dict[str, Any]]) -> list[str]:
    """Two lines per tree: ms per output token and CPU ms per token, then the breakdown's parts in ms per step,
    wall then CPU."""
    short = {"forward_rest": "fwd rest", "step_rest": "step rest", "lm_head": "LM head"}
    header = f"{'tree':<14}{'ms/token':>9}{'CPU ms':>8} {'per step':<9}" + "".join(
        f"{short.get(k, k):>10}" for k in PHASES
    )
    lines = [header]
    for label, s in summaries.items():
        for kind, key in (("wall", "breakdown_ms"), ("CPU", "breakdown_cpu_ms")):
            parts = "".join(f"{s[key][k]:>10.3f}" for k in PHASES)
            head = f"{label:<14}{s['ms_per_token']:>9.2f}{s['cpu_ms_per_token']:>8.2f}" if kind == "wall" else " " * 31
            lines.append(f"{head} {kind:<9}{parts}")
    return lines


def _child() -> None:
    request = json.loads(sys.stdin.read())
    result = measure(
        Path(request["model"]), request["dtype"], request["prompt"], request["output_len"], request["core_options"]
    )
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the trees alternately, print the table, write ``--out/<name>.json`` and ``.png``."""
    import numpy as np

    from benchmarks.workload import Machine, bench_model_path, default_tokenizer_dir, pyplot, write_json

    here = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bench one of --preset)")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--baseline-source", type=Path, default=None, help="a source tree to compare with")
    parser.add_argument("--baseline-label", default="before")
    parser.add_argument("--label", default="after", help="this checkout's label")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the children (default: unset)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="children per tree, alternating")
    parser.add_argument(
        "--core-options",
        type=json.loads,
        default=None,
        help="JSON object of CoreConfig fields for this checkout's runs only, e.g. '{\"dense_decode_weights\": true}'",
    )
    parser.add_argument("--name", default=None, help="file name stem (default: decode-profile-<preset>)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    model = args.model or bench_model_path("llama", args.preset, default_tokenizer_dir())
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    high = min(30000, vocab_size)  # llama2: past its byte and special tokens, within any vocabulary
    prompt = np.random.default_rng(0).integers(min(100, high // 2), high, args.prompt_len).tolist()
    trees = {args.label: here}
    if args.baseline_source is not None:
        trees = {args.baseline_label: args.baseline_source.resolve(), **trees}
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    for repeat in range(args.repeats):
        for label, source in trees.items():
            options = args.core_options if label == args.label else None
            result = run_child(source, model, args.dtype, prompt, args.output_len, args.threads, options)
            runs[label].append(result)
            load = result["load_average"][1][0]
            print(f"{label} run {repeat + 1}: {result['ms_per_token']:.2f} ms/token, load {load:.1f}", flush=True)
    summaries = {label: summarize(r) for label, r in runs.items()}
    same = all(
        r["tokens"] == runs[args.label][0]["tokens"] and r["same_tokens_profiled"] for rs in runs.values() for r in rs
    )
    loads = [x for rs in runs.values() for r in rs for pair in r["load_average"] for x in pair[:1]]
    machine = Machine.current()
    lines = [
        f"model {model}, {args.dtype}, one request: prompt {args.prompt_len}, {args.output_len} output tokens (greedy)",
        f"CPU {machine.cpu} ({os.cpu_count()} CPUs), torch threads {runs[args.label][0]['torch_threads']}, "
        f"1-min load average {min(loads):.1f} to {max(loads):.1f}",
        *format_table(summaries),
        f"tokens identical across trees and passes: {same}",
    ]
    print("\n".join(lines))
    report = {
        "benchmark": "decode_profile",
        "model": str(model),
        "dtype": args.dtype,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "threads": args.threads,
        "core_options": args.core_options,
        "trees": {label: str(source) for label, source in trees.items()},
        "summaries": summaries,
        "runs": runs,
        "same_tokens": same,
        "machine": machine.to_dict(),
        "summary": lines,
    }
    json_path, png_path = write_json(report, args.out, args.name or f"decode-profile-{args.preset}")
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(8, 4 + 0.8 * len(summaries)), sharex=True)
    for ax, (kind, key) in zip(axes, (("wall", "breakdown_ms"), ("CPU", "breakdown_cpu_ms")), strict=True):
        left = np.zeros(len(summaries))
        for phase in PHASES:
            widths = np.array([s[key][phase] for s in summaries.values()])
            ax.barh(list(summaries), widths, left=left, label=phase)
            left += widths
        ax.set_title(f"one request's decode step, {args.dtype}: {kind} ms per step (instrumented pass)", fontsize=9)
    axes[-1].legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(png_path)
    print(f"wrote {json_path} and {png_path}")
    return report


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _child()
    else:
        main()
