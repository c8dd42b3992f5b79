"""The OpenAI-compatible HTTP API's response bodies, built from ``RequestOutput`` as vLLM's
``serving_completion.py`` / ``serving_chat.py`` build them: completions (``text_completion``), chat completions
(``chat.completion`` and ``chat.completion.chunk``), their logprobs, usage and error bodies. Plain dicts, ready for
JSON; no I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.outputs import CompletionOutput, Logprob

# A logprob of -inf (a token the sampler could never pick) as JSON can carry it, as vLLM clamps it.
MIN_LOGPROB = -9999.0


def error_body(message: str, error_type: str, param: str | None, code: int | str | None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclass
class UsageCounter:
    """Token counts of one API request (all its prompts and their n completions): each prompt once, every
    completion's tokens. Streamed outputs are deltas, so completion tokens add up as they come."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    _prompts_seen: set[int] = field(default_factory=set)

    def add(self, prompt_index: int, num_prompt_tokens: int, num_cached_tokens: int, new_tokens: int) -> None:
        if prompt_index not in self._prompts_seen:
            self._prompts_seen.add(prompt_index)
            self.prompt_tokens += num_prompt_tokens
            self.cached_tokens += num_cached_tokens  # each prompt's once (its n completions share it)
        self.completion_tokens += new_tokens

    def body(self, prompt_tokens_details: bool = False) -> dict[str, Any]:
        """OpenAI's usage; with ``prompt_tokens_details`` (vLLM's --enable-prompt-tokens-details) the prompt
        tokens served from the prefix cache as ``prompt_tokens_details.cached_tokens``."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def _token_text(token_id: int, logprob: Logprob | None, tokenizer: Any, as_ids: bool = False) -> str:
    """The token as vLLM shows it in logprobs: its text in context, else the tokenizer's decoding of it alone; with
    ``as_ids`` (vLLM's return_tokens_as_token_ids) ``"token_id:<id>"``, which stays unambiguous where a token is no
    whole character."""
    if as_ids:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return str(tokenizer.decode([token_id]))


def _top(position: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
    """The ``num`` most likely tokens of a position (-1: all the engine returned, the whole vocabulary), by rank
    (the sampled token is among them only if it ranks)."""
    ranked = sorted(((i, lp) for i, lp in position.items() if lp.rank is not None), key=lambda item: item[1].rank or 0)
    return ranked if num < 0 else ranked[:num]


@dataclass
class CompletionLogprobs:
    """The legacy completions API's logprobs of one choice (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``); ``text_offset`` counts characters of the choice's text, across a stream's chunks."""

    num_top: int  # the request's ``logprobs``
    tokenizer: Any
    text_offset: int = 0
    as_ids: bool = False  # tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    def body(
        self, completion: CompletionOutput, prompt: tuple[list[int], list[dict[int, Logprob] | None]] | None = None
    ) -> dict[str, Any]:
        """The logprobs of the choice's tokens; with ``prompt`` (an echoed prompt's token ids and logprobs), of the
        prompt's tokens first, the first one's (nothing predicts it) null, as vLLM's echo."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        positions: list[tuple[int, dict[int, Logprob] | None]] = []
        if prompt is not None:
            positions += list(zip(prompt[0], prompt[1], strict=False))
        positions += list(zip(completion.token_ids, completion.logprobs or [], strict=False))
        for token_id, position in positions:
            if position is None or token_id not in position:
                text = _token_text(token_id, None, self.tokenizer, self.as_ids)
                tokens.append(text)
                token_logprobs.append(None)
                top_logprobs.append(None)
                offsets.append(self.text_offset)
                self.text_offset += len(text)
                continue
            sampled = position[token_id]
            text = _token_text(token_id, sampled, self.tokenizer, self.as_ids)
            tokens.append(text)
            token_logprobs.append(_clamped(sampled.logprob))
            # The sampled token, and the most likely ones (vLLM's dict: text -> logprob).
            top = {text: _clamped(sampled.logprob)}
            for top_id, lp in _top(position, self.num_top):
                top.setdefault(_token_text(top_id, lp, self.tokenizer, self.as_ids), _clamped(lp.logprob))
            top_logprobs.append(top)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }


def prompt_logprobs_body(prompt_logprobs: list[dict[int, Logprob] | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` of a response: per prompt position None (the first) or ``{token id as a
    string: {"logprob", "rank", "decoded_token"}}``, -inf clamped as vLLM's ``clamp_prompt_logprobs`` does."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {"logprob": _clamped(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in prompt_logprobs
    ]


def chat_logprobs(completion: CompletionOutput, num_top: int, tokenizer: Any, as_ids: bool = False) -> dict[str, Any]:
    """The chat API's logprobs of one choice: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``,
    ``top_logprobs`` the ``num_top`` most likely tokens of each position; ``as_ids``: tokens as "token_id:<id>"."""

    def entry(token_id: int, logprob: Logprob) -> dict[str, Any]:
        text = _token_text(token_id, logprob, tokenizer, as_ids)
        return {"token": text, "logprob": _clamped(logprob.logprob), "bytes": list(text.encode())}

    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or [], strict=False):
        item = entry(token_id, position[token_id])
        item["top_logprobs"] = [entry(top_id, lp) for top_id, lp in _top(position, num_top)]
        content.append(item)
    return {"content": content}


def completion_choice(index: int, completion: CompletionOutput, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """A ``text_completion`` choice (whole or a stream's chunk): vLLM's fields, ``stop_reason`` included."""
    return {
        "index": index,
        "text": completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def whole_completion_choice(
    index: int, completion: CompletionOutput, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """A non-streamed ``text_completion`` choice: vLLM's optional fields present, null unless asked for
    (``prompt_logprobs``, ``prompt_token_ids``, ``token_ids``; its clients and tests read them)."""
    return {
        **completion_choice(index, completion, logprobs),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "token_ids": None,
    }


def chat_choice(
    index: int, completion: CompletionOutput, logprobs: dict[str, Any] | None, role: str = "assistant"
) -> dict[str, Any]:
    """A ``chat.completion`` choice: the reply as a message of ``role`` (``tool_calls`` empty unless a forced tool
    choice made them, as vLLM's message has it); ``token_ids`` null unless asked for."""
    return {
        "index": index,
        "message": {"role": role, "content": completion.text, "tool_calls": []},
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
        "token_ids": None,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], completion: CompletionOutput | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` choice: a ``delta`` (the role first, then content) and, last, the reason."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason if completion is not None else None,
        "stop_reason": completion.stop_reason if completion is not None else None,
    }


def envelope(request_id: str, object_type: str, created: int, model: str, choices: list[Any]) -> dict[str, Any]:
    """The fields every completion object and chunk has."""
    return {"id": request_id, "object": object_type, "created": created, "model": model, "choices": choices}
