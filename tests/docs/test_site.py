"""The site builds in strict mode, the generated reference pages are current, and nothing in the README
or the docs points outside the repository."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from tests.docs.runner import example_env
from tests.docs.site import DOCS, REPO, nav_pages

MACHINE_PATH = re.compile(r"(?<![\w.~$-])/(?:work|home|root|Users)/[\w.-]+")  # one machine's directories
REPO_PATH = re.compile(
    r"`((?:tests|deterministic_inference|bench|scripts|configs|docs)/[\w./-]+?)(?:::(\w+))?`"
)


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    """Broken links, missing anchors, missing pages and missing snippets fail the build."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=example_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_every_page_is_in_the_nav() -> None:
    pages = {str(path.relative_to(DOCS)) for path in DOCS.rglob("*.md")}
    assert pages == set(nav_pages())


def test_generated_reference_pages_are_current() -> None:
    """docs/reference/cli.md and api.md equal a regeneration (a changed flag or field fails here until
    `.venv/bin/python docs/gen_reference.py` is run)."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stale = module.stale_pages()
    assert not stale, f"stale generated pages {stale}: run .venv/bin/python docs/gen_reference.py"


def _documents() -> list[Path]:
    """The README, CONTRIBUTING, every page, and bench/RESULTS.md (included into the benchmarks page)."""
    return [
        REPO / "README.md",
        REPO / "CONTRIBUTING.md",
        REPO / "bench" / "RESULTS.md",
        *sorted(DOCS.rglob("*.md")),
    ]


def test_nothing_points_outside_the_repository() -> None:
    """No reference to ../shared or any file above the repository, no link to another site."""
    for path in _documents():
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and "DESIGN.md" not in text, path
        for target in re.findall(r"\]\(([^)]+)\)", text):
            assert not re.match(r"[a-z]+://", target), (path, target)
            if not target.startswith("#"):
                resolved = (path.parent / target.split("#")[0]).resolve()
                assert resolved.is_relative_to(REPO), (path, target)
                assert resolved.exists(), (path, target)


def test_no_machine_specific_paths() -> None:
    """Paths in the README and the docs are relative to the repository or variables ($BENCH_VENV, ~),
    never one machine's directories. (RESULTS.md is excepted: it records the commands as they were run.)"""
    for path in _documents():
        if path.name != "RESULTS.md":
            assert not MACHINE_PATH.findall(path.read_text(encoding="utf-8")), path


def test_control_the_machine_path_pattern_finds_one() -> None:
    """The check above can fail: the README's former bench-venv line is caught, its fix is not."""
    assert MACHINE_PATH.findall("python3.11 -m venv /work/bench-venv && /work/bench-venv/bin/pip")
    assert not MACHINE_PATH.findall("python3.11 -m venv ../bench-venv && $BENCH_VENV/bin/pip ~/.ray/x")


def test_named_repository_files_and_tests_exist() -> None:
    """Every `path` (and `path::test_name`) the docs name exists, so the guarantee page's list of tests
    cannot drift from the suite."""
    named = 0
    for path in _documents():
        if path.name == "RESULTS.md":  # a log of measurements: it may name scripts of other branches
            continue
        for file_name, function in REPO_PATH.findall(path.read_text(encoding="utf-8")):
            target = REPO / file_name
            assert target.exists(), f"{path.relative_to(REPO)} names {file_name}, which does not exist"
            if function:
                source = target.read_text(encoding="utf-8")
                assert re.search(rf"def {function}\(", source), f"{path}: {file_name}::{function} not found"
            named += 1
    assert named > 20


def test_the_audit_page_describes_every_mode() -> None:
    from deterministic_inference.audit import MODES

    page = (DOCS / "audit.md").read_text(encoding="utf-8")
    for mode in (*MODES, "all"):
        assert f"| `{mode}` |" in page, f"docs/audit.md: add a row for the audit mode {mode!r}"
