"""Helpers for workflow tests: run `detinf` in-process, write manifests, build run dirs in the real format."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deterministic_inference.cli.main import main
from deterministic_inference.workflow.manifest import deep_merge

SHARED_SEED_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "reference" / "seed-tool-manifests"


@dataclass(frozen=True)
class CliResult:
    """Exit code and captured output of one in-process `detinf` call."""

    code: int
    out: str
    err: str


def detinf(*args: str | Path) -> CliResult:
    """Run `detinf ARGS` in this process and capture stdout / stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(arg) for arg in args])
    return CliResult(code, out.getvalue(), err.getvalue())


def write_json(path: Path, document: Any) -> Path:
    """Write `document` as JSON and return the path."""
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")
    return path


def read_json(path: Path) -> Any:
    """Parse a JSON file."""
    return json.loads(path.read_text(encoding="utf-8"))


def edit_manifest(path: Path, changes: dict[str, Any], output: Path | None = None) -> Path:
    """Deep-merge `changes` into the manifest at `path` (written to `output`, default in place)."""
    target = output or path
    return write_json(target, deep_merge(read_json(path), changes))
