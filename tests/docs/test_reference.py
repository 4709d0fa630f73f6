"""The generated reference pages cover the code they are generated from, and a stale page is detected
(the staleness test itself is in test_site.py)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deterministic_inference.cli.main import build_parser
from tests.docs.site import DOCS


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference_under_test", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_page_lists_every_command_and_flag(gen: ModuleType) -> None:
    from reference_cli import cli_reference

    page = cli_reference()
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in subparsers.choices.items():
        assert f"## detinf {name}" in page
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, (name, flag)


def test_api_page_lists_every_endpoint_and_request_field(gen: ModuleType) -> None:
    from reference_api import api_reference, openapi_document

    page = api_reference()
    document = openapi_document()
    for path, methods in document["paths"].items():
        for method in methods:
            assert f"## `{method.upper()} {path}`" in page
    for name in ("CompletionRequest", "ChatCompletionRequest", "GenerateRequest", "GenerateSamplingParams"):
        for field in document["components"]["schemas"][name]["properties"]:
            assert f"| `{field}` |" in page, (name, field)


def test_metrics_page_lists_every_metric(gen: ModuleType) -> None:
    from reference_metrics import metric_families, metrics_reference

    page = metrics_reference()
    families = metric_families()
    assert len(families) >= 10
    for name, kind, _ in families:
        assert f"| `{name}` | {kind} |" in page


def test_a_changed_flag_makes_the_page_stale(
    gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control of the staleness check: the committed text minus one flag is reported."""
    from reference_cli import cli_reference

    page = tmp_path / "cli.md"
    page.write_text(cli_reference().replace("`--kv-cache-memory`", "`--kv-memory`"), encoding="utf-8")
    monkeypatch.setattr(gen, "PAGES", {page: cli_reference})
    assert gen.stale_pages() == [page]
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0 and gen.stale_pages() == []


def test_escape_keeps_code_spans_and_neutralises_markup() -> None:
    from reference_cli import escape

    assert escape("use `a_b|c` or <x> *y*") == "use `a_b\\|c` or \\<x\\> \\*y\\*"
    assert escape("odd ` tick_") == "odd \\` tick\\_"


def test_the_generator_runs_as_a_script_in_check_mode() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, str(DOCS / "gen_reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
