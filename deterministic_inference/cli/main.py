"""`detinf` entry point. Each command module registers its sub-commands; commands stay thin.

A command module exposes `register(subparsers) -> None`, adding parsers whose default `func(args) -> int`
runs the command. Errors of the package (`DetinfError`) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from deterministic_inference.errors import DetinfError

COMMAND_MODULES = (
    "deterministic_inference.cli.engine_cmds",
    "deterministic_inference.cli.server_cmds",
    "deterministic_inference.cli.workflow_cmds",
    "deterministic_inference.cli.selfcheck_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    """The full `detinf` parser with every registered command."""
    parser = argparse.ArgumentParser(prog="detinf", description="Bitwise reproducible LLM inference.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `detinf` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except DetinfError as error:
        print(f"detinf {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
