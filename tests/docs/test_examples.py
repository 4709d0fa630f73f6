"""Every shell and Python example of the documentation runs against the embedded default model and
prints what its page shows (tests/docs/examples.py has the conventions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import ServerPool, run_pages
from tests.docs.site import example_groups

GROUPS = example_groups()


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_page_examples(group: str, docs_servers: ServerPool, tmp_path: Path) -> None:
    failures = run_pages(GROUPS[group], tmp_path, docs_servers)
    assert not failures, "\n\n".join(failures)
