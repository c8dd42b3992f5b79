"""What a user meets first: the model as ``splitserve serve MODEL`` or ``--model``, a model that cannot be found
(one line, status 2, every command), ``--version``, defaults in ``--help``, ``--served-model-name``."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys

import pytest

from splitserve.entrypoints.cli import build_parser, core_config_from_args, main, model_from_args

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
