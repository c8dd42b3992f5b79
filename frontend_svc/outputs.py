"""What the Python API returns (vLLM ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from frontend_svc.engine_types import LoRARequest
from frontend_svc.stats import RequestStateStats


@dataclass
class Logprob:
    logprob: float  # natural log of the model's probability (raw logits, before sampling processors)
    # 1-based rank in the vocabulary: a top-k entry's place; a sampled token outside the top-k counts ties at their
    # worst (vLLM's)
    rank: int | None = None
    decoded_token: str | None = None  # the token's text in context; None when detokenize=False


# One dict per position: token id -> Logprob (the chosen token first, then the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# Prompt logprobs: None for the first prompt token (nothing predicts it), then one dict per token.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n completions
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None without logprobs
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running (a failed request raises)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    lora_request: LoRARequest | None = None  # vLLM's field; the adapter is on the RequestOutput

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str  # the caller's id
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestStateStats | None = None  # timing of the (last finishing) core request behind this output
    lora_request: LoRARequest | None = None  # the adapter it ran with; None: the base model
    # vLLM's fields of encoder-decoder models and disaggregated prefill: always None here.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, object] | None = None
    # vLLM's placeholder ranges per modality: empty here (a request's image placeholders are its core request's)
    multi_modal_placeholders: dict[str, object] = dataclasses.field(default_factory=dict)

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output for the same request in place (vLLM's ``RequestOutput.add``): per completion
        index, append (DELTA, ``aggregate``) or replace. Costs this output's completions once; to merge many
        outputs, ``merge`` them together, which is linear in all of them."""
        merged = RequestOutput.merge([self, next_output], aggregate)
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(merged, f.name))

    @staticmethod
    def merge(outputs: Sequence[RequestOutput], aggregate: bool) -> RequestOutput:
        """One output for several outputs of the same request, in their order: per completion index (in the
        order the indices first appear), DELTA pieces concatenated (``aggregate``: texts, ids and logprobs; the
        last cumulative logprob and finish), otherwise the latest completion. ``finished`` if any is;
        ``num_cached_tokens`` and ``metrics`` of the last; the last prompt logprobs given.

        Linear in the completions, ids and logprobs merged: the outputs of an n = 16384 request that piled up
        while its consumer was busy merge in one pass, not one pass over all completions per output.

        Raises:
            ValueError: ``outputs`` is empty.
        """
        if not outputs:
            raise ValueError("nothing to merge")
        first, last = outputs[0], outputs[-1]
        if len(outputs) == 1:
            return first
        by_index: dict[int, list[CompletionOutput]] = {}
        for output in outputs:
            for completion in output.outputs:
                by_index.setdefault(completion.index, []).append(completion)
        # The prompt logprobs one of them carries (DELTA's later outputs carry []; None: not asked for).
        given = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
        prompt_logprobs = next((p for p in reversed(given) if p), given[-1] if given else None)
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[_merge_completions(pieces, aggregate) for pieces in by_index.values()],
            finished=any(o.finished for o in outputs),
            num_cached_tokens=last.num_cached_tokens,
            metrics=last.metrics,
            lora_request=first.lora_request,
        )


def _merge_completions(pieces: list[CompletionOutput], aggregate: bool) -> CompletionOutput:
    """One completion's outputs in order: concatenated (DELTA) or the latest."""
    last = pieces[-1]
    if not aggregate or len(pieces) == 1:
        return last
    has_logprobs = any(p.logprobs is not None for p in pieces)
    return CompletionOutput(
        index=last.index,
        text="".join(p.text for p in pieces),
        token_ids=[token_id for p in pieces for token_id in p.token_ids],
        cumulative_logprob=last.cumulative_logprob,
        logprobs=[position for p in pieces for position in p.logprobs or []] if has_logprobs else None,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
    )


@dataclass
class PoolingOutput:
    """A pooling request's result (vLLM ``PoolingOutput``; ``data`` is a list here, the frontend has no torch)."""

    data: list[float]  # [dimensions] float32 values, pooled (and normalized when asked)


@dataclass
class PoolingRequestOutput:
    """What a pooling request returns (vLLM ``PoolingRequestOutput``): one output, when it finishes."""

    request_id: str  # the caller's id
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (LAST pooling only)
    prompt: str | None = None
    metrics: RequestStateStats | None = None


@dataclass
class EmbeddingOutput:
    """vLLM ``EmbeddingOutput``: a pooling output read as an embedding."""

    embedding: list[float]  # [dimensions]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM ``EmbeddingRequestOutput``: what ``LLM.embed`` returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(
            output.request_id,
            EmbeddingOutput(output.outputs.data),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
        )
