"""Run the engine core and the transformers reference on the same checkpoint, and compare them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from core_svc.config import CoreConfig
from core_svc.engine_core import EngineCore
from core_svc.request import MultiModalFeature, Request
from core_svc.sampling_params import SamplingParams

TOP_K = 5


@cache
def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


@dataclass
class Greedy:
    token_ids: list[int]
    logprobs: list[torch.Tensor]  # per step: [vocab_size] float32 log-softmax of the step's logits


def hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, make_cache: Callable[[], Any] | None = None
) -> Greedy:
    """transformers ``generate`` (greedy, float32) with the per-step logits turned into logprobs; ``make_cache``:
    makes the ``past_key_values`` it starts from (a ``transformers.Cache``), else generate makes its own."""
    model = hf_model(path)
    extra = {} if make_cache is None else {"cache": make_cache()}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **extra,
        )
    logprobs = [step[0].float().log_softmax(-1) for step in out.logits]
    return Greedy(out.sequences[0, len(prompt) :].tolist(), logprobs)


def hf_beam_search(path: Path, prompt: list[int], width: int, max_new_tokens: int) -> list[list[int]]:
    """transformers' beam search (``generate(num_beams=width)``, float32, no EOS): the ``width`` best sequences,
    prompt included, best first."""
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [list(row) for row in out.tolist()]


@dataclass
class EngineResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per step: token id -> logprob (sampled + top-k)
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)


def make_engine(path: Path, **overrides: object) -> EngineCore:
    return EngineCore(CoreConfig(model=str(path), **overrides))  # type: ignore[arg-type]  # fields as keywords


def run_engine(
    engine: EngineCore,
    prompts: list[list[int]],
    max_tokens: int,
    arrival_steps: list[int] | None = None,
    **params: object,
) -> tuple[list[EngineResult], int]:
    """Greedy-generate ``max_tokens`` for each prompt, adding prompt i at step ``arrival_steps[i]``.

    Returns the per-prompt results and the number of preemptions seen.
    """
    arrival_steps = arrival_steps or [0] * len(prompts)
    results = [EngineResult() for _ in prompts]
    pending = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    step, num_preemptions = 0, 0
    prefix = f"{id(results)}-"
    while pending or engine.has_unfinished_requests():
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.pop(0)
            fields = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": TOP_K, **params}
            sampling = SamplingParams(**fields)  # type: ignore[arg-type]  # fields as keywords
            engine.add_request(Request(f"{prefix}{i}", list(prompts[i]), sampling))
        outputs = engine.step()
        step += 1
        if outputs.scheduler_stats is not None:
            num_preemptions += outputs.scheduler_stats.num_preemptions
        for output in outputs.outputs:
            result = results[int(output.request_id.removeprefix(prefix))]
            result.token_ids.extend(output.new_token_ids)
            if output.new_logprobs is not None:
                for ids, values in zip(
                    output.new_logprobs.logprob_token_ids, output.new_logprobs.logprobs, strict=True
                ):
                    result.logprobs.append(dict(zip(ids, values, strict=True)))
            if output.new_prompt_logprobs is not None:
                for ids, values in zip(
                    output.new_prompt_logprobs.logprob_token_ids, output.new_prompt_logprobs.logprobs, strict=True
                ):
                    result.prompt_logprobs.append(dict(zip(ids, values, strict=True)))
            result.num_cached_tokens = output.num_cached_tokens
            if output.finish_reason is not None:
                result.finish_reason = str(output.finish_reason)
    return results, num_preemptions


def first_divergence(ours: EngineResult, ref: Greedy, tolerance: float = 1e-3) -> str | None:
    """None when the ids are equal. Where they diverge, the divergence must be a near-tie: each side's token in
    the other's top-5 with equal logprobs within ``tolerance``; then a description is returned. Otherwise an
    AssertionError names the step and the two distributions' views."""
    if ours.token_ids == ref.token_ids:
        return None
    step = next(i for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=True)) if a != b)
    a, b = ours.token_ids[step], ref.token_ids[step]
    ref_lp = ref.logprobs[step]
    ref_top = ref_lp.topk(TOP_K).indices.tolist()
    our_lp = ours.logprobs[step]
    assert b in our_lp and a in ref_top, f"step {step}: ours {a}, transformers {b}; not in each other's top-{TOP_K}"
    assert abs(our_lp[a] - ref_lp[a].item()) < tolerance and abs(our_lp[b] - ref_lp[b].item()) < tolerance, (
        f"step {step}: logprobs differ beyond {tolerance}"
    )
    return f"step {step}: ours {a} ({our_lp[a]:.5f}) vs transformers {b} ({ref_lp[b].item():.5f})"


def features_from_the_wire(features: list[MultiModalFeature], identifier: str) -> list[MultiModalFeature]:
    """``features`` as the core parses them (``core_svc.wire``) from a client that sent each with ``identifier``."""
    from core_svc.wire import request_from_pb
    from splitserve.stubs.engine.v1 import engine_core_pb2 as pb

    items = [
        pb.MultiModalFeatureSpec(
            modality=f.modality,
            identifier=identifier,
            offset=f.offset,
            length=f.length,
            data={n: pb.TensorData(dtype=t.dtype, shape=list(t.shape), data=t.data) for n, t in f.data.items()},
        )
        for f in features
    ]
    return request_from_pb(pb.EngineCoreRequest(request_id="wire", prompt_token_ids=[0], mm_features=items)).mm_features


def cpu_kernels_loaded() -> bool:
    """Load the compiled CPU kernels' library (``kernels/attention/cpu_ops.py``; built first if need be): whether
    it could be, here."""
    from kernels.attention import cpu_ops
    from splitserve.base import envs

    try:
        cpu_ops.load(envs.kernel_dir())
    except RuntimeError:
        return False
    return True


def needs_cpu_kernels(value: str) -> Any:
    """``value`` as a pytest parameter skipped where the compiled CPU kernels cannot be built."""
    return pytest.param(
        value, marks=pytest.mark.skipif(not cpu_kernels_loaded(), reason="the CPU kernels cannot be built here")
    )


MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7}  # stored fraction bits


def linear_operands(
    rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Seeded operands of a linear layer: x [rows, in_features] and weight [out_features, in_features] (values
    about 0.1) in ``dtype``, and a float32 bias [out_features]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(out_features, generator=gen)
    return x, w, bias


def assert_rounded_once(actual: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, terms: int = 96) -> None:
    """``actual`` is ``exact`` (float64) up to float32 summation error, then one rounding to ``dtype``: within half
    a unit in the last place of ``dtype`` plus the float32 sums' error (``terms`` products)."""
    assert actual.dtype == dtype
    _, exponent = torch.frexp(exact)  # |exact| in [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.ones_like(exact), exponent - 1 - MANTISSA_BITS[dtype])
    sum_error = terms * 2**-24 * exact.abs().max().item()
    assert ((actual.double() - exact).abs() <= ulp / 2 + sum_error).all()
