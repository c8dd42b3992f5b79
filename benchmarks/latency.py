"""``splitserve bench latency``: one request at a time, as a chat user feels it: time to first token (TTFT) and
milliseconds per output token, splitserve against transformers and the CPU peers (``peers``), in one run.

Every engine is loaded once, on the same checkpoint and thread count, and warmed up; then each repeat runs every
engine on every prompt length in turn (interleaved, so the shared machine's drift falls on all of them alike).
A request is a seeded prompt of exactly ``prompt_len`` random ordinary token ids, decoded greedily for
``output_len`` tokens (EOS ignored or suppressed). TTFT: from handing the prompt over to the first token id;
ms per output token: the gaps between consecutive tokens, ``(last - first) / (output_len - 1)``, i.e. decode only.
splitserve is timed at its in-process ``EngineCore`` (no detokenization), as the peers are at their token ids,
with prefix caching off: the repeats send the same prompts, and every engine prefills each one whole.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import peers
from benchmarks.workload import Machine, pyplot, splitserve_precision, write_json
from splitserve.base import cpu_threads

logger = logging.getLogger(__name__)

# issue 18: one request's ms per output token at most llama.cpp's at the same precision class.
# 16 bits against llama.cpp f16, int8 against its q8_0 (8-bit weights, activations quantized per block).
TARGETS = (
    ("splitserve float32", "llama.cpp f32"),
    ("splitserve float32-dense", "llama.cpp f32"),
    ("splitserve bfloat16", "llama.cpp f16"),
    ("splitserve bfloat16-dense", "llama.cpp f16"),
    ("splitserve int8", "llama.cpp q8_0"),
)

# One timed request: (ttft_s, seconds per output token after the first).
Timing = tuple[float, float]


@dataclass(frozen=True)
class Settings:
    prompt_lens: tuple[int, ...] = (128, 512)
    output_len: int = 128
    repeats: int = 5
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "int8")  # splitserve's (benchmarks.workload.splitserve_precision)
    engines: tuple[str, ...] = ("splitserve", "transformers", *peers.PEERS)
    num_threads: int = 1
    seed: int = 0
    # the peers' precisions to run (e.g. f32, f16, float32); None: all of each peer's (peers.PEER_PRECISIONS)
    peer_precisions: tuple[str, ...] | None = None


def prompts_for(tokenizer: Any, prompt_lens: tuple[int, ...], seed: int) -> dict[int, list[int]]:
    """A prompt of exactly n random ordinary (non-special) token ids for each n, from ``default_rng(seed)``."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = np.asarray([i for i in range(len(tokenizer)) if i not in special])
    return {n: rng.choice(vocab, size=n).tolist() for n in prompt_lens}


def timing_from_arrivals(start: float, arrivals: list[float]) -> Timing:
    """TTFT and decode seconds per token from the request's start and each token's arrival time.

    Raises:
        ValueError: fewer than two tokens (no decode gap).
    """
    if len(arrivals) < 2:
        raise ValueError(f"a decode time needs at least two tokens, got {len(arrivals)}")
    return arrivals[0] - start, (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)


def _splitserve(model: Path, dtype: str, num_threads: int, max_len: int) -> Callable[[list[int], int], Timing]:
    from benchmarks.single_request import decode_timing
    from core_svc.config import CoreConfig
    from core_svc.engine_core import EngineCore

    # A KV cache for one request, not the 1 GiB default: every engine of the run is loaded at once. No prefix
    # caching: each repeat sends the same prompt, and a cache hit would skip the prefill the peers all do.
    fields: dict[str, Any] = {
        **splitserve_precision(dtype),
        "num_threads": num_threads,
        "num_kv_blocks": max_len // 16 + 2,
        "enable_prefix_caching": False,
    }
    config = CoreConfig(model=str(model), **fields)  # validates dtype
    core = EngineCore(config)
    counter = itertools.count()

    def run(prompt: list[int], output_len: int) -> Timing:
        ttft, gaps = decode_timing(core, f"latency-{next(counter)}", prompt, output_len)
        return ttft, sum(gaps) / len(gaps)

    return run


def _transformers(model: Path) -> Callable[[list[int], int], Timing]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()

    class Arrivals(BaseStreamer):
        """The time of each ``put``: the first is the prompt, then one per generated token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(prompt: list[int], output_len: int) -> Timing:
        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        streamer = Arrivals()
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(torch.tensor([prompt]), generation_config=config, streamer=streamer)
        return timing_from_arrivals(start, streamer.times[1:])

    return run


def _peer(engine: peers.PeerEngine) -> Callable[[list[int], int], Timing]:
    def run(prompt: list[int], output_len: int) -> Timing:
        start = time.perf_counter()
        arrivals = [t for _, t in engine.stream(prompt, output_len)]
        if len(arrivals) != output_len:
            raise RuntimeError(f"{engine.label}: {len(arrivals)} tokens, expected {output_len}")
        return timing_from_arrivals(start, arrivals)

    return run


def load_engines(
    model: Path, settings: Settings
) -> tuple[dict[str, Callable[[list[int], int], Timing]], dict[str, str], dict[str, str]]:
    """Each engine's timed single-request run, by label; the engines skipped, with their reason; the notes of the
    engines run other than by default (``peers.PeerEngine.note``), by label."""
    max_len = max(settings.prompt_lens) + settings.output_len + 1
    engines: dict[str, Callable[[list[int], int], Timing]] = {}
    skipped: dict[str, str] = {}
    notes: dict[str, str] = {}
    for name in settings.engines:
        if name == "splitserve":
            for dtype in settings.dtypes:
                engines[f"splitserve {dtype}"] = _splitserve(model, dtype, settings.num_threads, max_len)
        elif name == "transformers":
            engines["transformers float32"] = _transformers(model)
        elif name in peers.PEERS:
            reason = peers.missing_reason(name)
            if reason is not None:
                logger.warning("skipping %s: %s", name, reason)
                skipped[name] = reason
                continue
            for precision in peers.PEER_PRECISIONS[name]:
                if settings.peer_precisions is not None and precision not in settings.peer_precisions:
                    continue
                engine = peers.load_peer(model, name, precision, settings.num_threads, max_len)
                engines[engine.label] = _peer(engine)
                if engine.note is not None:
                    notes[engine.label] = engine.note
        else:
            raise ValueError(f"unknown engine {name!r}; known: splitserve, transformers, {', '.join(peers.PEERS)}")
    return engines, skipped, notes


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run(model: Path, tokenizer: Any, settings: Settings) -> dict[str, Any]:
    """Every engine on every prompt length, ``settings.repeats`` times, interleaved; returns the report.

    Raises:
        ValueError: an unknown engine.
    """
    import torch

    torch.set_num_threads(settings.num_threads)
    load_before = list(os.getloadavg())
    engines, skipped, notes = load_engines(model, settings)
    prompts = prompts_for(tokenizer, settings.prompt_lens, settings.seed)
    for label, engine in engines.items():  # warm-up: first calls allocate and pack
        logger.info("warming up %s", label)
        engine(prompts[settings.prompt_lens[0]][:16], 8)
    ttft: dict[str, dict[int, list[float]]] = {label: {n: [] for n in settings.prompt_lens} for label in engines}
    tpot: dict[str, dict[int, list[float]]] = {label: {n: [] for n in settings.prompt_lens} for label in engines}
    for repeat in range(settings.repeats):
        for n in settings.prompt_lens:
            for label, engine in engines.items():
                first_s, per_token_s = engine(prompts[n], settings.output_len)
                ttft[label][n].append(1e3 * first_s)
                tpot[label][n].append(1e3 * per_token_s)
                gc.collect()
        logger.info("repeat %d of %d done", repeat + 1, settings.repeats)
    rows = []
    for n in settings.prompt_lens:
        for label in engines:
            rows.append(
                {
                    "engine": label,
                    "prompt_len": n,
                    "ttft_ms": ttft[label][n],
                    "ms_per_token": tpot[label][n],
                    "ttft_p50_ms": statistics.median(ttft[label][n]),
                    "ttft_p90_ms": percentile(ttft[label][n], 90),
                    "ms_per_token_p50": statistics.median(tpot[label][n]),
                    "ms_per_token_p90": percentile(tpot[label][n], 90),
                }
            )
    return {
        "benchmark": "latency",
        "model": str(model),
        "machine": Machine.current("cpu").to_dict(),
        "load_average_before_after": [load_before, list(os.getloadavg())],
        "num_threads": settings.num_threads,
        "omp_wait_policy": cpu_threads.wait_policy_text(os.environ),
        "prompt_lens": list(settings.prompt_lens),
        "output_len": settings.output_len,
        "repeats": settings.repeats,
        "rows": rows,
        "skipped": skipped,
        "notes": notes,
    }


def target_lines(report: dict[str, Any]) -> list[str]:
    """issue 18's single-request targets: splitserve's ms per token at most llama.cpp's at the same precision."""
    by = {(r["engine"], r["prompt_len"]): r for r in report["rows"]}
    lines = []
    for ours, theirs in TARGETS:
        for n in report["prompt_lens"]:
            if (ours, n) in by and (theirs, n) in by:
                a, b = by[(ours, n)]["ms_per_token_p50"], by[(theirs, n)]["ms_per_token_p50"]
                met = "MET" if a <= b else "NOT MET"
                lines.append(f"target {ours} ms/token at prompt {n}: {a:.2f} (want <= {theirs}'s {b:.2f}) {met}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    machine = report["machine"]
    before, after = report["load_average_before_after"]
    lines = [
        f"model {report['model']}; one request at a time, {report['output_len']} output tokens, "
        f"{report['repeats']} interleaved repeats; {report['num_threads']} threads each",
        f"CPU {machine['cpu']} ({machine['cores']} cores; {' '.join(machine['cpu_flags'])}); load average "
        f"{before[0]:.2f} before, {after[0]:.2f} after; OpenMP wait: {report['omp_wait_policy']}",
        f"{'prompt':>6}  {'engine':24} {'TTFT p50/p90 ms':>17} {'ms/token p50/p90':>17}  vs splitserve float32 "
        "(TTFT, ms/token)",
    ]
    by = {(r["engine"], r["prompt_len"]): r for r in report["rows"]}
    for r in report["rows"]:
        ref = by.get(("splitserve float32", r["prompt_len"]))
        ratio = ""
        if ref is not None:
            ratio = (
                f"{r['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}x, {r['ms_per_token_p50'] / ref['ms_per_token_p50']:.2f}x"
            )
        lines.append(
            f"{r['prompt_len']:>6}  {r['engine']:24} {r['ttft_p50_ms']:8.1f}/{r['ttft_p90_ms']:8.1f} "
            f"{r['ms_per_token_p50']:8.2f}/{r['ms_per_token_p90']:8.2f}  {ratio}"
        )
    for engine, reason in report["skipped"].items():
        lines.append(f"skipped {engine}: {reason}")
    for engine, note in report.get("notes", {}).items():
        lines.append(f"note {engine}: {note}")
    lines += target_lines(report)
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """``<name>.json`` and ``<name>.png`` (median ms per output token per engine and prompt length)."""
    plt = pyplot()
    json_path, png_path = write_json(report, out_dir, name)
    engines = list(dict.fromkeys(r["engine"] for r in report["rows"]))
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(engines) * len(report["prompt_lens"]) + 2))
    height = 0.8 / len(report["prompt_lens"])
    for i, n in enumerate(report["prompt_lens"]):
        values = {r["engine"]: r["ms_per_token_p50"] for r in report["rows"] if r["prompt_len"] == n}
        ax.barh(
            [j + i * height for j in range(len(engines))], [values[e] for e in engines], height, label=f"prompt {n}"
        )
    ax.set_yticks([j + height * (len(report["prompt_lens"]) - 1) / 2 for j in range(len(engines))], engines)
    ax.invert_yaxis()
    ax.set_xlabel("ms per output token (median), one request")
    ax.legend()
    fig.suptitle(f"{Path(report['model']).name}: one request, {report['output_len']} output tokens")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
