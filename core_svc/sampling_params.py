"""Sampling parameters as the core uses them (vLLM's names and defaults).

The frontend validates every rule of vLLM's SamplingParams before a request reaches the core; the core
re-checks the ranges that would otherwise corrupt a batch, so a request from any gRPC client is safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core_svc.errors import InvalidRequestError
from splitserve.base.request_rules import token_id_outside_vocabulary

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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Check ranges (vLLM ``SamplingParams._verify_args`` and ``verify``). ``max_logprobs`` caps
        logprobs and prompt_logprobs; -1 there lifts the cap and lets a request ask for the whole vocabulary (-1).

        Raises:
            InvalidRequestError: naming the field, its value and the allowed range.
        """
        checks: list[tuple[bool, str]] = [
            (
                math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0,
                f"temperature: must be in [0, 2], got {self.temperature}",
            ),
            (0.0 < self.top_p <= 1.0, f"top_p: must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k: must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p: must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens: must be at least 1, got {self.max_tokens}"),
            (
                0 <= self.min_tokens <= self.max_tokens,
                f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            ),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty: must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty: must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
                f"repetition_penalty: must be a finite number > 0, got {self.repetition_penalty}",
            ),
        ]
        cap = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        lowest = -1 if max_logprobs == -1 else 0  # -1 asks for the whole vocabulary
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                allowed = f"-1 (whole vocabulary) or in [0, {cap}]" if lowest == -1 else f"in [0, {cap}]"
                checks.append((lowest <= value <= cap, f"{name}: must be {allowed} (max_logprobs), got {value}"))
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
        _check_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.logit_bias:
            _check_ids("logit_bias", list(self.logit_bias), vocab_size)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids: must not be empty when given")
            _check_ids("allowed_token_ids", self.allowed_token_ids, vocab_size)
        if self.eos_token_id is not None:
            _check_ids("eos_token_id", [self.eos_token_id], vocab_size)


def _check_ids(name: str, token_ids: list[int], vocab_size: int) -> None:
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"{name}[{i}]: {token_id_outside_vocabulary(token_id, vocab_size)}")
