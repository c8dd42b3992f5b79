"""Incremental detokenization with stop strings (vLLM ``vllm/v1/engine/detokenizer.py``).

One detokenizer per request turns output token ids into text as they arrive:
- ``FastIncrementalDetokenizer``: tokenizers' ``DecodeStream``, primed with the prompt's last tokens so the first
  output token gets its context (SentencePiece's leading space, bytes of a split character).
- ``SlowIncrementalDetokenizer``: the offset algorithm of TGI / vLLM ``detokenize_incrementally`` over
  ``convert_ids_to_tokens`` and ``convert_tokens_to_string``, for tokenizers without a Rust backend.
- ``IncrementalDetokenizer``: no text at all (``detokenize=False`` or no tokenizer).

Stop strings are matched on the text as it grows; while a request runs, the last ``max(len(stop)) - 1``
characters are held back, so a streamed delta never holds the beginning of a stop string that completes later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from frontend_svc.sampling_params import SamplingParams
from frontend_svc.stop_strings import check_stop_strings

# Prompt tokens that prime a detokenizer: the shortest suffix of 4 to 23 tokens that decodes cleanly (no
# U+FFFD: it does not start inside a character), else the whole prompt. As vLLM's FastIncrementalDetokenizer.
MIN_PRIMING_TOKENS, MAX_PRIMING_TOKENS = 4, 23
# Tokens the slow algorithm decodes together before the one it emits (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
SLOW_PREFIX_OFFSET = 5


class IncrementalDetokenizer:
    """Tracks output token ids; produces no text. Base of the text detokenizers."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []  # output ids, the stop token included
        self.output_text = ""

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Take a step's new ids. Returns (matched stop string or None, number of surplus new ids dropped)."""
        self.token_ids.extend(new_token_ids)
        return None, 0

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        return ""

    def finish(self) -> str | None:
        """Called once when the request ends; returns a stop string completed by text released only now."""
        return None

    @classmethod
    def from_request(
        cls, tokenizer: Any | None, params: SamplingParams, prompt_token_ids: list[int]
    ) -> IncrementalDetokenizer:
        """The right detokenizer for a request: none, fast (Rust tokenizer backend) or slow."""
        if tokenizer is None or not params.detokenize:
            return IncrementalDetokenizer()
        if getattr(tokenizer, "backend_tokenizer", None) is not None:
            return FastIncrementalDetokenizer(tokenizer, params, prompt_token_ids)
        return SlowIncrementalDetokenizer(tokenizer, params, prompt_token_ids)


class TextDetokenizer(IncrementalDetokenizer):
    """Text, stop strings and the hold-back buffer; subclasses say how one token turns into text."""

    def __init__(self, params: SamplingParams) -> None:
        super().__init__()
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.output_text_buffer_length
        self._last_output_text_offset = 0
        self._pending_ids: list[int] = []  # trailing ids whose text is not out yet (an incomplete character)

    def decode_next(self, token_id: int) -> str | None:
        """Text the token completes; None while it is part of an incomplete character."""
        raise NotImplementedError

    def flush_text(self, pending_ids: list[int]) -> str:
        """Text of trailing ids that never completed a character: decoded on their own, so each invalid byte
        shows as U+FFFD and no text already sent is repeated."""
        raise NotImplementedError

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Append new ids and their text; when the core stopped on EOS or a stop id, the last id's text is left
        out unless ``include_stop_str_in_output``. Checks stop strings after each token (once past min_tokens)
        and truncates the text at a match; ids after the one completing it are surplus and dropped.
        """
        skipped_stop_token_id = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            text = self.decode_next(token_id)
            if text is None:
                self._pending_ids.append(token_id)
                continue
            self._pending_ids = []
            stop_str = self._append_text(text)
            if stop_str is not None:
                return stop_str, len(new_token_ids) - i - 1 + (skipped_stop_token_id is not None)
        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)
        return None, 0

    def finish(self) -> str | None:
        """At the end of a request that no stop string ended: add the text of ids left incomplete (invalid UTF-8
        at the end), once. Returns a stop string that this last text completes, if any."""
        if not self._pending_ids:
            return None
        text = self.flush_text(self._pending_ids)
        self._pending_ids = []
        return self._append_text(text)

    def _append_text(self, text: str) -> str | None:
        """Add text; once past min_tokens, truncate at a stop string it completes and return that string."""
        self.output_text += text
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(self.output_text, len(text), self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """All text so far (or, with ``delta``, what is new since the last call), minus the hold-back buffer
        while the request runs."""
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(0, len(self.output_text) - buffer_length)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last < length:
            self._last_output_text_offset = length
            return self.output_text[last:length]
        return ""


class FastIncrementalDetokenizer(TextDetokenizer):
    """tokenizers' ``DecodeStream`` over the tokenizer's Rust backend."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        super().__init__(params)
        from tokenizers.decoders import DecodeStream

        self._decode_stream_class = DecodeStream
        self.backend = tokenizer.backend_tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.prompt_tail = clean_suffix(self._decode, list(prompt_token_ids))
        self.stream = self._primed_stream(self.prompt_tail)

    def _decode(self, token_ids: list[int]) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _primed_stream(self, context_ids: list[int]) -> Any:
        stream = self._decode_stream_class(skip_special_tokens=self.skip_special_tokens)
        for token_id in context_ids:
            try:
                stream.step(self.backend, token_id)
            except Exception:  # a context the stream cannot take just primes less
                stream = self._decode_stream_class(skip_special_tokens=self.skip_special_tokens)
        return stream

    def decode_next(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.backend, token_id)
        except Exception as e:
            if "Invalid prefix" not in str(e):
                return ""  # an id the tokenizer cannot decode (out of its vocabulary) adds no text
            # The stream's buffered prefix no longer decodes as a prefix (vLLM resets and retries the same way).
            self.stream = self._primed_stream(clean_suffix(self._decode, self.prompt_tail + self.token_ids[:-1]))
            try:
                return self.stream.step(self.backend, token_id)
            except Exception:
                return ""

    def flush_text(self, pending_ids: list[int]) -> str:
        return self._decode(pending_ids)


class SlowIncrementalDetokenizer(TextDetokenizer):
    """The prefix/read offset algorithm (TGI, vLLM ``detokenize_incrementally``) over python tokenizers."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        super().__init__(params)
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.spaces_between_special_tokens = params.spaces_between_special_tokens
        self.added_vocab = set(tokenizer.get_added_vocab())
        self.all_special_tokens = set(tokenizer.all_special_tokens)
        self.tokens = self._to_tokens(prompt_token_ids[-(SLOW_PREFIX_OFFSET + 2) :])
        self.prefix_offset = max(len(self.tokens) - SLOW_PREFIX_OFFSET, 0)
        self.read_offset = len(self.tokens)

    def decode_next(self, token_id: int) -> str | None:
        self.tokens.extend(self._to_tokens([token_id]))
        prefix_text = self._tokens_to_string(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._tokens_to_string(self.tokens[self.prefix_offset :])
        if new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for its next bytes
        if len(new_text) <= len(prefix_text):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return new_text[len(prefix_text) :]

    def flush_text(self, pending_ids: list[int]) -> str:
        return self._tokens_to_string(self.tokens[self.read_offset :])

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(token_ids, skip_special_tokens=self.skip_special_tokens)
        return [t for t in tokens if t is not None]  # ids outside the vocabulary have no token

    def _tokens_to_string(self, tokens: list[str]) -> str:
        """vLLM ``_convert_tokens_to_string_with_added_encoders``: added tokens stand alone, optionally
        separated by spaces; the rest goes through ``convert_tokens_to_string``."""
        if not self.added_vocab:
            return self.tokenizer.convert_tokens_to_string(tokens)
        sub_texts: list[str] = []
        current: list[str] = []
        for token in tokens:
            if self.skip_special_tokens and token in self.all_special_tokens:
                continue
            if token in self.added_vocab:
                if current:
                    sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
                    current = []
                sub_texts.append(token)
            else:
                current.append(token)
        if current:
            sub_texts.append(self.tokenizer.convert_tokens_to_string(current))
        return (" " if self.spaces_between_special_tokens else "").join(sub_texts)


def clean_suffix(decode: Callable[[list[int]], str], token_ids: list[int]) -> list[int]:
    """The shortest suffix of ``token_ids`` (4 to 23 ids) whose decode holds no U+FFFD, else all of them."""
    if len(token_ids) <= MIN_PRIMING_TOKENS:
        return list(token_ids)
    for length in range(MIN_PRIMING_TOKENS, min(len(token_ids), MAX_PRIMING_TOKENS) + 1):
        suffix = token_ids[-length:]
        if "\ufffd" not in decode(suffix):
            return list(suffix)
    return list(token_ids)
