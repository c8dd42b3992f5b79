"""Drive the OutputProcessor with fake engine-core outputs, one token per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend_svc.engine_types import EngineCoreOutput, FinishReason, PositionLogprobs
from frontend_svc.output_processor import OutputProcessor
from frontend_svc.outputs import RequestOutput
from frontend_svc.sampling_params import SamplingParams


@dataclass
class Stream:
    outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    steps: int = 0  # engine outputs consumed before the request ended


def stream(
    tokenizer: Any,
    output_ids: list[int],
    params: SamplingParams,
    prompt_ids: list[int] | None = None,
    final_reason: FinishReason = FinishReason.LENGTH,
    with_logprobs: bool = False,
) -> Stream:
    """Feed ``output_ids`` as a core would (the core finishes on the last one with ``final_reason``)."""
    processor = OutputProcessor(tokenizer)
    processor.add_request("req-internal", "req", params, None, list(prompt_ids or []))
    result = Stream()
    for i, token_id in enumerate(output_ids):
        last = i == len(output_ids) - 1
        logprobs = [PositionLogprobs([token_id], [-0.5], 1)] if with_logprobs else []
        core_output = EngineCoreOutput(
            "req-internal", [token_id], new_logprobs=logprobs, finish_reason=final_reason if last else None
        )
        processed = processor.process_outputs([core_output])
        result.outputs.extend(processed.request_outputs)
        result.reqs_to_abort.extend(processed.reqs_to_abort)
        result.steps = i + 1
        if not processor.has_unfinished_requests():
            break
    return result


def delta_text(outputs: list[RequestOutput]) -> str:
    return "".join(o.outputs[0].text for o in outputs)
