"""What the Python API returns (vLLM ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``)."""

from __future__ import annotations

from dataclasses import dataclass

from frontend_svc.stats import RequestStateStats


@dataclass
class Logprob:
    logprob: float  # natural log of the model's probability (raw logits, before sampling processors)
    rank: int | None = None  # 1-based rank in the vocabulary; ties share the worst rank
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

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output for the same request: per completion index, append (DELTA) or replace."""
        self.finished |= next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics
        for completion in next_output.outputs:
            for i, existing in enumerate(self.outputs):
                if existing.index != completion.index:
                    continue
                if aggregate:
                    existing.text += completion.text
                    existing.token_ids.extend(completion.token_ids)
                    if completion.logprobs is not None:
                        existing.logprobs = (existing.logprobs or []) + completion.logprobs
                    existing.cumulative_logprob = completion.cumulative_logprob
                    existing.finish_reason = completion.finish_reason
                    existing.stop_reason = completion.stop_reason
                else:
                    self.outputs[i] = completion
                break
            else:
                self.outputs.append(completion)
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = next_output.prompt_logprobs
