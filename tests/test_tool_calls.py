"""The forced tool choices' schemas and parsing (frontend_svc/tool_calls.py), against hand-written values; the
HTTP API's replies under them are tested in test_openai_http.py."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from frontend_svc.errors import ValidationError
from frontend_svc.tool_calls import (
    AutoToolChoice,
    ForcedToolChoice,
    HermesToolCallStream,
    RequiredCallStream,
    ToolCallDeltas,
    forced_tool_choice,
    reply_with_calls,
    required_calls_schema,
)

ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}}
PLACE = {"$ref": "#/$defs/place"}
TIME = {"type": "object", "properties": {"tz": PLACE}}
EMPTY = {"type": "object", "properties": {}}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {**PLACE, "$defs": {"place": ADDRESS}}}},
    {"type": "function", "function": {"name": "time", "parameters": {**TIME, "$defs": {"place": ADDRESS}}}},
    {"type": "function", "function": {"name": "noop"}},
]
# Two complete calls (one with non-ASCII text) and a third cut off.
REPLY = '[{"name": "weather", "parameters": {"city": "Zürich"}}, {"name":"noop","parameters":{}} , {"name": "ti'


def test_the_required_schema_is_an_array_of_the_tools_calls_with_their_defs_gathered():
    functions = [t["function"] for t in TOOLS]
    assert required_calls_schema(functions) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {"name": {"type": "string", "enum": ["weather"]}, "parameters": PLACE},
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {"name": {"type": "string", "enum": ["time"]}, "parameters": TIME},
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {"name": {"type": "string", "enum": ["noop"]}, "parameters": EMPTY},
                    "required": ["name", "parameters"],
                },
            ],
        },
        "$defs": {"place": ADDRESS},
    }
    assert "$defs" in TOOLS[0]["function"]["parameters"]  # the request's own schema is left as sent
    assert required_calls_schema(functions, max_calls=1)["maxItems"] == 1  # parallel_tool_calls false
    one = forced_tool_choice(TOOLS, "required", parallel=False)
    assert one is not None and one.schema()["maxItems"] == 1
    clash = [
        {"name": "a", "parameters": {"$defs": {"x": {"type": "string"}}}},
        {"name": "b", "parameters": {"$defs": {"x": {}}}},
    ]
    with pytest.raises(ValidationError) as e:
        required_calls_schema(clash)
    assert e.value.field == "tools" and "$defs.x" in e.value.description


def test_a_named_choice_s_schema_is_its_function_s_parameters():
    assert forced_tool_choice(TOOLS, {"type": "function", "function": {"name": "weather"}}) == ForcedToolChoice(
        [t["function"] for t in TOOLS], "weather"
    )
    twice = [{"function": {"name": "f", "parameters": {"title": "first"}}}, {"function": {"name": "f"}}]
    first = forced_tool_choice(twice, {"function": {"name": "f"}})  # vLLM's: the first tool of the name
    assert first is not None and first.schema() == {"title": "first"}
    both = forced_tool_choice(twice, "required")
    assert both is not None and len(both.schema()["items"]["anyOf"]) == 2
    named = forced_tool_choice(TOOLS, {"function": {"name": "noop"}})
    assert named is not None and named.schema() == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("tools", "tool_choice", "field"),
    [
        (TOOLS, None, "tools"),  # vLLM's default with tools is "auto"
        (TOOLS, "auto", "tool_choice"),
        (None, "required", "tool_choice"),
        (None, {"type": "function", "function": {"name": "weather"}}, "tool_choice"),
        (TOOLS, "always", "tool_choice"),
        (TOOLS, 3, "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "wether"}}, "tool_choice.function.name"),
        (TOOLS, {"type": "function", "function": {"name": 1}}, "tool_choice.function.name"),
        (TOOLS, {"type": "function", "function": "weather"}, "tool_choice.function"),
        (TOOLS, {"type": "code", "function": {"name": "weather"}}, "tool_choice.type"),
        ([{"function": {"name": "f", "parameters": []}}], "required", "tools[0].function.parameters"),
        (["f"], "none", "tools[0]"),
        ([{"function": {"name": "f", "parameters": {"$defs": [1]}}}], "required", "tools[0].function.parameters"),
    ],
)
def test_tool_usage_vllm_refuses_is_refused_naming_the_field(tools, tool_choice, field):
    with pytest.raises(ValidationError) as e:
        forced_tool_choice(tools, tool_choice, sent=tool_choice is not None)
    assert e.value.field == field


@pytest.mark.parametrize(
    ("tools", "tool_choice"),
    [(None, None), ([], None), (TOOLS, None), (TOOLS, "none"), (None, "none"), ([], "required")],
)
def test_no_call_is_forced_without_tools_or_under_none(tools, tool_choice):
    assert forced_tool_choice(tools, tool_choice) is None  # (TOOLS, None): an explicit null, vLLM's "none"


def test_required_calls_stream_whole_as_each_completes_however_the_text_is_split():
    """The two complete calls of REPLY, worked out by hand, whatever the text's split into deltas."""
    expected = [("weather", '{"city": "Zürich"}'), ("noop", "{}")]
    for cut in range(len(REPLY) + 1):
        for pieces in ([REPLY[:cut], REPLY[cut:]], list(REPLY[:cut]) + [REPLY[cut:]]):
            stream = RequiredCallStream()
            entries = [entry for piece in pieces for entry in stream.feed(piece)]
            assert [e["index"] for e in entries] == [0, 1]
            assert [(e["function"]["name"], e["function"]["arguments"]) for e in entries] == expected
            assert all(e["type"] == "function" and e["id"].startswith("chatcmpl-tool-") for e in entries)


def test_a_whole_reply_gives_the_calls_it_completed_and_the_finish_reason_openai_gives():
    required = ForcedToolChoice({})
    content, calls, reason = reply_with_calls(required, REPLY, "length")
    assert content == "" and reason == "length" and [c["function"]["name"] for c in calls] == ["weather", "noop"]
    whole = '[{"name": "noop", "parameters": {}}]'
    assert reply_with_calls(required, whole, "stop")[2] == "tool_calls"
    assert reply_with_calls(required, '[{"name": "no', "length") == ('[{"name": "no', [], "length")
    content, (call,), reason = reply_with_calls(ForcedToolChoice({}, "noop"), '{"a', "length")
    assert (content, call["function"], reason) == ("", {"name": "noop", "arguments": '{"a'}, "length")


def test_a_named_call_streams_its_name_once_then_the_arguments_text():
    deltas = ToolCallDeltas(ForcedToolChoice({}, "weather"))
    first, reason = deltas.delta('{"ci', None)
    (entry,) = first["tool_calls"]
    assert (entry["index"], entry["type"]) == (0, "function") and reason is None
    assert entry["function"] == {"name": "weather", "arguments": '{"ci'}
    assert deltas.delta('ty": 1}', None) == ({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]}, None)
    assert deltas.delta("", "stop") == ({}, "stop")
    required = ToolCallDeltas(ForcedToolChoice({}))
    (call,) = required.delta('[{"name": "noop", "parameters": {}}', None)[0]["tool_calls"]
    assert call["function"] == {"name": "noop", "arguments": "{}"}
    assert required.delta("]", "stop") == ({}, "tool_calls")
    json.loads(required.required.text)  # the whole array went through


# A Hermes-format reply (Qwen2.5's and Qwen3's templates ask for this): text, two calls, then a line after them.
HERMES = (
    'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\nDone.'
)


def fed(text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """``text`` through a HermesToolCallStream in pieces cut at ``cuts``, then finished: (content, entries)."""
    stream = HermesToolCallStream()
    bounds = [0, *cuts, len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.feed("", finished=True)]
    return "".join(d.get("content", "") for d in deltas), [e for d in deltas for e in d.get("tool_calls", [])]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (HERMES, "Sure.\n", [("weather", '{"city": "Zürich"}'), ("noop", "{}")]),  # vLLM's: no text after a call
        ("no call here, only <tool_ and <tool_call", "no call here, only <tool_ and <tool_call", []),
        ('x<tool_call>{"name": "a", "arguments": {"b": 1}}', "x", [("a", '{"b": 1}')]),  # cut inside the call
        ('<tool_call>{"name": "a", "arguments": "{\\"b\\": 1}"}</tool_call>', "", [("a", '{"b": 1}')]),  # as text
        ("<tool_call>{oops}</tool_call> after", "<tool_call>{oops}</tool_call> after", []),  # no call: the text
        (
            '<tool_call>{oops}</tool_call>, <tool_call>{"name": "a"}</tool_call>!',
            "<tool_call>{oops}</tool_call>, ",
            [("a", "{}")],
        ),
    ],
)
def test_hermes_calls_and_content_come_out_whatever_the_text_s_split(text, content, calls):
    """Hand-worked values, with the text cut into two pieces at every point and into single characters."""
    for cuts in [*([cut] for cut in range(1, len(text))), list(range(1, len(text)))]:
        got_content, entries = fed(text, cuts)
        assert got_content == content, cuts
        assert [(e["function"]["name"], e["function"]["arguments"]) for e in entries] == calls
        assert [e["index"] for e in entries] == list(range(len(calls)))


def test_an_auto_reply_s_content_is_its_text_before_the_calls_or_null():
    auto = AutoToolChoice()
    content, calls, reason = reply_with_calls(auto, HERMES, "stop")
    assert (
        content == "Sure.\n"
        and reason == "tool_calls"
        and [c["function"]["name"] for c in calls] == ["weather", "noop"]
    )
    assert reply_with_calls(auto, '<tool_call>{"name": "a"}</tool_call>', "stop")[0] is None  # vLLM's null
    assert reply_with_calls(auto, "plain text", "length") == ("plain text", [], "length")
    assert reply_with_calls(auto, HERMES[:60], "length")[1:] == ([], "length")  # cut inside its first call


def test_auto_is_refused_without_a_parser_and_not_forced_with_one():
    with pytest.raises(ValidationError):
        forced_tool_choice(TOOLS, "auto")
    assert forced_tool_choice(TOOLS, "auto", auto=True) is None
    assert forced_tool_choice(TOOLS, None, auto=True, sent=False) is None
    with pytest.raises(ValidationError) as e:  # the tools are checked whatever the choice
        forced_tool_choice([{"type": "retrieval"}], None, auto=True, sent=False)
    assert e.value.field == "tools[0].type"


def test_calls_nested_too_deep_to_decode_are_no_calls():
    """json's decoder gives up (RecursionError) on deep nesting: such a call is text, never a server error."""
    deep = '<tool_call>{"name": "a", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>"
    assert reply_with_calls(AutoToolChoice(), deep, "stop") == (deep, [], "stop")
    array = '[{"name": "a", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}]"
    assert reply_with_calls(ForcedToolChoice([{"name": "a"}]), array, "stop") == (array, [], "stop")
