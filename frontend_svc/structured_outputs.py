"""The frontend's check of a structured-outputs constraint, before anything reaches a core.

The core compiles constraints with xgrammar, whose import pulls torch (``xgrammar.matcher``), which the frontend
never imports. So the frontend compiles them, without a tokenizer, with llguidance (the grammar library vLLM's
``guidance`` backend uses; Rust, no torch): a JSON schema, a regex or an EBNF grammar (GBNF, converted to
llguidance's Lark by ``llguidance.gbnf_to_lark``) that llguidance refuses is INVALID_ARGUMENT with its reason.
The frontend refuses only what is surely invalid: JSON schemas are checked in llguidance's lenient mode (keys it
does not implement are ignored), and its own size limits and a schema pattern's look-around (both of which
xgrammar takes) pass; a grammar must be GBNF (xgrammar's dialect; llguidance would also take Lark). A constraint
that passes here and that xgrammar refuses is refused by the core, with xgrammar's reason, as INVALID_ARGUMENT
too (docs/operations.md lists the known differences).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from frontend_svc.errors import ValidationError
from splitserve.base.structured_outputs import (
    FIELD,
    StructuredOutputsParams,
    structured_outputs_violation,
)

# llguidance's words for its own limits (its lexer's and grammar's sizes, its schema and regex budgets).
_LLGUIDANCE_LIMITS = ("too big (limit", "schema too large", "fuel exhausted")
_PARAM_NAMES = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")


def structured_outputs_from_value(value: Any) -> StructuredOutputsParams:
    """``StructuredOutputsParams`` from itself or a dict of its fields (vLLM's JSON requests).

    Raises:
        ValidationError: another type, or an unknown key.
    """
    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(_PARAM_NAMES))
        if unknown:
            raise ValidationError(FIELD, f"unknown field(s) {', '.join(map(str, unknown))}; allowed: {_PARAM_NAMES}")
        return StructuredOutputsParams(**value)
    raise ValidationError(FIELD, f"must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Exactly one constraint, well formed (``structured_outputs_violation``), and compiling under llguidance.

    Raises:
        ValidationError: naming ``structured_outputs`` or the field set (``structured_outputs.json``), with the
            compiler's reason.
    """
    violation = structured_outputs_violation(params)
    if violation is not None:
        raise ValidationError.from_violation(violation)
    kind = params.kind
    if kind in ("json_object", "choice"):
        return  # nothing to compile: a fixed grammar, and literal strings
    spec = params.spec
    if kind == "grammar" and "::=" not in spec:
        raise ValidationError(
            f"{FIELD}.grammar",
            "must be a GBNF grammar (xgrammar's EBNF: rules written `name ::= ...`, the start rule `root`); this "
            "text has no `::=` (a Lark grammar such as `start: ...` is not taken)",
        )
    try:
        if kind == "json":
            # Lenient: keys llguidance does not implement (uniqueItems, not, ...) are ignored, not refused;
            # xgrammar in the core implements more of them and has the last word.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.loads(spec), overrides={"lenient": True})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.grammar_from("grammar", spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError) as e:
        error = str(e)
    if error and not _is_llguidance_limit(kind, error):
        raise ValidationError(f"{FIELD}.{kind}", f"does not compile: {_first_lines(error)}")


def _is_llguidance_limit(kind: str, error: str) -> bool:
    """Whether ``error`` says llguidance cannot check the constraint rather than that it is invalid: its size
    limits ("lexer configuration too big" and the like), and look-around in a JSON schema's pattern, which
    xgrammar compiles (a regex constraint with look-around is refused by xgrammar too, so it stays refused)."""
    if any(words in error for words in _LLGUIDANCE_LIMITS):
        return True
    return kind == "json" and "look-around" in error


def _first_lines(message: str, max_chars: int = 500) -> str:
    message = re.sub(r"\s+\n", "\n", message.strip())
    return message if len(message) <= max_chars else message[: max_chars - 3] + "..."
