"""Logprobs as the API returns them: token texts decoded in context, cumulative logprob (vLLM
``vllm/v1/engine/logprobs.py``)."""

from __future__ import annotations

from typing import Any

from frontend_svc.engine_types import PositionLogprobs
from frontend_svc.outputs import Logprob, PromptLogprobs, SampleLogprobs

# Previous tokens used as context when decoding a logprob token's text (restores SentencePiece's leading
# space and completes characters split over byte tokens, as vLLM's U+FFFD correction).
NUM_CONTEXT_TOKENS = 4


def token_texts(tokenizer: Any, context_ids: list[int], token_ids: list[int]) -> list[str]:
    """The text each of ``token_ids`` would add right after ``context_ids``."""
    before = tokenizer.decode(context_ids, skip_special_tokens=False)
    texts = []
    for token_id in token_ids:
        after = tokenizer.decode(context_ids + [token_id], skip_special_tokens=False)
        common = 0
        limit = min(len(before), len(after))
        while common < limit and before[common] == after[common]:
            common += 1
        texts.append(after[common:])
    return texts


class LogprobsProcessor:
    """Accumulates one request's sample and prompt logprobs."""

    def __init__(
        self,
        tokenizer: Any | None,
        num_logprobs: int | None,
        num_prompt_logprobs: int | None,
        prompt_token_ids: list[int],
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.logprobs: SampleLogprobs | None = [] if num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if num_prompt_logprobs is not None else None
        self._cumulative_logprobs: list[float] = [0.0]  # the sum of the first i sampled logprobs
        self._sampled_ids: list[int] = []

    def update_sample_logprobs(self, positions: list[PositionLogprobs]) -> None:
        """Add one dict per new token."""
        if self.logprobs is None:
            return
        for position in positions:
            context = (self.prompt_token_ids + self._sampled_ids)[-NUM_CONTEXT_TOKENS:]
            self.logprobs.append(self._to_dict(position, context))
            self._cumulative_logprobs.append(self._cumulative_logprobs[-1] + position.logprobs[0])
            self._sampled_ids.append(position.token_ids[0])

    def get_logprobs(self, start: int, end: int) -> SampleLogprobs | None:
        """The dicts of output ids [start, end) (those an output carries); None without logprobs."""
        return self.logprobs[start:end] if self.logprobs is not None else None

    def get_cumulative_logprob(self, num_ids: int) -> float | None:
        """The sum of the first ``num_ids`` sampled logprobs (those sent so far); None without logprobs."""
        if self.logprobs is None:
            return None
        return self._cumulative_logprobs[min(num_ids, len(self._cumulative_logprobs) - 1)]

    def set_prompt_logprobs(self, positions: list[PositionLogprobs]) -> None:
        if self.prompt_logprobs is None:
            return
        self.prompt_logprobs = [None]
        for i, position in enumerate(positions):
            context = self.prompt_token_ids[max(0, i + 1 - NUM_CONTEXT_TOKENS) : i + 1]
            self.prompt_logprobs.append(self._to_dict(position, context))

    def _to_dict(self, position: PositionLogprobs, context: list[int]) -> dict[int, Logprob]:
        texts = (
            token_texts(self.tokenizer, context, position.token_ids)
            if self.tokenizer is not None
            else [None] * len(position.token_ids)
        )
        entries: dict[int, Logprob] = {}
        for i, (token_id, logprob, text) in enumerate(zip(position.token_ids, position.logprobs, texts, strict=True)):
            if token_id in entries:
                continue  # the chosen token also among the top-k: keep its first (chosen) entry
            # Ranks of the top-k are their places; the chosen token's is the vocabulary rank from the core.
            entries[token_id] = Logprob(logprob, position.rank if i == 0 else i, text)
        return entries
