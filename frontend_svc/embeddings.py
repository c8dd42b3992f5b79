"""One embeddings call of the public APIs (gRPC ``Embed``, HTTP ``/v1/embeddings``): its inputs as pooling
requests through ``AsyncLLM.encode``, all in flight at once (the core batches them), outputs in input order.
Cancelling the call cancels every request (each ``encode`` aborts its own in the core)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from frontend_svc.async_llm import AsyncLLM
from frontend_svc.engine_types import LoRARequest
from frontend_svc.errors import ValidationError
from frontend_svc.input_processor import PromptType
from frontend_svc.outputs import PoolingRequestOutput
from splitserve.base.pooling_params import PoolingParams

# The most inputs one call may carry (OpenAI's limit for /v1/embeddings).
MAX_EMBED_INPUTS = 2048


def check_num_inputs(num_inputs: int, field: str) -> None:
    """At least one input, at most ``MAX_EMBED_INPUTS``.

    Raises:
        ValidationError: naming ``field``.
    """
    if num_inputs < 1:
        raise ValidationError(field, "must hold at least one input")
    if num_inputs > MAX_EMBED_INPUTS:
        raise ValidationError(field, f"holds {num_inputs} inputs, more than the {MAX_EMBED_INPUTS} allowed")


async def encode_all(
    engine: AsyncLLM,
    prompts: Sequence[PromptType],
    params: PoolingParams,
    request_id: str,
    field: str,
    priority: int = 0,
    lora_request: LoRARequest | None = None,
) -> list[PoolingRequestOutput]:
    """Pool every prompt, input i as request ``"{request_id}-{i}"``, with ``lora_request``'s adapter if any;
    outputs in input order.

    Raises:
        ValidationError: a refused input, its field named ``"{field}[i]"`` (``"{field}[i].prompt_token_ids[3]"``
            for an id outside the vocabulary); the other inputs are aborted.
        EngineDeadError, InternalError, RequestTooLargeError, NotFoundError: as ``AsyncLLM.encode`` (NotFoundError:
            the core has no adapter of that name).
    """

    async def one(index: int, prompt: PromptType) -> PoolingRequestOutput:
        outputs = engine.encode(prompt, params, f"{request_id}-{index}", priority=priority, lora_request=lora_request)
        try:
            return await anext(outputs)
        except ValidationError as e:
            if e.field.startswith("prompt"):  # the input's own fault: name it by its index
                suffix = "" if e.field == "prompt" else f".{e.field}"
                raise ValidationError(f"{field}[{index}]{suffix}", e.description) from None
            raise
        finally:
            await outputs.aclose()

    tasks = [asyncio.ensure_future(one(i, prompt)) for i, prompt in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # a failed input ends the call: the others are aborted (no-op for the finished)
