"""``StructuredOutputsParams`` (vLLM ``vllm/sampling_params.py``): the one constraint a request's output must
satisfy, shared by both services. Exactly one of ``json`` (a JSON schema), ``json_object``, ``regex``,
``choice`` or ``grammar`` (EBNF, xgrammar's dialect of GBNF) is set; ``disable_any_whitespace`` (vLLM's option)
makes JSON compact.

The shape rules (exactly one, non-empty, JSON that parses) live here so both services refuse the same requests
in the same words (``structured_outputs_violation``); whether the constraint compiles is the grammar backend's
say (the frontend asks llguidance, ``frontend_svc/structured_outputs.py``; the core compiles with xgrammar,
``core_svc/structured_output.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from splitserve.base.status import Violation

FIELD = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The deepest nesting of objects and arrays a JSON schema document may have. Ours: deep enough for any real
# schema (pydantic's nest a few levels per model), shallow enough that every recursive walk of the schema (json,
# the grammar compilers) stays far from Python's recursion limit and the compilers' stacks.
MAX_JSON_SCHEMA_DEPTH = 64
# String formats xgrammar (the core's compiler) enforces: vLLM's STRING_SUPPORTED_FORMATS
# (vllm/v1/structured_output/backend_xgrammar.py, from xgrammar's json_schema_converter.cc).
XGRAMMAR_STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Keywords xgrammar 0.2.9 compiles away (the grammar is the one without them, measured): the output could break
# them. Array keywords (on an array or untyped schema), then conditionals and dependencies (on any schema).
_UNENFORCED_ARRAY_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains")
_UNENFORCED_KEYWORDS = ("if", "dependentRequired", "dependentSchemas", "dependencies")
# Keywords whose value maps names to subschemas, and those whose value is data, not a schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "required"})


@dataclass(frozen=True)
class StructuredOutputsParams:
    """The output constraint; exactly one field is set (``json_object`` counts when True).

    ``json`` is a JSON schema, as a dict or its JSON text; ``choice`` a list of strings, one of which is the
    whole output; ``grammar`` an EBNF grammar whose start rule is ``root``.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # json, json_object: no whitespace between tokens (vLLM's option)

    @classmethod
    def from_message(cls, msg: Any) -> StructuredOutputsParams:
        """The constraint in a protobuf ``StructuredOutputsParams`` message: the engine core's or the public API's,
        which have the same fields (json, regex and grammar optional; choice repeated). Not checked here: its
        shape by ``structured_outputs_violation``, its compilation by the frontend and the core."""
        return cls(
            json=msg.json if msg.HasField("json") else None,
            json_object=msg.json_object or None,
            regex=msg.regex if msg.HasField("regex") else None,
            choice=list(msg.choice) or None,
            grammar=msg.grammar if msg.HasField("grammar") else None,
            disable_any_whitespace=msg.disable_any_whitespace,
        )

    @property
    def kind(self) -> str:
        """The field that is set (call after ``structured_outputs_violation`` returned None)."""
        return next(name for name in KINDS if _is_set(getattr(self, name)))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's JSON, the regex, the grammar, the choices as a JSON list, "" for
        json_object. With ``kind``, the key of a compiled grammar."""
        kind = self.kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        return str(value)

    @property
    def key(self) -> tuple[str, str, bool]:
        """(kind, spec, disable_any_whitespace): the compiled-grammar cache key."""
        return self.kind, self.spec, self.disable_any_whitespace


def structured_outputs_violation(params: StructuredOutputsParams) -> Violation | None:
    """The first shape rule ``params`` breaks, as vLLM's ``StructuredOutputsParams.__post_init__`` and
    ``_validate_structured_outputs``: exactly one constraint; json_object only True; json a dict or a string that
    parses as a JSON object; regex a non-empty string without NUL; grammar non-empty; choice a non-empty list of
    strings."""
    set_fields = [name for name in KINDS if _is_set(getattr(params, name))]
    if len(set_fields) != 1:
        got = ", ".join(set_fields) if set_fields else "none"
        return Violation(FIELD, f"needs exactly one of {', '.join(KINDS)}; got {got}")
    kind = set_fields[0]
    name = f"{FIELD}.{kind}"
    value = getattr(params, kind)
    if kind == "json_object":
        return None if value is True else Violation(name, f"must be true when set, got {value!r}")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                return Violation(name, f"is not valid JSON: {e}")
            except RecursionError:  # json's decoder recurses once per level (about 1,000 levels)
                return Violation(name, f"nests deeper than {MAX_JSON_SCHEMA_DEPTH} levels")
        if not isinstance(value, dict):
            return Violation(name, f"must be a JSON schema object, got {type(value).__name__}")
        if json_depth(value, MAX_JSON_SCHEMA_DEPTH) > MAX_JSON_SCHEMA_DEPTH:
            return Violation(name, f"nests deeper than {MAX_JSON_SCHEMA_DEPTH} levels")
        unenforced = unenforced_schema_keyword(value)
        if unenforced is not None:
            where, what = unenforced
            return Violation(
                name,
                f"{what} (at {where}) is not enforced by the engine core's grammar compiler (xgrammar), so the "
                "output could break it; remove it, or check the output yourself",
            )
        return None
    if kind == "choice":
        if not isinstance(value, list | tuple) or not value:
            return Violation(name, "must be a non-empty list of strings")
        for i, choice in enumerate(value):
            if not isinstance(choice, str) or not choice:
                return Violation(f"{name}[{i}]", f"must be a non-empty string, got {choice!r}")
        return None
    if not isinstance(value, str) or not value.strip():
        return Violation(name, f"must be a non-empty string, got {value!r}")
    if "\x00" in value:
        return Violation(name, "must not contain a NUL character")
    return None


def unenforced_schema_keyword(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(where, what) of the first keyword of ``schema`` that xgrammar accepts without enforcing it, else None:
    ``uniqueItems`` / ``contains`` / ``minContains`` / ``maxContains`` on an array (or untyped) schema; ``if``
    (with its ``then`` / ``else``), ``dependentRequired``, ``dependentSchemas``, ``dependencies``; a string
    ``format`` xgrammar does not know (``XGRAMMAR_STRING_FORMATS``); ``minLength`` / ``maxLength`` beside a
    ``pattern`` or ``format``. With them, xgrammar 0.2.9 compiles the same grammar as without (measured); vLLM's
    ``has_xgrammar_unsupported_json_features`` sends the array, format and length cases to another backend (and
    its xgrammar drops the rest too). ``where`` is a path from the schema's root ("properties.tags"); "the schema"
    for the root. Walks without recursion."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        where = path or "the schema"
        kind = node.get("type")
        if kind in (None, "array"):
            for keyword in _UNENFORCED_ARRAY_KEYWORDS:
                if keyword in node and node[keyword] is not False:
                    return where, keyword
        for keyword in _UNENFORCED_KEYWORDS:
            if keyword in node:
                return where, keyword
        form = node.get("format")
        if kind == "string" and isinstance(form, str) and form not in XGRAMMAR_STRING_FORMATS:
            return where, f"format {form!r}"
        if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
            return where, "minLength / maxLength beside a pattern or format"
        for key, value in node.items():
            child = f"{path}.{key}" if path else key
            if key in _DATA_KEYWORDS:
                continue
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                stack.extend((sub, f"{child}.{name}") for name, sub in value.items())
            elif isinstance(value, dict):
                stack.append((value, child))
            elif isinstance(value, list):
                stack.extend((sub, f"{child}[{i}]") for i, sub in enumerate(value))
    return None


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of a parsed JSON value (a scalar: 0, ``{}``: 1, ``{"a": []}``: 2), without recursion;
    counting stops at ``limit + 1`` (a Python value that contains itself ends there too)."""
    depth = 0
    level = [value]
    while depth <= limit:
        containers = [node for node in level if isinstance(node, dict | list | tuple)]
        if not containers:
            return depth
        depth += 1
        level = [child for node in containers for child in (node.values() if isinstance(node, dict) else node)]
    return depth


def _is_set(value: Any) -> bool:
    # An empty dict is set: json={} is the empty schema (any JSON value), as json="{}".
    return value is not None and value is not False and value != "" and value != []
