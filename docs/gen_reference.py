"""Regenerate the generated pages of the documentation site (one command, from the repository root):

    .venv/bin/python docs/gen_reference.py           # rewrite docs/reference/cli.md, api.md, metrics.md
    .venv/bin/python docs/gen_reference.py --check   # exit 1 (naming the files) if they are stale

- `docs/reference/cli.md` comes from the argparse definitions (`deterministic_inference.cli.main`), so a
  flag added, removed or re-described shows up here and nowhere else needs editing.
- `docs/reference/metrics.md` comes from the server's metrics exposition (`server/metrics.py`).
- `docs/reference/api.md` comes from the app's published OpenAPI document (`GET /openapi.json`), built
  without starting an engine (the schema does not depend on the model).

The output depends only on the code: no terminal width, no dates, no machine facts. tests/docs checks
that the committed pages equal a regeneration.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))
if str(DOCS) not in sys.path:
    sys.path.insert(0, str(DOCS))

from reference_api import api_reference  # noqa: E402
from reference_cli import cli_reference  # noqa: E402
from reference_metrics import metrics_reference  # noqa: E402

PAGES = {
    DOCS / "reference" / "cli.md": cli_reference,
    DOCS / "reference" / "api.md": api_reference,
    DOCS / "reference" / "metrics.md": metrics_reference,
}


def stale_pages() -> list[Path]:
    """The generated pages whose committed text differs from a regeneration."""
    stale = []
    for path, render in PAGES.items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != render():
            stale.append(path)
    return stale


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the CLI, API and metrics reference pages.")
    parser.add_argument("--check", action="store_true", help="only report stale pages (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_pages()
        for path in stale:
            print(f"{_shown(path)}: stale; run .venv/bin/python docs/gen_reference.py")
        return 1 if stale else 0
    undocumented: list[str] = []
    api_reference(undocumented)
    for field in sorted(set(undocumented)):
        print(f"note: {field} has no description (add one to docs/reference_fields.py)", file=sys.stderr)
    for path, render in PAGES.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(), encoding="utf-8")
        print(f"wrote {_shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
