"""Reasoning outputs of the chat API (vLLM's ``--reasoning-parser``): a thinking model's reply split into its
reasoning, ``<think>...</think>``, and the content after it, whole or as the text streams.

Two parsers, as vLLM names them:
- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ, Qwen3's thinking-only releases whose template opens the
  ``<think>`` block in the prompt): a leading ``<think>`` (after any whitespace) is dropped; everything up to
  ``</think>`` is reasoning, the rest content; a reply that never closes the block is all reasoning.
- ``qwen3`` (Qwen3, whose replies open the block themselves, and skip it when thinking is off): a reply that starts
  with ``<think>`` (after any whitespace) is reasoning up to ``</think>`` (all of it when never closed), then
  content; any other reply is all content.

The same state machine (``ReasoningStream``) splits a streamed reply and a whole one, so both give the same parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningStream:
    """A reply's text as it comes, split by ``parser`` (one of ``REASONING_PARSERS``): ``feed`` returns the new
    (reasoning, content) text, holding back what may be the start of a tag until it is told apart."""

    parser: str
    state: Literal["start", "reasoning", "content"] = "start"
    reasoned: bool = False  # whether the reply has a reasoning part (entered the block)
    _pending: str = ""

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        self._pending += text
        reasoning = content = ""
        if self.state == "start":
            opening = self._pending.lstrip()  # whitespace before the tag goes with it (vLLM's)
            if opening.startswith(THINK_START):
                self._pending = opening[len(THINK_START) :]
                self.state = "reasoning"
            elif THINK_START.startswith(opening) and not finished:
                return "", ""  # may still become the tag
            else:
                self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            end = self._pending.find(THINK_END)
            if end >= 0:
                reasoning, self._pending = self._pending[:end], self._pending[end + len(THINK_END) :]
                self.state = "content"
            else:
                kept = 0 if finished else held_back(self._pending, THINK_END)
                cut = len(self._pending) - kept
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        if self.state == "content":
            content, self._pending = self._pending, ""
        return reasoning, content


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole reply's (reasoning, content), as vLLM's parsers return them: None for a part the reply has not
    (no reasoning block; nothing after it)."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, finished=True)
    return (reasoning if stream.reasoned else None), (content or None)


def held_back(text: str, tag: str) -> int:
    """The length of ``text``'s longest end that begins ``tag`` (it may be the tag's start, so a stream holds it
    back until the next text tells)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
