"""``splitserve.base.config_args``: flags generated from a config dataclass's fields, and read back."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from splitserve.base.config_args import NOT_A_FLAG, add_config_args, config_kwargs_from_args, flag


@dataclass(frozen=True)
class Example:
    name: str = field(metadata=NOT_A_FLAG)
    size_gib: float | None = field(default=None, metadata=flag("budget", default_help="all of it", exclusive="size"))
    num_blocks: int | None = field(default=None, metadata=flag("blocks", exclusive="size"))
    budget: int = field(default=2048, metadata=flag("tokens per step, 100% of them", unit="tokens"))
    mode: Literal["fast", "slow"] = field(default="fast", metadata=flag("how"))
    enable_cache: bool = field(default=True, metadata=flag("turn the cache off"))
    verbose: bool = field(default=False, metadata=flag("say more"))


def _parser(exclude: tuple[str, ...] = (), only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="x")
    add_config_args(parser, Example, exclude, only)
    return parser


def test_each_field_is_a_flag_named_typed_and_defaulted_after_it():
    parser = _parser()
    assert config_kwargs_from_args(parser.parse_args([]), Example) == {
        "size_gib": None,
        "num_blocks": None,
        "budget": 2048,
        "mode": "fast",
        "enable_cache": True,
        "verbose": False,
    }
    args = parser.parse_args(["--num-blocks", "9", "--budget", "4", "--mode", "slow", "--no-enable-cache", "--verbose"])
    assert Example("n", **config_kwargs_from_args(args, Example)) == Example("n", None, 9, 4, "slow", False, True)
    assert config_kwargs_from_args(parser.parse_args(["--size-gib", "0.5"]), Example)["size_gib"] == 0.5


def test_help_shows_the_default_with_its_unit_or_in_words():
    text = " ".join(_parser().format_help().split())
    assert "--budget BUDGET tokens per step, 100% of them (default: 2048 tokens)" in text
    assert "--size-gib SIZE_GIB budget (default: all of it)" in text
    assert "--no-enable-cache turn the cache off --verbose say more" in text  # switches: no default shown


@pytest.mark.parametrize(
    "argv",
    [["--size-gib", "1", "--num-blocks", "2"], ["--mode", "medium"], ["--budget", "1.5"]],
)
def test_exclusive_flags_choices_and_types_are_argparses(argv, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(argv)


def test_only_the_flags_added_are_read_back():
    args = _parser(exclude=("budget",)).parse_args([])
    assert "budget" not in config_kwargs_from_args(args, Example)
    args = _parser(only=("mode",)).parse_args(["--mode", "slow"])
    assert config_kwargs_from_args(args, Example) == {"mode": "slow"}
    assert config_kwargs_from_args(argparse.Namespace(budget=1), Example) == {}


def test_a_field_without_flag_metadata_or_of_another_type_cannot_be_forgotten():
    @dataclass(frozen=True)
    class Forgotten:
        size: int = 1

    @dataclass(frozen=True)
    class Listed:
        sizes: tuple[int, ...] = field(default=(), metadata=flag("sizes"))

    with pytest.raises(TypeError, match="Forgotten.size has no flag"):
        add_config_args(argparse.ArgumentParser(), Forgotten)
    with pytest.raises(TypeError, match="sizes: no flag takes a tuple"):
        add_config_args(argparse.ArgumentParser(), Listed)


def test_lora_modules_take_name_equals_path_and_vllms_json_form():
    from core_svc.config import CoreConfig

    json_form = '{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}'
    config = CoreConfig(model="m", enable_lora=True, lora_modules=("a=/adapters/a", json_form))
    assert config.lora_module_paths() == {"a": "/adapters/a", "sql": "/adapters/sql"}
    for bad, reason in [
        ('{"name": "x"}', "needs a 'name' and a 'path'"),
        ("{not json", "is not JSON"),
        ("no-equals", r"is not name=path \(nor vLLM's JSON form\)"),
        ('{"name": "a", "path": "/other"}', "the name 'a' is given twice"),
    ]:
        with pytest.raises(ValueError, match=reason):
            CoreConfig(model="m", enable_lora=True, lora_modules=("a=/adapters/a", bad))
