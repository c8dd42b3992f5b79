"""Command-line flags generated from a frozen config dataclass, as vLLM's ``EngineArgs.add_cli_args`` does from
its config classes: one flag per field, named after it (``max_num_seqs`` -> ``--max-num-seqs``; a bool that
defaults to True -> ``--no-enable-prefix-caching``), typed by its annotation (``int``, ``float``, ``str``, a
``Literal`` as choices, each optionally ``| None``), defaulting to the field's default. What the annotation cannot
say (help, unit, the default in words, mutually exclusive flags) is the field's ``metadata``, written with
``flag(...)``; a field that no single flag sets says so with ``NOT_A_FLAG``. A field with neither is an error when
the parser is built, so a new field cannot be left without its flag.

    max_num_seqs: int = field(default=128, metadata=flag("most requests running at once", unit="requests"))

``add_config_args`` adds the flags; ``config_kwargs_from_args`` reads back those it added, for the dataclass's
constructor, which validates them.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

# The metadata key of a field's ``Flag`` (None: the field is not a flag).
FLAG_KEY = "splitserve.flag"


@dataclass(frozen=True)
class Flag:
    """How a config field is shown on the command line."""

    help: str
    unit: str = ""  # after the default in --help: "(default: 2048 tokens)"
    default_help: str = ""  # the default in words, for a field that defaults to None: "(default: the model's ...)"
    exclusive: str = ""  # the flags of fields with the same (non-empty) name are mutually exclusive
    metavar: str | None = None  # None: argparse's (the flag's name in capitals)


def flag(
    help: str, *, unit: str = "", default_help: str = "", exclusive: str = "", metavar: str | None = None
) -> dict[str, Flag | None]:
    """A field's ``metadata``: its flag's help, and the unit its default is shown in."""
    return {FLAG_KEY: Flag(help, unit, default_help, exclusive, metavar)}


# A field's ``metadata`` when no single flag sets it (it is built from several, or given otherwise).
NOT_A_FLAG: dict[str, Flag | None] = {FLAG_KEY: None}


def flag_name(field: dataclasses.Field[Any]) -> str:
    """``--max-num-seqs`` for ``max_num_seqs``; ``--no-NAME`` for a bool that defaults to True."""
    name = "--" + field.name.replace("_", "-")
    return name.replace("--", "--no-", 1) if field.default is True else name


def flag_fields(cls: type, exclude: Collection[str] = ()) -> list[dataclasses.Field[Any]]:
    """The fields of the dataclass ``cls`` that are flags, less ``exclude``.

    Raises:
        TypeError: a field has no ``flag(...)`` or ``NOT_A_FLAG`` metadata.
    """
    found = []
    for field in dataclasses.fields(cls):
        if FLAG_KEY not in field.metadata:
            raise TypeError(f"{cls.__name__}.{field.name} has no flag(...) or NOT_A_FLAG metadata")
        if field.metadata[FLAG_KEY] is not None and field.name not in exclude:
            found.append(field)
    return found


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    exclude: Collection[str] = (),
    only: Collection[str] | None = None,
) -> None:
    """Add a flag to ``parser`` for each field of the dataclass ``cls`` that is one (but ``exclude``; of ``only``
    when given), its dest the field's name, its default the field's, shown in --help with the field's unit.

    Raises:
        TypeError: a field without flag metadata, or of a type no flag takes.
    """
    hints = typing.get_type_hints(cls)
    fields = [f for f in flag_fields(cls, exclude) if only is None or f.name in only]
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for field in fields:
        spec: Flag = field.metadata[FLAG_KEY]
        target: argparse._ActionsContainer = parser
        if spec.exclusive:
            if spec.exclusive not in groups:
                groups[spec.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[spec.exclusive]
        kwargs = _argparse_kwargs(field, hints[field.name], spec)
        target.add_argument(flag_name(field), dest=field.name, **kwargs)
    # Which fields this parser has flags for: config_kwargs_from_args reads these and only these.
    parser.set_defaults(**{_added_key(cls): tuple(f.name for f in fields)})


def config_kwargs_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The values of the fields of ``cls`` that ``add_config_args`` gave this command flags for (others keep the
    dataclass's defaults)."""
    return {name: getattr(args, name) for name in getattr(args, _added_key(cls), ())}


def _added_key(cls: type) -> str:
    return f"_flags_of_{cls.__name__}"


def _argparse_kwargs(field: dataclasses.Field[Any], annotation: Any, spec: Flag) -> dict[str, Any]:
    if field.default is dataclasses.MISSING:
        raise TypeError(f"{field.name} has no default: it cannot be a flag")
    default = field.default
    kind = _without_none(annotation)
    if kind is bool:
        action = "store_false" if default is True else "store_true"
        return {"action": action, "help": _escape(spec.help)}
    kwargs: dict[str, Any] = {"default": default, "help": _help(spec, default)}
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    if typing.get_origin(kind) is typing.Literal:
        choices = typing.get_args(kind)
        return {**kwargs, "choices": list(choices), "type": type(choices[0])}
    if kind in (int, float, str):
        return {**kwargs, "type": kind}
    if typing.get_origin(kind) is tuple and typing.get_args(kind) == (str, ...):
        return {**kwargs, "type": str, "nargs": "+"}
    raise TypeError(f"{field.name}: no flag takes a {annotation}")


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None`` (and ``Optional[X]``), else ``annotation``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _help(spec: Flag, default: Any) -> str:
    if default is None:
        shown = spec.default_help
    else:
        shown = "''" if default == "" else f"{default} {spec.unit}".strip()
    return _escape(f"{spec.help} (default: {shown})" if shown else spec.help)


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings
