"""Incremental detokenization with stop strings (vLLM ``vllm/v1/engine/detokenizer.py``).

One detokenizer per request turns output token ids into text as they arrive, over an incremental decoder
(``frontend_svc/token_decoders.py``) primed with the prompt's last tokens so the first output token gets its context
(SentencePiece's leading space, bytes of a split character):
- ``FastIncrementalDetokenizer``: tokenizers' ``DecodeStream``.
- ``SlowIncrementalDetokenizer``: the offset algorithm of TGI / vLLM ``detokenize_incrementally``, for tokenizers
  without a Rust backend.
- ``IncrementalDetokenizer``: no text at all (``detokenize=False`` or no tokenizer).

Text per token: each output token keeps the text it added (``token_texts``): "" while it leaves a character
incomplete, the whole character on the token that completes it. They concatenate to the output text (before a stop
string truncates it), and logprobs reuse them, except that a token beginning the text keeps in its logprob the
SentencePiece leading space the text drops (as vLLM's logprobs show it). A character the prompt began belongs to
the prompt: the output tokens that complete it add nothing (as vLLM's slow path; its fast path, which primes its
``DecodeStream`` with the whole prompt in that case, gives the completed character to the output).

Invalid UTF-8 shows as U+FFFD, one per maximal subpart: Unicode's recommended substitution, which Python's
``bytes.decode("utf-8", errors="replace")`` and Rust's ``String::from_utf8_lossy`` (hence byte-level BPE decoders,
gpt2's) implement. tokenizers' ``ByteFallback`` decoder instead turns a whole run of N byte tokens into N U+FFFD
once one byte in it is invalid, which takes back characters already streamed and breaks ``DecodeStream`` ("Invalid
prefix"), or gives no text until a token that is no byte. Then (or as soon as the run's bytes end a character) the
detokenizer emits the pending bytes' text, decoded in their context with each invalid part spelled as the bytes of
U+FFFD, and restarts its decoder from the settled text before them (from a one-letter anchor when there is none),
so the next token keeps its context, SentencePiece's leading space included (vLLM restarts its ``DecodeStream``
from nothing and drops the pending bytes).

Release: stop strings are matched on the text as it grows; while a request runs, the last ``max(len(stop)) - 1``
characters are held back, so a streamed delta never holds the beginning of a stop string that completes later. Ids
go out with their text: only ids whose text is complete (no unfinished character) and wholly outside the hold-back,
with the text up to the end of the last of them, so the ids sent always decode to the text sent. At the end
everything goes out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from frontend_svc.sampling_params import SamplingParams
from frontend_svc.stop_strings import check_stop_strings
from frontend_svc.token_decoders import (
    REPLACEMENT_CHAR,
    DecoderDesyncError,
    OffsetDecoder,
    StreamDecoder,
    TokenDecoder,
)

# Prompt tokens that prime a detokenizer: the shortest suffix of 4 to 23 tokens that starts at a character
# boundary, as vLLM's FastIncrementalDetokenizer; the same bounds for the context a decoder restarts from.
MIN_PRIMING_TOKENS, MAX_PRIMING_TOKENS = 4, 23
# Settled tokens a logprob candidate is decoded after (SentencePiece's leading space; vLLM's U+FFFD correction looks
# back at most 4 sampled tokens).
NUM_CANDIDATE_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Tracks output token ids; produces no text. Base of the text detokenizers."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []  # output ids, the stop token included
        self.output_text = ""
        self._num_sent_ids = 0  # ids already in DELTA outputs
        self._num_sent_chars = 0  # characters of output_text already in DELTA outputs

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> tuple[str | None, int]:
        """Take a step's new ids. Returns (matched stop string or None, number of surplus new ids dropped)."""
        self.token_ids.extend(new_token_ids)
        return None, 0

    def finish(self) -> str | None:
        """Called once when the request ends; returns a stop string completed by text released only now."""
        return None

    def get_next_output(self, finished: bool, delta: bool) -> tuple[str, int, int]:
        """What an output carries now: ``(text, start, end)``, its ids being ``token_ids[start:end]``. With ``delta``
        what is new since the last call, else everything released so far (``start`` 0)."""
        num_ids, num_chars = self._released(finished)
        if not delta:
            return self.output_text[:num_chars], 0, num_ids
        text, start = self.output_text[self._num_sent_chars : num_chars], self._num_sent_ids
        self._num_sent_chars = max(self._num_sent_chars, num_chars)
        self._num_sent_ids = max(self._num_sent_ids, num_ids)
        return text, start, num_ids

    def _released(self, finished: bool) -> tuple[int, int]:
        """(ids, characters of output_text) that may go out now."""
        return len(self.token_ids), len(self.output_text)

    def token_text(self, index: int) -> str | None:
        """Text for output token ``index``'s logprob; None without detokenization."""
        return None

    def candidate_texts(self, index: int, token_ids: list[int]) -> Sequence[str | None]:
        """Texts for logprob candidates in place of output token ``index``; None without detokenization."""
        return [None] * len(token_ids)

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

    @classmethod
    def for_prompt(
        cls, tokenizer: Any | None, params: SamplingParams, prompt_token_ids: list[int]
    ) -> IncrementalDetokenizer:
        """A detokenizer that has read the prompt as if it were output (no stop strings): its per-token and
        candidate texts are those of the prompt positions, for prompt logprobs."""
        detokenizer = cls.from_request(tokenizer, params, [])
        if isinstance(detokenizer, TextDetokenizer):
            detokenizer.stop, detokenizer.stop_buffer_length = [], 0
        detokenizer.update(list(prompt_token_ids), stop_terminated=False)
        detokenizer.finish()
        return detokenizer


class TextDetokenizer(IncrementalDetokenizer):
    """Text, per-token texts, invalid bytes, stop strings and release over an incremental ``TokenDecoder``."""

    def __init__(
        self, tokenizer: Any, params: SamplingParams, decoder: TokenDecoder, prompt_token_ids: list[int]
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.output_text_buffer_length
        self.token_texts: list[str | None] = []  # per output id: the text it added; None: not decoded (stop token)
        self._text_ends: list[int] = []  # per output id: len(output_text) after it
        # Positions count the context ids, then the output ids.
        self._context_ids: list[int] = []  # the prompt's last ids the decoder was primed with
        self._pending_ids: list[int] = []  # ids the decoder holds without text yet (an unfinished character)
        self._pending_start = 0  # position of the first pending id; past the last id when none
        self._pending_starts: list[int] = []  # per output id: _pending_start when it arrived (its candidates' context)
        self._num_prompt_chars = 0  # characters of the decoder's next text that the prompt began
        self._num_dangling_chars = 0  # the same, as it was after priming
        self._num_released_ids = 0
        self._special_ids_cache: frozenset[int] | None = None
        self._prime(prompt_token_ids)

    # Priming and recovery.
    def _prime(self, prompt_token_ids: list[int]) -> None:
        """Prime the decoder with the prompt's last ids, so the first output token has its context. Ids it still
        holds at the end began a character the output may complete; their text belongs to the prompt."""
        self._context_ids = priming_ids(self.decoder.decode, list(prompt_token_ids))
        held = self._restart(self._context_ids)
        self._pending_ids = held
        self._pending_start = len(self._context_ids) - len(held)
        num_chars = len(self._pending_text(self._settled_context())) if held else 0
        self._num_prompt_chars = self._num_dangling_chars = num_chars

    def _restart(self, context_ids: list[int]) -> list[int]:
        """A fresh decoder that has read ``context_ids``; returns the trailing ones it holds without text."""
        self.decoder.reset()
        held: list[int] = []
        for token_id in context_ids:
            if not self.decoder.in_vocab(token_id):
                continue
            try:
                text = self.decoder.step(token_id)
            except DecoderDesyncError:  # a context the decoder cannot take just primes less
                self.decoder.reset()
                held = []
                continue
            if text is None:
                held.append(token_id)
            else:
                held = []
        return held

    def _next_text(self, token_id: int, position: int) -> str:
        """The text output id ``token_id`` (at ``position``) adds; keeps the pending run up to date."""
        if not self.decoder.in_vocab(token_id):
            if not self._pending_ids:
                self._pending_start = position + 1
            return ""  # an id outside the tokenizer's vocabulary adds no text (vLLM); the decoder never sees it
        try:
            text = self.decoder.step(token_id)
            if text is not None and self._pending_ids and REPLACEMENT_CHAR in text and self.decoder.byte_values():
                # ByteFallback replaced a run that began before this token; its text would not be per subpart.
                raise DecoderDesyncError("invalid byte run")
        except DecoderDesyncError:
            text = self._recover(position, token_id)
        else:
            if text is None:
                if not self._pending_ids and self.skip_special_tokens and token_id in self._special_ids():
                    self._pending_start = position + 1  # a skipped special token: no text, none to wait for
                    return ""
                if not self._pending_ids:
                    self._pending_start = position
                self._pending_ids.append(token_id)
                if not self.decoder.ends_in_invalid_bytes(self._pending_ids):
                    return ""
                # ByteFallback gives a run with invalid bytes no text until a token that is no byte: give it now.
                text = self._recover(position)
            else:
                self._pending_ids, self._pending_start = [], position + 1
        return self._drop_prompt_chars(text)

    def _recover(self, position: int, token_id: int | None = None) -> str:
        """The decoder's text for the pending ids is wrong or late (their bytes are invalid UTF-8): emit their
        own text, restart from the settled ids before them, then feed it ``token_id`` (at ``position``), the token
        it refused, again; without one, ``position`` is the last pending id's."""
        context = self._settled_context()
        head = self._pending_text(context)
        if head and not self.decoder.decode(context):
            # No settled text to restart from: an anchor, so the next token does not begin the text (SentencePiece
            # would strip its leading space).
            context = self.decoder.anchor_ids()
        self._restart(context)
        self._pending_ids, self._pending_start = [], position + 1
        if token_id is None:
            return head
        try:
            tail = self.decoder.step(token_id)
        except DecoderDesyncError:  # not even after clean text: the token adds none
            self._restart(context)
            tail = ""
        if tail is None:
            self._pending_ids, self._pending_start = [token_id], position
            return head
        return head + tail

    def _settled_context(self) -> list[int]:
        """Settled ids right before the pending run to decode after: ``clean_context`` of the last 23."""
        settled = self._ids(max(0, self._pending_start - MAX_PRIMING_TOKENS), self._pending_start)
        return clean_context(self.decoder.decode, settled)

    def _pending_text(self, context: list[int]) -> str:
        """What the pending ids add to the text of ``context``, the settled ids before them; invalid bytes as U+FFFD
        per maximal subpart (``TokenDecoder.repaired_ids``)."""
        base = self.decoder.decode(context)
        return _text_after(base, self.decoder.decode(self.decoder.repaired_ids(context + self._pending_ids)))

    def _drop_prompt_chars(self, text: str) -> str:
        """Text without the characters the prompt began (they come whole, in the first text after priming)."""
        if self._num_prompt_chars and text:
            cut = min(self._num_prompt_chars, len(text))
            self._num_prompt_chars -= cut
            text = text[cut:]
        return text

    def _special_ids(self) -> frozenset[int]:
        if self._special_ids_cache is None:
            self._special_ids_cache = frozenset(self.tokenizer.all_special_ids)
        return self._special_ids_cache

    def _ids(self, start: int, end: int) -> list[int]:
        """Ids at positions [start, end): context ids, then output ids."""
        num_context = len(self._context_ids)
        if end <= num_context:
            return self._context_ids[start:end]
        if start >= num_context:
            return self.token_ids[start - num_context : end - num_context]
        return self._context_ids[start:] + self.token_ids[: end - num_context]

    # Text, stop strings, release.
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
            self._pending_starts.append(self._pending_start)
            self.token_ids.append(token_id)
            text = self._next_text(token_id, len(self._context_ids) + len(self.token_ids) - 1)
            self.token_texts.append(text)
            stop_str = self._append_text(text)
            self._text_ends.append(len(self.output_text))
            if stop_str is not None:
                return stop_str, len(new_token_ids) - i - 1 + (skipped_stop_token_id is not None)
        if skipped_stop_token_id is not None:
            self._pending_starts.append(self._pending_start)
            self.token_ids.append(skipped_stop_token_id)
            self.token_texts.append(None)
            self._text_ends.append(len(self.output_text))
        return None, 0

    def finish(self) -> str | None:
        """At the end of a request that no stop string ended: add the text of ids left pending (invalid UTF-8 at
        the end), once, to the last of them with text. Returns a stop string that this last text completes."""
        if not self._pending_ids:
            return None
        text = self._drop_prompt_chars(self._pending_text(self._settled_context()))
        first = max(0, self._pending_start - len(self._context_ids))
        self._pending_ids, self._pending_start = [], len(self._context_ids) + len(self.token_ids)
        special_ids = self._special_ids() if self.skip_special_tokens else frozenset()
        for i in range(len(self.token_ids) - 1, first - 1, -1):
            if self.token_texts[i] is not None and self.token_ids[i] not in special_ids:
                self.token_texts[i] = (self.token_texts[i] or "") + text
                break
        return self._append_text(text)

    def _append_text(self, text: str) -> str | None:
        """Add text; once past min_tokens, truncate at a stop string it completes and return that string."""
        # Appended with no other reference to the text, which CPython then grows in place: the text of n tokens
        # costs O(n), where `self.output_text += text` copies it for every token (O(n^2): seconds for the prompt
        # logprobs of a 100k-token prompt).
        output_text, self.output_text = self.output_text, ""
        output_text += text
        self.output_text = output_text
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(self.output_text, len(text), self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_str, truncate_to = match
        if truncate_to != -1:
            self.output_text = self.output_text[:truncate_to]
        return stop_str

    def _released(self, finished: bool) -> tuple[int, int]:
        """Finished: everything. Else the ids whose text is complete and ends before the hold-back buffer, and the
        text up to the end of the last of them. O(1) amortized: the count only grows."""
        if finished:
            self._num_released_ids = len(self.token_ids)
            return len(self.token_ids), len(self.output_text)
        limit = len(self.output_text) - self.stop_buffer_length
        num_settled = min(len(self.token_ids), max(0, self._pending_start - len(self._context_ids)))
        num_ids = self._num_released_ids
        while num_ids < num_settled and self._text_ends[num_ids] <= limit:
            num_ids += 1
        self._num_released_ids = num_ids
        return num_ids, self._text_ends[num_ids - 1] if num_ids else 0

    # Logprob texts.
    def token_text(self, index: int) -> str:
        """Output token ``index``'s text for its logprob: the text it added to the output, so the sampled tokens'
        texts concatenate to the output text. A token whose text the output leaves out (the stop token, a special
        token under skip_special_tokens) gets its text as a candidate, as does a token (not a byte) that begins the
        text (SentencePiece's leading space, which the text drops, kept as vLLM's logprobs keep it; also so that it
        matches its own entry among the candidates)."""
        text, token_id = self.token_texts[index], self.token_ids[index]
        if (
            text is None
            or (self.skip_special_tokens and token_id in self._special_ids())
            or (token_id not in self.decoder.byte_values() and self._begins_text(index))
        ):
            return self.candidate_texts(index, [token_id])[0]
        return text

    def _begins_text(self, index: int) -> bool:
        """Whether the tokens right before output token ``index`` decode to no text (none, or only special
        tokens the text skips; pending bytes decode to U+FFFD): it would begin the text. Output text before it
        answers without a decode (the common case, on the logprobs path of every token)."""
        if index and self._text_ends[index - 1]:
            return False
        position = len(self._context_ids) + index
        before = self._ids(max(0, position - NUM_CANDIDATE_CONTEXT_TOKENS), position)
        return not self.decoder.decode(self.decoder.repaired_ids(before))

    def candidate_texts(self, index: int, token_ids: list[int]) -> list[str]:
        """The text each of ``token_ids`` would add in place of output token ``index`` (logprob top-k): decoded
        after the settled tokens before it and the pending bytes of an unfinished character (so a candidate that
        completes it gets the whole character); "" where it would leave a character unfinished. A special token's
        text is its content. Characters the prompt began stay the prompt's. At the beginning of the text the
        candidates are decoded after a one-letter anchor: SentencePiece would strip their leading space, and
        "▁Hello" and "Hello" would both read "Hello" (vLLM's logprobs restore that space too)."""
        if not token_ids:
            return []  # logprobs=0: no decode on the hot path
        start = self._pending_starts[index]
        context = self._ids(max(0, start - NUM_CANDIDATE_CONTEXT_TOKENS), start)
        pending = self._ids(start, len(self._context_ids) + index)
        if self._begins_text(index):
            # What is held before it (SentencePiece's bare "▁", skipped special tokens) decodes to nothing: it is
            # context after the anchor, not text of this token.
            context, pending = [*self.decoder.anchor_ids(), *pending], []
        num_prompt_chars = self._num_dangling_chars if start < len(self._context_ids) else 0
        # Invalid bytes as U+FFFD per maximal subpart; a byte candidate joins the run of the pending bytes.
        base = self.decoder.decode(self.decoder.repaired_ids(context))
        repaired = self.decoder.repaired_ids(context + pending)
        byte_values = self.decoder.byte_values()
        texts = []
        for token_id in token_ids:
            if token_id in self._special_ids():
                texts.append(self.decoder.token_string(token_id))
                continue
            if not self.decoder.in_vocab(token_id):
                texts.append("")
                continue
            if token_id in byte_values:
                full = self.decoder.decode(self.decoder.repaired_ids([*context, *pending, token_id]))
            else:
                full = self.decoder.decode([*repaired, token_id])
            if full.endswith(REPLACEMENT_CHAR):
                texts.append("")  # the character is still unfinished
            else:
                texts.append(_text_after(base, full)[num_prompt_chars:])
        return texts


class FastIncrementalDetokenizer(TextDetokenizer):
    """Over tokenizers' ``DecodeStream`` (the tokenizer's Rust backend)."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        decoder = StreamDecoder(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        super().__init__(tokenizer, params, decoder, prompt_token_ids)


class SlowIncrementalDetokenizer(TextDetokenizer):
    """Over the offset algorithm of TGI / vLLM ``detokenize_incrementally`` (python tokenizers)."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        decoder = OffsetDecoder(tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens)
        super().__init__(tokenizer, params, decoder, prompt_token_ids)


def priming_ids(decode: Callable[[list[int]], str], token_ids: list[int]) -> list[int]:
    """The prompt's last ids that prime a detokenizer: the shortest suffix of 4 to 23 ids whose decode holds no
    U+FFFD before its trailing ones (it starts at a character boundary; it may end inside a character), else the
    last 23. vLLM's FastIncrementalDetokenizer asks for no U+FFFD at all and else takes the whole prompt."""
    if len(token_ids) <= MIN_PRIMING_TOKENS:
        return list(token_ids)
    for length in range(MIN_PRIMING_TOKENS, min(len(token_ids), MAX_PRIMING_TOKENS) + 1):
        suffix = token_ids[-length:]
        if REPLACEMENT_CHAR not in decode(suffix).rstrip(REPLACEMENT_CHAR):
            return list(suffix)
    return list(token_ids[-MAX_PRIMING_TOKENS:])


def clean_context(decode: Callable[[list[int]], str], token_ids: list[int]) -> list[int]:
    """Context a decoder restarts from, after text already settled: the shortest suffix of 4 to 23 of
    ``token_ids`` whose decode holds no U+FFFD, else the longest shorter one, else none."""
    num_ids = len(token_ids)
    longer = range(MIN_PRIMING_TOKENS, min(num_ids, MAX_PRIMING_TOKENS) + 1)
    shorter = range(min(num_ids, MIN_PRIMING_TOKENS - 1), 0, -1)
    for length in (*longer, *shorter):
        suffix = token_ids[-length:]
        if REPLACEMENT_CHAR not in decode(suffix):
            return list(suffix)
    return []


def _text_after(base: str, full: str) -> str:
    """What ``full`` adds to ``base``: its tail past ``base``, or past their common prefix if it changed it."""
    if full.startswith(base):
        return full[len(base) :]
    return full[len(os.path.commonprefix([base, full])) :]
