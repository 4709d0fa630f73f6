"""The examples of the documentation pages: extracted from fenced blocks, run, and their output compared.

Conventions (written up for authors in docs/contributing.md):

- Every fenced block whose language is `bash` or `python` is an example and runs, in page order, in one
  working directory per page (or per `<!-- docs-test: workdir NAME -->` group of pages, in nav order).
- A fenced ``text title="Output"`` block right after an example (blank lines between are fine) is what the
  example prints on stdout. It must match line for line; placeholders stand for what changes between
  runs or machines (see PLACEHOLDERS); a line `...` alone matches any number of lines.
- An HTML comment right before an example changes how it runs:
  `<!-- docs-test: skip REASON -->` (not run; the reason is required), `<!-- docs-test: exit N -->`
  (expected exit code N instead of 0), `<!-- docs-test: server -->` (the block is a `detinf serve`
  command: started in the background, its port substituted, and `localhost:8000` / `127.0.0.1:8000`
  in the page's later examples point at it), `<!-- docs-test: cwd repo -->` (run in the repository root).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

EXAMPLE_LANGUAGES = ("bash", "python")
OUTPUT_INFO = 'text title="Output"'
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>[^`]*)$")
DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->$")
PLACEHOLDERS = {
    "<fingerprint>": r"detinf-[0-9a-f]{16}",  # system_fingerprint
    "<sha256>": r"sha256:[0-9a-f]{64}",  # digests and ids (run, lock, manifest, bundle)
    "<hex>": r"[0-9a-f]+",
    "<int>": r"-?\d+",
    "<number>": r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?",  # floats as printed (logprobs, seconds)
    "<id>": r"[A-Za-z0-9_.:-]+",  # request ids
    "<path>": r"\S+",  # an absolute path of the test's working directory
    "<...>": r".*?",  # any text within the line
}
ANY_LINES = "..."
_PLACEHOLDER = re.compile("|".join(re.escape(p) for p in PLACEHOLDERS))


class DocsFormatError(ValueError):
    """A page breaks the example conventions (the message names page and line)."""


@dataclass(frozen=True)
class Example:
    """One runnable block of a page."""

    page: str  # path relative to docs/
    line: int  # 1-based line of the opening fence
    language: str  # bash | python
    code: str
    expected: str | None  # the Output block, None when the page shows no output
    skip: str | None  # the skip reason
    exit_code: int
    server: bool  # a `detinf serve` command to start in the background
    in_repo: bool  # run in the repository root instead of the page's working directory

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


@dataclass(frozen=True)
class _Block:
    line: int
    info: str
    code: str
    directive: str | None  # body of a docs-test comment right before the block


def _blocks(page: str, text: str) -> list[_Block]:
    lines = text.splitlines()
    blocks: list[_Block] = []
    index = 0
    directive: str | None = None
    while index < len(lines):
        line = lines[index]
        match = FENCE.match(line)
        if match is None:
            comment = DIRECTIVE.match(line.strip())
            if comment:
                directive = comment.group("body")
            elif line.strip():
                directive = None
            index += 1
            continue
        start, fence, indent = index, match.group("fence"), match.group("indent")
        body: list[str] = []
        index += 1
        while index < len(lines) and lines[index].strip() != fence:
            body.append(lines[index][len(indent) :] if lines[index].startswith(indent) else lines[index])
            index += 1
        if index == len(lines):
            raise DocsFormatError(f"docs/{page}:{start + 1}: code block never closed")
        blocks.append(_Block(start + 1, match.group("info").strip(), "\n".join(body) + "\n", directive))
        directive = None
        index += 1
    return blocks


def _options(block: _Block, page: str) -> tuple[str | None, int, bool, bool]:
    """(skip reason, exit code, server, in repo) from the block's directive."""
    if block.directive is None:
        return None, 0, False, False
    word, _, rest = block.directive.partition(" ")
    where = f"docs/{page}:{block.line}"
    if word == "skip":
        if not rest.strip():
            raise DocsFormatError(f"{where}: 'docs-test: skip' needs a reason")
        return rest.strip(), 0, False, False
    if word == "exit" and rest.strip().isdigit():
        return None, int(rest), False, False
    if word == "server":
        return None, 0, True, False
    if word == "cwd" and rest.strip() == "repo":
        return None, 0, False, True
    if word == "workdir":
        return None, 0, False, False
    raise DocsFormatError(f"{where}: unknown directive 'docs-test: {block.directive}'")


def extract(page: str, text: str) -> list[Example]:
    """The examples of one page, each with its expected output."""
    blocks = _blocks(page, text)
    examples: list[Example] = []
    for index, block in enumerate(blocks):
        language = _language(block)
        if language not in EXAMPLE_LANGUAGES:
            after_example = index > 0 and _language(blocks[index - 1]) in EXAMPLE_LANGUAGES
            if block.info == OUTPUT_INFO and not after_example:
                raise DocsFormatError(f"docs/{page}:{block.line}: an Output block must follow an example")
            continue
        following = blocks[index + 1] if index + 1 < len(blocks) else None
        expected = following.code if following is not None and following.info == OUTPUT_INFO else None
        skip, exit_code, server, in_repo = _options(block, page)
        examples.append(
            Example(page, block.line, language, block.code, expected, skip, exit_code, server, in_repo)
        )
    return examples


def _language(block: _Block) -> str:
    return block.info.split()[0] if block.info else ""


def workdir_group(text: str) -> str | None:
    """The shared working-directory name a page declares (`<!-- docs-test: workdir NAME -->`)."""
    for line in text.splitlines():
        match = DIRECTIVE.match(line.strip())
        if match and match.group("body").startswith("workdir "):
            return match.group("body").split(None, 1)[1].strip()
    return None


def expected_pattern(expected: str) -> re.Pattern[str]:
    """The regular expression an Output block stands for (placeholders and `...` lines expanded)."""
    parts: list[str] = []
    for line in _normalise(expected).split("\n"):
        if line.strip() == ANY_LINES:
            parts.append(r"(?:[^\n]*\n)*?")
            continue
        pieces = _PLACEHOLDER.split(line)
        names = _PLACEHOLDER.findall(line)
        regex = re.escape(pieces[0])
        for name, piece in zip(names, pieces[1:], strict=True):
            regex += PLACEHOLDERS[name] + re.escape(piece)
        parts.append(regex + r"\n")
    return re.compile("".join(parts))


def output_matches(expected: str, actual: str) -> bool:
    """True when `actual` (stdout) is what the Output block shows."""
    return expected_pattern(expected).fullmatch(_normalise(actual) + "\n") is not None


def _normalise(text: str) -> str:
    """Trailing spaces and trailing blank lines dropped (they are invisible on the page)."""
    return "\n".join(line.rstrip() for line in text.rstrip("\n").split("\n"))


def pages(docs_dir: Path) -> list[Path]:
    """Every Markdown page under docs/, sorted."""
    return sorted(docs_dir.rglob("*.md"))
