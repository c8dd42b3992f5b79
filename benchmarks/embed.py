"""``splitserve bench embed``: embeddings per second of the standard prompt set, splitserve (``LLM.embed``, the
in-process core with ``--runner pooling``) against transformers ``AutoModel`` in padded static batches, same
checkpoint, same prompts, LAST pooling with normalize (vLLM's default for a decoder embedding model), in one run.
The two sides' vectors are compared too (largest absolute difference), so the speed is of the same answer."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.workload import Machine, RequestSet, write_json

HF_BATCH_SIZE = 16


def run(model: Path, requests: RequestSet, repeats: int, hf_batch_size: int = HF_BATCH_SIZE) -> dict[str, Any]:
    """Best of ``repeats`` timed runs per side (after one warm-up each); the report as a dict."""
    ours, ours_s = _splitserve(model, requests.prompts, repeats)
    gc.collect()
    ref, hf_s = _transformers(model, requests.prompts, repeats, hf_batch_size)
    num = len(requests.prompts)
    return {
        "benchmark": "embed",
        "machine": Machine.current().to_dict(),
        "model": str(model),
        "requests": requests.summary(),
        "pooling": "LAST, normalize",
        "prefix_caching": False,
        "repeats": repeats,
        "hf_batch_size": hf_batch_size,
        "splitserve": {"seconds": ours_s, "embeddings_per_s": num / ours_s},
        "transformers": {"seconds": hf_s, "embeddings_per_s": num / hf_s},
        "max_abs_diff": float(np.max(np.abs(np.asarray(ours) - np.asarray(ref)))),
    }


def _splitserve(model: Path, prompts: list[list[int]], repeats: int) -> tuple[list[list[float]], float]:
    from frontend_svc import LLM

    best = float("inf")
    vectors: list[list[float]] = []
    # No prefix caching: LAST pooling would otherwise find every repeat's prompts cached but their last token.
    with LLM(str(model), runner="pooling", dtype="float32", enable_prefix_caching=False) as llm:
        llm.embed(prompts[:4], use_tqdm=False)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.embed(prompts, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        vectors = [o.outputs.embedding for o in outputs]
    return vectors, best


def _transformers(
    model: Path, prompts: list[list[int]], repeats: int, batch_size: int
) -> tuple[list[list[float]], float]:
    """``AutoModel`` float32, batches of ``batch_size`` right-padded prompts with their attention mask, the prompts
    sorted by length first (as sentence-transformers' ``encode`` batches them: the least padding); the last real
    token's ``last_hidden_state`` row, L2-normalized. Vectors come back in prompt order."""
    import torch
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))

    def embed_all() -> list[list[float]]:
        vectors: list[list[float]] = [[] for _ in prompts]
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            batch = [prompts[i] for i in indices]
            width = max(len(p) for p in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.int64)
            mask = torch.zeros((len(batch), width), dtype=torch.int64)
            for i, p in enumerate(batch):
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            with torch.inference_mode():
                hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(batch)), mask.sum(dim=1) - 1]
            for i, vector in zip(indices, torch.nn.functional.normalize(last.float(), dim=-1).tolist(), strict=True):
                vectors[i] = vector
        return vectors

    embed_all()  # warm-up
    best = float("inf")
    vectors: list[list[float]] = []
    for _ in range(repeats):
        start = time.perf_counter()
        vectors = embed_all()
        best = min(best, time.perf_counter() - start)
    return vectors, best


def format_report(report: dict[str, Any]) -> str:
    machine = report["machine"]
    requests = report["requests"]
    lines = [
        f"embeddings: {requests['num_requests']} prompts ({requests['input_tokens']} tokens, median "
        f"{requests['prompt_len_p50']:.0f}), {report['pooling']}, best of {report['repeats']}",
        f"machine: {machine['cpu']}, {machine['cores']} cores, torch threads {machine['torch_threads']}",
        f"{'engine':<28}{'seconds':>10}{'embeddings/s':>15}",
        f"{'splitserve (LLM.embed)':<28}{report['splitserve']['seconds']:>10.2f}"
        f"{report['splitserve']['embeddings_per_s']:>15.1f}",
        f"{'transformers AutoModel':<28}{report['transformers']['seconds']:>10.2f}"
        f"{report['transformers']['embeddings_per_s']:>15.1f}"
        f"   (batches of {report['hf_batch_size']}, by length, padded)",
        f"largest |difference| between the two sides' vectors: {report['max_abs_diff']:.2e}",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], out_dir: Path, name: str) -> Path:
    json_path, _ = write_json(report, out_dir, name)
    return json_path
