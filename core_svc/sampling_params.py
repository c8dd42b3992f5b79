"""Sampling parameters as the core uses them (vLLM's names and defaults).

The frontend validates every rule of vLLM's SamplingParams before a request reaches the core; the core
re-checks, with the same rules and wording (``splitserve.base.sampling_rules``), the ranges that would
otherwise corrupt a batch, so a request from any gRPC client is safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core_svc.errors import InvalidRequestError
from splitserve.base.sampling_rules import model_violation, range_violation
from splitserve.base.structured_outputs import StructuredOutputsParams, structured_outputs_violation

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM ``SamplingParams`` subset the core needs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs per sampled token; -1 = whole vocabulary
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    eos_token_id: int | None = None  # None: the model's EOS, filled in by the engine core
    # The model's EOS ids (its generation config's), which min_tokens masks whatever ignore_eos, as vLLM's
    # all_stop_token_ids hold them; set by the engine core for requests with min_tokens (not on the wire).
    model_eos_token_ids: tuple[int, ...] = ()
    structured_outputs: StructuredOutputsParams | None = None  # the output's constraint (compiled by the core)
    # vLLM's bad words, tokenized by the frontend: each sequence's last id is banned where the output ends with the
    # ids before it (always, for a one-id sequence)
    bad_words_token_ids: list[list[int]] | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Check ranges and token ids, as the frontend does (``splitserve.base.sampling_rules``: vLLM
        ``SamplingParams._verify_args`` and ``verify``). ``max_logprobs`` caps logprobs and prompt_logprobs; -1
        there lifts the cap and lets a request ask for the whole vocabulary (-1).

        Raises:
            InvalidRequestError: naming the field (``field``), its value and the allowed range.
        """
        violation = range_violation(self) or model_violation(self, vocab_size, max_logprobs)
        if violation is None and self.structured_outputs is not None:
            violation = structured_outputs_violation(self.structured_outputs)
        if violation is not None:
            raise InvalidRequestError.from_violation(violation)
