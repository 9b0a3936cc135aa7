"""Every `dynn` command and subcommand takes --help: exit 0 and a usage line naming the command."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from dynn_runtime.cli import build_parser, main


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path in the parser tree, the root's () included, parents before children."""
    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                out += _commands(child, (*path, name))
    return out


COMMANDS = _commands(build_parser())


def test_the_walk_finds_nested_subcommands():
    # guards the walk itself: if it stopped descending, the test below would pass vacuously
    assert {("trace",), ("trace", "record"), ("trace", "show"), ("pilot", "eval"), ("models",)} <= set(COMMANDS)
    assert len(COMMANDS) >= 15


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "dynn")
def test_help_exits_zero_with_usage(path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*path, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(('dynn', *path))} ")


def test_trace_help_from_the_shell():
    r = subprocess.run([sys.executable, "-m", "dynn_runtime.cli", "trace", "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: dynn trace ") and "record" in r.stdout and "overhead" in r.stdout


def test_trace_record_is_the_default_subcommand():
    parser = build_parser()
    short = parser.parse_args(["trace", "evoformer", "--steps", "3", "-o", "t.jsonl"])
    long = parser.parse_args(["trace", "record", "evoformer", "--steps", "3", "-o", "t.jsonl"])
    assert vars(short) == vars(long)
    assert short.trace_command == "record" and short.workload == "evoformer" and short.steps == 3
    assert parser.parse_args(["trace", "show", "t.jsonl"]).trace_command == "show"
