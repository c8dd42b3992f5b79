"""``splitserve bench throughput --loras N``: the cost of serving LoRA adapters in mixed batches.

The request set runs on one in-process ``LLM`` started with ``enable_lora=True, max_loras=N`` (greedy, EOS
ignored, the prefix cache reset before each run), alternating ``repeats`` times: every request on the base model
("base"), then request i under adapter ``i % N`` ("loras": N adapters spread over the set, so every step mixes
them). The adapters are random PEFT folders of rank ``rank`` on every projection (q/k/v/o, gate/up/down) of the
checkpoint, written here with safetensors (no peft needed). The figure of merit is output tokens per second; the
ratio loras / base is the price of the adapters' shrink and expand (``core_svc.lora.layers``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.workload import Machine, RequestSet, write_json

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_random_adapters(model: Path, out_dir: Path, num_loras: int, rank: int, seed: int = 0) -> list[Path]:
    """``num_loras`` PEFT adapter folders (``adapter_config.json``, ``adapter_model.safetensors``) of rank
    ``rank`` on every projection of ``model``'s decoder layers, random A and B (std 0.02), float32."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from core_svc.lora.adapter import module_shapes
    from core_svc.models.arch import ModelArchConfig

    config = AutoConfig.from_pretrained(model)
    shapes = module_shapes(ModelArchConfig.from_hf_config(config))
    generator = torch.Generator().manual_seed(seed)
    folders = []
    for index in range(num_loras):
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for module, (in_features, out_features) in shapes.items():
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
        folder = out_dir / f"lora-{index}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
        folders.append(folder)
    return folders


def run(
    model: Path, requests: RequestSet, num_loras: int, work_dir: Path, rank: int = 16, repeats: int = 2
) -> dict[str, Any]:
    """Both runs, ``repeats`` times each, alternating; the report (per run: wall seconds, output tokens, output
    tokens/s), the engine settings and the machine, with the load average before and after (the benchmark
    machine may be shared)."""
    from frontend_svc import LLM, LoRARequest, SamplingParams
    from frontend_svc.input_processor import TokensPrompt

    load_before = os.getloadavg()
    folders = make_random_adapters(model, work_dir, num_loras, rank)
    adapters = [LoRARequest(f"lora-{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in requests.prompts]
    params = SamplingParams(max_tokens=requests.output_len, ignore_eos=True, temperature=0.0)
    modes: dict[str, list[LoRARequest | None]] = {
        "base": [None] * len(prompts),
        "loras": [adapters[i % num_loras] for i in range(len(prompts))],
    }
    engine_settings = {"enable_lora": True, "max_loras": num_loras, "max_lora_rank": rank, "dtype": "float32"}
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with LLM(str(model), **engine_settings) as llm:
        llm.generate(prompts[:num_loras], params, lora_request=adapters, use_tqdm=False)  # warm-up, loads them
        for _ in range(repeats):
            for mode, lora_requests in modes.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, lora_request=lora_requests, use_tqdm=False)
                wall_s = time.perf_counter() - start
                num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
                runs[mode].append({"wall_s": wall_s, "output_tokens": num_out, "output_tok_s": num_out / wall_s})
    best = {mode: max(r["output_tok_s"] for r in rs) for mode, rs in runs.items()}
    return {
        "benchmark": "throughput-loras",
        "model": str(model),
        "engine_settings": engine_settings,
        "num_loras": num_loras,
        "rank": rank,
        "request_set": requests.summary(),
        "machine": asdict(Machine.current()),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "runs": runs,
        "best_output_tok_s": best,
        "loras_over_base": best["loras"] / best["base"],
    }


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> Path:
    json_path, _ = write_json(report, out_dir, name)
    return json_path


def format_report(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [
        f"{Path(report['model']).name} float32: {report['request_set']['num_requests']} requests, "
        f"{report['num_loras']} adapters of rank {report['rank']} on every projection; {machine['cpu']} "
        f"({machine['torch_threads']} threads; {' '.join(machine['cpu_flags'])}), load average "
        f"{report['load_average_before'][0]:.1f} -> {report['load_average_after'][0]:.1f}"
    ]
    for mode, runs in report["runs"].items():
        for r in runs:
            lines.append(
                f"  {mode:6s} {r['wall_s']:7.2f} s  {r['output_tokens']:6d} tokens  {r['output_tok_s']:8.1f} tok/s"
            )
    lines.append(f"  best loras / base output tok/s: {report['loras_over_base']:.3f}")
    return "\n".join(lines)
