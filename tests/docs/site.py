"""Facts about the site shared by the docs tests: the pages in nav order and their example groups."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.docs.examples import Example, extract, workdir_group

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


def nav_pages() -> list[str]:
    """Pages (relative to docs/) in the order of mkdocs.yml's nav."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, str):
            found.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(config["nav"])
    return found


def example_groups() -> dict[str, list[Example]]:
    """Group name -> examples of its pages in nav order. A page is its own group unless it declares a
    shared working directory (`<!-- docs-test: workdir NAME -->`)."""
    groups: dict[str, list[Example]] = {}
    for page in nav_pages():
        text = (DOCS / page).read_text(encoding="utf-8")
        examples = extract(page, text)
        if examples:
            groups.setdefault(workdir_group(text) or page, []).extend(examples)
    return groups
