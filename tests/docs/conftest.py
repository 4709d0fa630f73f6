"""Fixtures of the documentation tests: the pages in nav order and one server pool per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.docs.runner import ServerPool, server_pool


@pytest.fixture(scope="session")
def docs_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerPool]:
    """`detinf serve` processes shared by every page that shows the same serve command."""
    with server_pool(tmp_path_factory.mktemp("docs-servers")) as pool:
        yield pool


@pytest.fixture(scope="session")
def docs_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "docs"
