"""Reasoning outputs (frontend_svc/reasoning.py): each parser's split of hand-worked replies, whole and streamed in
every cut; the HTTP API's replies with a parser are tested in test_openai_http.py."""

from __future__ import annotations

import itertools

import pytest

from frontend_svc.reasoning import ReasoningStream, split_reasoning

THOUGHT = "<think>\nabc\n</think>\n\nxyz"
CASES = [
    # (parser, reply, reasoning, content)
    ("deepseek_r1", THOUGHT, "\nabc\n", "\n\nxyz"),
    ("deepseek_r1", "abc</think>xyz", "abc", "xyz"),  # the block opened by the prompt
    ("deepseek_r1", "abc", "abc", None),  # never closed: all reasoning
    ("deepseek_r1", "<think>abc", "abc", None),
    ("deepseek_r1", "</think>", "", None),
    ("deepseek_r1", "<thi", "<thi", None),
    ("deepseek_r1", "\n <think>a</think>b", "a", "b"),  # whitespace before the tag goes with it (vLLM's)
    ("qwen3", THOUGHT, "\nabc\n", "\n\nxyz"),
    ("qwen3", "abc</think>xyz", None, "abc</think>xyz"),  # a reply that does not open the block: all content
    ("qwen3", "plain <think> later", None, "plain <think> later"),
    ("qwen3", "<think>abc", "abc", None),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "", None, None),
    ("qwen3", "\n<think>a</think>b", "a", "b"),
    ("qwen3", "\n\n", None, "\n\n"),
]


@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), CASES)
def test_a_reply_splits_as_the_parser_says_whole_and_streamed(parser, reply, reasoning, content):
    assert split_reasoning(parser, reply) == (reasoning, content)
    for cuts in [*([cut] for cut in range(1, len(reply))), list(range(1, len(reply)))]:
        stream = ReasoningStream(parser)
        bounds = [0, *cuts, len(reply)]
        parts = [stream.feed(reply[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.feed("", finished=True)]
        assert "".join(r for r, _ in parts) == (reasoning or ""), cuts
        assert "".join(c for _, c in parts) == (content or ""), cuts
        assert stream.reasoned == (reasoning is not None)


def test_a_possible_closing_tag_is_held_back_until_told_apart():
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<think>ab</th") == ("ab", "")
    assert stream.feed("e") == ("</the", "")  # not the tag after all
    assert stream.feed("</think>x") == ("", "x")


def test_a_frontend_config_takes_only_known_parsers():
    from frontend_svc.config import FrontendConfig

    assert FrontendConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        FrontendConfig(reasoning_parser="bogus")  # type: ignore[arg-type]  # the value under test is not a parser
