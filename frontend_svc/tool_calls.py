"""Tool calls of the chat API, as vLLM serves them.

A forced choice, ``tool_choice`` ``"required"`` or a named function (``{"type": "function", "function": {"name":
...}}``), becomes the reply's structured-output constraint (vLLM's ``_get_json_schema_from_tool``): a named
function's reply is a JSON document of its ``parameters`` schema, which is the call's ``arguments`` as generated;
a required choice's reply is a JSON array of at least one ``{"name": ..., "parameters": {...}}`` object, one of
the tools each (an ``anyOf`` over them), parsed into the calls. ``"auto"`` (vLLM's default where tools are sent)
lets the model decide, on a server started with a tool-call parser (``--enable-auto-tool-choice --tool-call-parser
hermes``): its calls are parsed out of the reply (``HermesToolCallStream``); without one it is refused.
``"none"`` only renders the tools. Streamed, a named call's arguments go out as the text comes (the first delta
with the call's id and name, as vLLM's), a required or parsed call as one delta once complete
(``ToolCallDeltas``); a whole reply goes through the same state machines (``reply_with_calls``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend_svc.errors import ValidationError
from frontend_svc.reasoning import held_back

# Why tool_choice "auto" (vLLM's default where tools are sent) is refused: it needs a parser of the model's format.
AUTO_WHY = (
    "needs the server's tool-call parser (--enable-auto-tool-choice --tool-call-parser hermes): use tool_choice "
    '"none" (the tools only rendered), "required" or a named function ({"type": "function", "function": {"name": '
    "...}})"
)
NAMED_USAGE = 'a named tool choice is {"type": "function", "function": {"name": "my_function"}}'


def make_tool_call_id() -> str:
    """A call's id, as vLLM's: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def function_call(name: str, arguments: str) -> dict[str, Any]:
    """One ``tool_calls`` entry of a chat message: a function called with ``arguments`` (its JSON text)."""
    call = {"name": name, "arguments": arguments}
    return {"id": make_tool_call_id(), "type": "function", "function": call}


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The request's tools' functions, in order, each checked as OpenAI's schema has it: ``{"type": "function",
    "function": {"name": str, "description"?: str, "parameters"?: object, its "$defs" an object}}``.

    Raises:
        ValidationError: naming ``tools[i]`` and the bad key.
    """
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValidationError(where, f"must be an object, got {type(tool).__name__}")
        if tool.get("type", "function") != "function":
            raise ValidationError(f"{where}.type", f"must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ValidationError(f"{where}.function", "must be an object with the function's name")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValidationError(f"{where}.function.name", f"must be a non-empty string, got {name!r}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValidationError(f"{where}.function.parameters", "must be a JSON schema object")
        if parameters is not None and not isinstance(parameters.get("$defs", {}), dict):
            raise ValidationError(f"{where}.function.parameters", "$defs must be an object of named schemas")
        functions.append(function)
    return functions


def forced_function_name(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` calls; None for the string choices.

    Raises:
        ValidationError: an object that is not ``{"type": "function", "function": {"name": non-empty str}}``, or a
            string other than none, auto and required.
    """
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValidationError(
                "tool_choice", f'must be "none", "auto", "required" or a named function, got {tool_choice!r}'
            )
        return None
    if not isinstance(tool_choice, dict):
        raise ValidationError("tool_choice", f"must be a string or an object; {NAMED_USAGE}")
    if tool_choice.get("type", "function") != "function":
        raise ValidationError("tool_choice.type", f"must be 'function'; {NAMED_USAGE}")
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ValidationError("tool_choice.function", f"must be an object; {NAMED_USAGE}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValidationError("tool_choice.function.name", f"must be a non-empty string; {NAMED_USAGE}")
    return name


@dataclass(frozen=True)
class ForcedToolChoice:
    """A tool choice that makes the reply a call: of the function ``name`` (the first tool of that name, as
    vLLM's), or (``name`` None, "required") of one or more of ``functions`` (the request's tools' functions)."""

    functions: list[dict[str, Any]]
    name: str | None = None
    parallel: bool = True  # OpenAI's parallel_tool_calls: false allows one call only

    def schema(self) -> dict[str, Any]:
        """The reply's JSON schema: the named function's parameters (an empty object's where it has none), or
        ``required_calls_schema`` (of one call at most without ``parallel``)."""
        if self.name is None:
            return required_calls_schema(self.functions, max_calls=None if self.parallel else 1)
        named = next(f for f in self.functions if f["name"] == self.name)
        return named.get("parameters") or _empty_object()

    def describe(self) -> str:
        return "required tool choice" if self.name is None else f"named tool choice ({self.name})"


def forced_tool_choice(
    tools: list[Any] | None, tool_choice: Any, parallel: bool = True, auto: bool = False, sent: bool = True
) -> ForcedToolChoice | None:
    """The call a chat request's reply must be, with the request's tools and choice checked as vLLM's
    ``check_tool_usage``: None for no choice without tools, for "none" (the tools are only rendered) and for
    "required" over an empty list (OpenAI's: as "none"), and for "auto" where ``auto`` (the server parses calls
    out of the reply: ``AutoToolChoice``). ``parallel``: OpenAI's ``parallel_tool_calls``; ``sent``: whether the
    request has the choice (an explicit null is vLLM's "none"; left out with tools, its "auto").

    Raises:
        ValidationError: tools without a choice, or "auto" (``AUTO_WHY``); a choice without tools; a named
            function that is not one of the tools; a malformed tool or choice.
    """
    functions = check_tools(tools) if tools is not None else []
    if tool_choice is None:
        if tools and not auto and not sent:
            why = f'without tool_choice, the choice is "auto" (vLLM\'s default), which {AUTO_WHY}'
            raise ValidationError("tools", why)
        return None
    name = forced_function_name(tool_choice)
    if tools is None:
        if tool_choice == "none":
            return None
        raise ValidationError("tool_choice", "needs tools: when using tool_choice, tools must be set")
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        if auto:
            return None
        raise ValidationError("tool_choice", f'"auto" {AUTO_WHY}')
    if name is None:  # "required"
        return ForcedToolChoice(functions, parallel=parallel) if functions else None
    names = [f["name"] for f in functions]
    if name not in names:
        raise ValidationError(
            "tool_choice.function.name",
            f"{name!r} does not match any of the tools ({', '.join(map(repr, names)) or 'none given'})",
        )
    return ForcedToolChoice(functions, name)


def _empty_object() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


def required_calls_schema(functions: list[dict[str, Any]], max_calls: int | None = None) -> dict[str, Any]:
    """The JSON schema of a required choice's reply (vLLM's): an array of at least one call object (at most
    ``max_calls``), each ``name`` one tool's and ``parameters`` that tool's schema (an empty object where it has
    none); the tools' ``$defs`` gathered at the top, where references into them resolve.

    Raises:
        ValidationError: two tools defining one ``$defs`` name differently.
    """
    defs: dict[str, Any] = {}
    alternatives = []
    for function in functions:
        name, parameters = function["name"], dict(function.get("parameters") or _empty_object())
        for def_name, definition in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise ValidationError("tools", f"two tools define $defs.{def_name} differently")
        alternatives.append(
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def _is_call(item: Any) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str)


def _arguments(value: Any) -> str:
    """A call's arguments as its JSON text (non-ASCII kept); a string is taken as that text already."""
    return value if isinstance(value, str) else json.dumps(value or {}, ensure_ascii=False)


@dataclass
class RequiredCallStream:
    """A required choice's calls, as the reply's text comes: ``feed`` returns the calls whose objects the new text
    completed (``tool_calls`` delta entries with their ``index``, id, name and whole arguments: the parameters as
    JSON text, non-ASCII kept). The text is the grammar's array, so each element decodes once its closing brace
    has arrived."""

    text: str = ""
    position: int = 0  # where the next element (or the array's opening bracket) starts
    calls: int = 0  # calls returned so far
    failed: bool = False  # an element nested too deep to decode: nothing after it is decoded
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        entries: list[dict[str, Any]] = []
        if self.failed or "}" not in delta:  # an element completes only with a closing brace
            return entries
        while True:
            start = self._next_value()
            if start is None:
                return entries
            try:
                item, end = self._decoder.raw_decode(self.text, start)
            except ValueError:  # not complete yet
                return entries
            except RecursionError:  # nested too deep to decode: no more calls (a reply of none stays its text)
                self.failed = True
                return entries
            self.position = end
            if _is_call(item):
                entries.append({"index": self.calls, **function_call(item["name"], _arguments(item.get("parameters")))})
                self.calls += 1

    def _next_value(self) -> int | None:
        """Where the next element's object starts; None until its first character has arrived."""
        i = self.position
        while i < len(self.text) and self.text[i] in " \t\n\r[,":
            i += 1
        self.position = i
        return i if i < len(self.text) and self.text[i] == "{" else None


@dataclass(frozen=True)
class AutoToolChoice:
    """tool_choice "auto" on a server started with a tool-call parser: the model decides, and its calls are parsed
    out of the reply (``parser``: one of ``TOOL_CALL_PARSERS``)."""

    parser: str = "hermes"
    parallel: bool = True  # OpenAI's parallel_tool_calls: false keeps the first call only (vLLM's)


def reply_with_calls(
    mode: ForcedToolChoice | AutoToolChoice, text: str | None, finish_reason: str | None
) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """A whole reply as (message content, tool_calls, finish_reason), as vLLM's (and OpenAI's) responses have it,
    and as its stream (``ToolCallDeltas``) gives it. A named call's arguments are the text, content empty, the
    engine's finish reason kept ("stop", OpenAI's for a named choice). Otherwise the calls come from the text (a
    required choice's array; an auto choice's parsed calls, the text before the first one the content, null where
    empty, as vLLM's), finish reason "tool_calls" where the reply made calls and stopped on its own; a reply cut
    by max_tokens keeps the calls it completed; one that made none stays the content (``text`` as given: None
    where a reasoning parser left no content), with no calls."""
    if isinstance(mode, ForcedToolChoice) and mode.name is not None:
        return "", [function_call(mode.name, text or "")], finish_reason
    delta, finish_reason = ToolCallDeltas(mode).delta(text or "", finish_reason or "stop")
    calls = [{k: v for k, v in call.items() if k != "index"} for call in delta.get("tool_calls", [])]
    if not calls:
        return text, [], finish_reason
    return (delta.get("content") or None) if isinstance(mode, AutoToolChoice) else "", calls, finish_reason


# Tool-call parsers for tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser NAME): the model writes
# its calls in its own format, parsed out of the reply.
TOOL_CALL_PARSERS = ("hermes",)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


@dataclass
class HermesToolCallStream:
    """Calls in the Hermes format (vLLM's ``hermes`` parser: Hermes 2 Pro, Qwen2.5, Qwen3, ...) out of a reply as its
    text comes: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. ``feed`` returns the
    new delta: the text before the first call as ``content`` (a possible start of the tag held back until it is
    told apart), and each call, once its closing tag arrives (or the reply ends inside it), as one ``tool_calls``
    entry with its ``index``, id, name and whole arguments (JSON text, non-ASCII kept). Text after the first call
    is not content (vLLM's). A call whose JSON does not parse is passed on as text, content while no call has
    been made (so a reply without a valid call is all its own text, as vLLM's), else dropped."""

    calls: int = 0
    _pending: str = ""  # text not yet passed on
    _in_call: bool = False
    _scanned: int = 0  # how much of a call's text has been searched for its closing tag (none there)

    def feed(self, text: str, finished: bool = False) -> dict[str, Any]:
        self._pending += text
        content, entries = "", []
        while True:
            if not self._in_call:
                start = self._pending.find(HERMES_START)
                if start < 0:
                    cut = len(self._pending) - (0 if finished else held_back(self._pending, HERMES_START))
                    if not self.calls:
                        content += self._pending[:cut]
                    self._pending = self._pending[cut:]
                    break
                if not self.calls:
                    content += self._pending[:start]
                self._pending, self._in_call = self._pending[start + len(HERMES_START) :], True
                continue
            end = self._pending.find(HERMES_END, max(0, self._scanned - len(HERMES_END) + 1))
            if end < 0 and not finished:
                self._scanned = len(self._pending)
                break
            self._scanned = 0
            body = self._pending if end < 0 else self._pending[:end]
            self._pending = "" if end < 0 else self._pending[end + len(HERMES_END) :]
            self._in_call = False
            call = _hermes_call(body)
            if call is not None:
                entries.append({"index": self.calls, **call})
                self.calls += 1
            elif not self.calls:
                content += HERMES_START + body + ("" if end < 0 else HERMES_END)
            if end < 0:
                break
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if entries:
            delta["tool_calls"] = entries
        return delta


@dataclass
class ToolCallDeltas:
    """One choice's streamed reply under a tool choice (``reply_with_calls`` gives it whole): ``delta`` turns each
    new text into a chunk's delta and finish reason. A named call's first delta carries its id, type and name (and
    the arguments so far), later ones the arguments' new text (vLLM's); a required choice's calls go out one delta
    each once complete (``RequiredCallStream``), and where the reply ends with none, its text as the content; an
    auto choice's content and calls as its parser (``HermesToolCallStream``) passes them on."""

    mode: ForcedToolChoice | AutoToolChoice
    named_started: bool = False
    required: RequiredCallStream = field(default_factory=RequiredCallStream)
    parsed: HermesToolCallStream = field(default_factory=HermesToolCallStream)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        mode = self.mode
        if isinstance(mode, AutoToolChoice):
            delta = self.parsed.feed(text, finished=finish_reason is not None)
            if not mode.parallel and "tool_calls" in delta:
                delta["tool_calls"] = [call for call in delta["tool_calls"] if call["index"] == 0]
                if not delta["tool_calls"]:
                    del delta["tool_calls"]
            return delta, "tool_calls" if finish_reason == "stop" and self.parsed.calls else finish_reason
        if mode.name is not None:
            if self.named_started:
                return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), finish_reason
            self.named_started = True
            return {"tool_calls": [{"index": 0, **function_call(mode.name, text)}]}, finish_reason
        entries = self.required.feed(text)
        delta = {"tool_calls": entries} if entries else {}
        if finish_reason is not None:
            if not self.required.calls:
                delta["content"] = self.required.text
            elif finish_reason == "stop":
                finish_reason = "tool_calls"
        return delta, finish_reason


def _hermes_call(body: str) -> dict[str, Any] | None:
    """A ``tool_calls`` entry from one Hermes call's JSON; None where it is not ``{"name": str, "arguments"?}``."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to decode
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return function_call(value["name"], _arguments(value.get("arguments")))
