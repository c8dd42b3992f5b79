"""``splitserve bench throughput --structured-outputs``: the cost of structured outputs in a mixed batch.

The request set runs twice on one in-process ``LLM`` (greedy, EOS ignored, the prefix cache reset between runs),
alternating ``repeats`` times: every request unconstrained ("none"), then every other request under a JSON schema
("half-json", xgrammar: a bitmask filled per constrained row and step, applied before sampling). A constrained
request ends where its document is complete (its matcher accepts only EOS there), so the runs generate different
token counts: the figure of merit is output tokens per second, with the wall time per step. The grammar is
compiled in the warm-up (cached by key), so the timed runs measure the per-step cost, not the compilation.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.workload import Machine, RequestSet, write_json

# Bounded values everywhere (a JSON "number" is not: its digits may go on), so every document can complete; a
# random-weight model still fills strings up to maxLength with long tokens, so allow output_len >= 128.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
        "kind": {"enum": ["cat", "dog", "bird", "fish"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
        "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
    },
    "required": ["id", "kind", "owner", "tags"],
}


def run(model: Path, requests: RequestSet, dtype: str = "float32", repeats: int = 2) -> dict[str, Any]:
    """Both runs, ``repeats`` times each, alternating; the report (per run: wall seconds, output tokens, output
    tokens/s, steps; for half-json also how many constrained outputs parse as JSON) and the machine, with the
    load average before and after (the benchmark machine may be shared)."""
    from frontend_svc import LLM, SamplingParams, StructuredOutputsParams
    from frontend_svc.input_processor import TokensPrompt

    load_before = os.getloadavg()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in requests.prompts]
    plain = SamplingParams(max_tokens=requests.output_len, ignore_eos=True, temperature=0.0)
    constrained = SamplingParams(
        max_tokens=requests.output_len,
        ignore_eos=True,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    )
    modes = {
        "none": [plain] * len(prompts),
        "half-json": [constrained if i % 2 == 0 else plain for i in range(len(prompts))],
    }
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with LLM(str(model), dtype=dtype) as llm:
        llm.generate(prompts[:2], [constrained, plain], use_tqdm=False)  # warm-up; compiles the schema
        for _ in range(repeats):
            for mode, params in modes.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                wall_s = time.perf_counter() - start
                completions = [o.outputs[0] for o in outputs]
                num_out = sum(len(c.token_ids) for c in completions)
                valid = [_parses(c.text) for c, p in zip(completions, params, strict=True) if p is constrained]
                runs[mode].append(
                    {
                        "wall_s": wall_s,
                        "output_tokens": num_out,
                        "output_tok_s": num_out / wall_s,
                        "constrained_requests": len(valid),
                        "constrained_valid_json": sum(valid),
                        "constrained_output_tokens": sum(
                            len(c.token_ids) for c, p in zip(completions, params, strict=True) if p is constrained
                        ),
                    }
                )
    best = {mode: max(r["output_tok_s"] for r in rs) for mode, rs in runs.items()}
    return {
        "benchmark": "throughput-structured-outputs",
        "model": str(model),
        "dtype": dtype,
        "request_set": requests.summary(),
        "machine": asdict(Machine.current()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "schema": SCHEMA,
        "runs": runs,
        "best_output_tok_s": best,
        "half_json_over_none": best["half-json"] / best["none"],
    }


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> Path:
    json_path, _ = write_json(report, out_dir, name)
    return json_path


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"{Path(report['model']).name} {report['dtype']}: {report['request_set']['num_requests']} requests, "
        f"{report['machine']['cpu']}, load average {report['load_average_before'][0]:.1f} -> "
        f"{report['load_average_after'][0]:.1f}"
    ]
    for mode, runs in report["runs"].items():
        for r in runs:
            lines.append(
                f"  {mode:10s} {r['wall_s']:7.2f} s  {r['output_tokens']:6d} tokens  {r['output_tok_s']:8.1f} tok/s"
                + (
                    f"  constrained: {r['constrained_valid_json']}/{r['constrained_requests']} valid JSON, "
                    f"{r['constrained_output_tokens']} tokens"
                    if r["constrained_requests"]
                    else ""
                )
            )
    lines.append(f"  best half-json / none output tok/s: {report['half_json_over_none']:.3f}")
    return "\n".join(lines)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
