"""Logprobs as the API returns them: token texts in context, cumulative logprob (vLLM
``vllm/v1/engine/logprobs.py``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from frontend_svc.detokenizer import IncrementalDetokenizer
from frontend_svc.engine_types import PositionLogprobs
from frontend_svc.outputs import Logprob, PromptLogprobs, SampleLogprobs
from frontend_svc.sampling_params import SamplingParams


class LogprobsProcessor:
    """Accumulates one request's sample and prompt logprobs.

    Token texts come from the request's detokenizer: a sampled token's is the text it added to the output (no
    second decode; "" for a byte that leaves its character unfinished, the whole character on the byte that
    completes it), so the sampled texts concatenate to the output text; a top-k candidate's is decoded on its own
    after the sampled tokens before it (``TextDetokenizer.candidate_texts``). A position's dict is built when its
    id is released (``get_logprobs``), once its text is final; the cumulative logprob covers the same ids.
    Prompt positions: the same, over a detokenizer that reads the prompt (vLLM: each prompt token in the context
    of the prompt before it).
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        tokenizer: Any | None,
        params: SamplingParams,
        prompt_token_ids: list[int],
    ) -> None:
        self.detokenizer = detokenizer
        self.tokenizer = tokenizer
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        # Sum of the sampled logprobs of the positions built so far; None without logprobs.
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self._unbuilt: deque[PositionLogprobs] = deque()  # positions whose dicts are not built yet

    def update_sample_logprobs(self, positions: list[PositionLogprobs]) -> None:
        """Take one position per new output id (in order)."""
        if self.logprobs is not None:
            self._unbuilt.extend(positions)

    def get_logprobs(self, start: int, end: int) -> SampleLogprobs | None:
        """The dicts of output ids [start, end), building those not built yet; ``end`` never goes back."""
        if self.logprobs is None:
            return None
        while len(self.logprobs) < end and self._unbuilt:
            position = self._unbuilt.popleft()
            self.logprobs.append(self._to_dict(self.detokenizer, len(self.logprobs), position))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + position.logprobs[0]
        return self.logprobs[start:end]

    def set_prompt_logprobs(self, positions: list[PositionLogprobs]) -> None:
        """Take the prompt's positions (``positions[i]`` predicts prompt token ``i + 1``)."""
        if self.prompt_logprobs is None:
            return
        texts = IncrementalDetokenizer.for_prompt(self.tokenizer, self.params, self.prompt_token_ids)
        self.prompt_logprobs = [None]
        for i, position in enumerate(positions):
            self.prompt_logprobs.append(self._to_dict(texts, i + 1, position))

    @staticmethod
    def _to_dict(texts: IncrementalDetokenizer, index: int, position: PositionLogprobs) -> dict[int, Logprob]:
        """Position ``index``'s dict: the chosen token first (its text as it went into the text), then the
        top-k candidates. Ranks of the top-k are their places; the chosen token's is the vocabulary rank from the
        core (ties counted at their worst), or its place when it is among the top-k too, as vLLM's dict (built
        from [vocabulary rank, 1..k], the later entry of a repeated id winning) gives it."""
        chosen = position.token_ids[0]
        candidates = [token_id for token_id in dict.fromkeys(position.token_ids[1:]) if token_id != chosen]
        token_texts = dict(zip(candidates, texts.candidate_texts(index, candidates), strict=True))
        token_texts[chosen] = texts.token_text(index)
        entries: dict[int, Logprob] = {}
        for i, (token_id, logprob) in enumerate(zip(position.token_ids, position.logprobs, strict=True)):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, position.rank if i == 0 else i, token_texts[token_id])
            elif token_id == chosen and i > 0 and entries[token_id].rank == position.rank:
                entries[token_id].rank = i  # the chosen token among the top-k: its place (its first one)
        return entries
