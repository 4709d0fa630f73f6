"""`detinf <command> --help` documents every option of every command."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from deterministic_inference.cli.main import build_parser, main


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_option_of_every_command_has_help() -> None:
    undocumented = [
        f"{name} {'/'.join(action.option_strings)}"
        for name, parser in _commands().items()
        for action in parser._actions
        if action.option_strings and not (action.help or "").strip()
    ]
    assert undocumented == []


@pytest.mark.parametrize("command", sorted(_commands()))
def test_help_prints_each_option(command: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    parser = _commands()[command]
    for action in parser._actions:
        for option in action.option_strings:
            assert option in out.getvalue()
