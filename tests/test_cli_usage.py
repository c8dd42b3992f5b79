"""What a user meets first: the model as ``splitserve serve MODEL`` or ``--model``, a model that cannot be found
(one line, status 2, every command), ``--version``, defaults and units in ``--help``, ``--served-model-name``, the
engine and frontend flags as their config dataclasses' fields."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import re
import subprocess
import sys
import types
import typing

import pytest

from core_svc.config import CoreConfig
from frontend_svc.config import FrontendConfig
from frontend_svc.sampling_params import MAX_N
from splitserve.base.config_args import flag_fields, flag_name
from splitserve.entrypoints.cli import (
    build_parser,
    core_config_from_args,
    frontend_config_from_args,
    main,
    model_from_args,
)

MISSING = "/nonexistent/path"
# Every command that takes a model, with the other flags it needs.
MODEL_COMMANDS = {
    "core": [],
    "frontend": ["--core", "localhost:1"],
    "serve": [],
    "generate": ["--prompt", "x"],
    "stack": [],
    "demo": [],
}


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_a_missing_model_folder_is_one_line_and_status_2(command, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_MODEL", raising=False)
    extra = MODEL_COMMANDS[command]
    for argv in ([command, MISSING, *extra], [command, "--model", MISSING, *extra]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err == f"error: no such folder: {MISSING}\n", argv
    monkeypatch.setenv("SPLITSERVE_MODEL", MISSING)
    assert main([command, *extra]) == 2
    assert capsys.readouterr().err == f"error: no such folder: {MISSING} (from $SPLITSERVE_MODEL)\n"
    assert main([command, str(tmp_path), *extra]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path} is not a model folder: no config.json\n"


def test_a_hub_id_the_hub_cannot_give_fails_before_a_server_starts(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert main(["core", "Qwen/Qwen2.5-0.5B"]) == 2
    assert capsys.readouterr().err == (
        "error: could not download 'Qwen/Qwen2.5-0.5B' from the Hugging Face hub: this machine could not reach the "
        "hub (offline, or HF_HUB_OFFLINE is set) and the model is not in its cache; pass a local model folder "
        "instead\n"
    )


def test_the_command_prints_no_traceback_for_a_missing_model():
    done = subprocess.run(
        [sys.executable, "-m", "splitserve.entrypoints.cli", "serve", MISSING],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (done.returncode, done.stdout, done.stderr) == (2, "", f"error: no such folder: {MISSING}\n")


def test_the_model_is_positional_or_a_flag_not_two_different_ones():
    parser = build_parser()
    for command, extra in MODEL_COMMANDS.items():
        assert model_from_args(parser.parse_args([command, "m", *extra])) == "m"
        assert model_from_args(parser.parse_args([command, "--model", "m", *extra])) == "m"
        assert model_from_args(parser.parse_args([command, "m", "--model", "m", *extra])) == "m"
        assert model_from_args(parser.parse_args([command, *extra])) is None
        with pytest.raises(ValueError) as twice:
            model_from_args(parser.parse_args([command, "a", "--model", "b", *extra]))
        assert str(twice.value) == "the model is given twice, as MODEL (a) and as --model (b): give it once"


def test_generate_runs_the_positional_model(checkpoint, capsys):
    path = str(checkpoint("llama"))
    flags = ["--prompt", "Once upon a time", "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--json"]
    assert main(["generate", path, *flags]) == 0
    positional = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", path, *flags]) == 0
    assert json.loads(capsys.readouterr().out) == positional
    assert len(positional["outputs"][0]["token_ids"]) == 6


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"splitserve {importlib.metadata.version('splitserve')}\n"


def test_python_dash_m_splitserve_is_the_command():
    done = subprocess.run(
        [sys.executable, "-m", "splitserve", "--version"], capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout) == (0, f"splitserve {importlib.metadata.version('splitserve')}\n")


def _subparsers(parser: argparse.ArgumentParser, path: str = "splitserve") -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                found += _subparsers(subparser, f"{path} {name}")
    return found


def _help_entries(help_text: str) -> dict[str, str]:
    """Each option's entry in a --help text, keyed by its first option string, whitespace collapsed."""
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  \S", line):  # an option or a positional starts; wrapped help is indented further
            current = [line]
            entries[line.split()[0].rstrip(",")] = ""
        elif line.startswith("    ") and current:
            current.append(line)
        else:
            current = []
        if current:
            entries[current[0].split()[0].rstrip(",")] = " ".join(" ".join(current).split())
    return entries


def test_help_shows_every_default(monkeypatch):
    """Every option whose default is not None shows it in --help (switches, off unless given, have none)."""
    monkeypatch.setenv("COLUMNS", "200")  # no wrapping inside a long default
    checked = 0
    for path, parser in _subparsers(build_parser()):
        entries = _help_entries(parser.format_help())
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            if action.default in (None, argparse.SUPPRESS) or isinstance(action.default, bool):
                continue
            shown = "''" if action.default == "" else str(action.default)
            entry = entries[action.option_strings[0]]
            assert f"(default: {shown}" in entry, f"{path} {action.option_strings[0]}: {entry}"
            checked += 1
    assert checked > 50  # every subcommand was reached


def test_served_model_name_reaches_the_cores_config():
    args = build_parser().parse_args(["core", "m", "--served-model-name", "tiny-chat"])
    assert core_config_from_args(args, "m").model_name == "tiny-chat"
    assert core_config_from_args(build_parser().parse_args(["core", "m"]), "m").model_name == "m"


def test_help_shows_units(monkeypatch):
    """A flag's default is shown with its unit (the config field's ``flag(unit=...)``, or the flag's own help)."""
    monkeypatch.setenv("COLUMNS", "200")
    parsers = dict(_subparsers(build_parser()))
    for command in ("core", "serve", "generate"):
        entries = _help_entries(parsers[f"splitserve {command}"].format_help())
        assert "(default: 2048 tokens)" in entries["--max-num-batched-tokens"], command
        assert "(default: 16 tokens)" in entries["--block-size"], command
        assert "(default: 1 GiB, capped at what --max-num-seqs" in entries["--kv-cache-memory-gib"], command
    for command in ("core", "serve", "frontend"):
        entries = _help_entries(parsers[f"splitserve {command}"].format_help())
        entry = entries["--max-receive-message-mib"]
        if command == "core":  # argparse may wrap inside a flag's name: the words around it
            assert "(default: 16 MiB, plus room for an image model's pixels: the smaller of" in entry
            assert "of its largest images and max_model_len - 1 image tokens)" in entry
        else:
            assert "(default: 16 MiB)" in entry, command
        assert "(default: 30.0 s)" in entries["--shutdown-timeout"], command
    frontend = _help_entries(parsers["splitserve frontend"].format_help())
    assert f"(default: {MAX_N} completions)" in frontend["--max-n"]


# The config fields each command gives no flag of its own: generate's --seed is each request's sampling seed and it
# reports no model name; serve's --served-model-name and --limit-mm-per-prompt are the frontend's (and reach its
# in-process core too).
CORE_FIELDS_WITHOUT_FLAGS = {
    "core": set(),
    "serve": {"served_model_name", "limit_mm_per_prompt"},
    "generate": {"seed", "served_model_name"},
}
FRONTEND_COMMANDS = {"frontend": ["--core", "localhost:1"], "serve": []}


# A valid non-default value of a string field with a format of its own.
STRING_VALUES = {"limit_mm_per_prompt": "image=2", "cpu_omp_threads_bind": "0-1", "chat_template": "{{ messages }}"}


def _non_default(field: dataclasses.Field, annotation: object) -> tuple[list[str], object]:
    """The arguments after a field's flag that give it a valid value other than its default, and that value."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if annotation is bool:
        return [], not field.default
    if typing.get_origin(annotation) is typing.Literal:
        value = next(choice for choice in typing.get_args(annotation) if choice != field.default)
    elif annotation is int:
        value = 7 if field.default is None else (field.default // 2 if field.default > 1 else field.default + 1)
    elif annotation is float:
        value = 0.5
    elif typing.get_origin(annotation) is tuple:
        return ["a=/adapters/a", "b=/adapters/b"], ("a=/adapters/a", "b=/adapters/b")
    else:
        assert annotation is str, f"{field.name}: no value made for {annotation}"
        value = STRING_VALUES.get(field.name, "other")
    return [str(value)], value


@pytest.mark.parametrize("command", CORE_FIELDS_WITHOUT_FLAGS)
def test_engine_flags_are_the_core_configs_fields_and_round_trip(command):
    """Every CoreConfig field but the model (MODEL / --model) is a flag of core, serve and generate, named after it
    (less the ones a command leaves out on purpose); each flag's non-default value reaches the config, which
    otherwise keeps its defaults."""
    parser = dict(_subparsers(build_parser()))[f"splitserve {command}"]
    options = {option: action.dest for action in parser._actions for option in action.option_strings}
    hints = typing.get_type_hints(CoreConfig)
    expected = [f for f in dataclasses.fields(CoreConfig) if f.name != "model"]
    expected = [f for f in expected if f.name not in CORE_FIELDS_WITHOUT_FLAGS[command]]
    assert {f.name for f in expected} == {f.name for f in flag_fields(CoreConfig, CORE_FIELDS_WITHOUT_FLAGS[command])}
    defaults = CoreConfig(model="m")
    for field in expected:
        assert options.get(flag_name(field)) == field.name, f"{command} has no {flag_name(field)}"
        values, value = _non_default(field, hints[field.name])
        config = core_config_from_args(build_parser().parse_args([command, "m", flag_name(field), *values]), "m")
        assert config == dataclasses.replace(defaults, **{field.name: value}), field.name
    if command == "generate":  # its --seed is the requests' sampling seed, not the engine's
        assert core_config_from_args(build_parser().parse_args([command, "m", "--seed", "5"]), "m") == defaults


@pytest.mark.parametrize("command", FRONTEND_COMMANDS)
def test_frontend_flags_are_the_frontend_configs_fields_and_round_trip(command, monkeypatch):
    """Every FrontendConfig field set by one flag is a flag of frontend and serve; core_tls comes from the
    --core-ssl-* flags together (frontend only)."""
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    extra = FRONTEND_COMMANDS[command]
    parser = dict(_subparsers(build_parser()))[f"splitserve {command}"]
    options = {option: action.dest for action in parser._actions for option in action.option_strings}
    hints = typing.get_type_hints(FrontendConfig)
    expected = [f for f in dataclasses.fields(FrontendConfig) if f.name != "core_tls"]
    assert {f.name for f in expected} == {f.name for f in flag_fields(FrontendConfig)}
    # a flag that needs another one set (vLLM's rule for --enable-auto-tool-choice) -> that one's flag and value
    partners = {"enable_auto_tool_choice": ("tool_call_parser", "hermes")}
    for field in expected:
        assert options.get(flag_name(field)) == field.name, f"{command} has no {flag_name(field)}"
        values, value = _non_default(field, hints[field.name])
        fields: dict[str, typing.Any] = {field.name: value}
        partner = []
        if field.name in partners:
            name, partner_value = partners[field.name]
            fields[name] = partner_value
            partner = ["--" + name.replace("_", "-"), partner_value]
        args = build_parser().parse_args([command, "m", *extra, flag_name(field), *values, *partner])
        assert frontend_config_from_args(args) == FrontendConfig(**fields), field.name
    assert frontend_config_from_args(build_parser().parse_args([command, *extra])) == FrontendConfig()


def test_a_config_value_out_of_range_is_one_line_and_status_2(capsys, monkeypatch):
    import splitserve.entrypoints.cli as cli

    monkeypatch.setattr(cli, "resolve_model_arg", lambda *args, **kwargs: "m")
    assert main(["frontend", "--core", "localhost:1", "--max-n", "0"]) == 2
    assert capsys.readouterr().err == f"error: max_n must be in [1, {MAX_N}], got 0\n"
    assert main(["frontend", "--core", "localhost:1", "--enable-auto-tool-choice"]) == 2  # vLLM's rule
    assert "needs tool_call_parser" in capsys.readouterr().err
    assert main(["core", "--max-num-seqs", "0"]) == 2
    assert capsys.readouterr().err == "error: max_num_seqs must be at least 1, got 0\n"


def test_generate_help_names_no_flag_it_lacks(monkeypatch):
    """generate has no gRPC server: its help (``--limit-mm-per-prompt``'s, shared with core) names no receive limit
    flag; core's says the limit is told to frontends."""
    monkeypatch.setenv("COLUMNS", "200")
    parsers = dict(_subparsers(build_parser()))
    assert "--max-receive-message-mib" not in parsers["splitserve generate"].format_help()
    core = _help_entries(parsers["splitserve core"].format_help())
    assert "tells it to its frontends and sizes its default receive limit" in core["--limit-mm-per-prompt"]


def test_an_in_process_frontend_command_leaves_torch_importable():
    """``splitserve frontend`` hides torch only in its own server process (``run``): ``main`` called in-process,
    here refused for a bad flag, leaves the caller's imports alone."""
    child = (
        "import importlib.util\n"
        "from splitserve.entrypoints.cli import main\n"
        "code = main(['frontend', '--core', 'localhost:1', '--max-n', '0'])\n"
        "import torch\n"
        "print(code, importlib.util.find_spec('torch') is not None)\n"
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["2", "True"]
