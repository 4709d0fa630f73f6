"""The example extractor and output comparison (the machinery of test_examples), with negative controls:
a wrong output, a wrong exit code and a broken convention are each caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.examples import DocsFormatError, extract, output_matches, workdir_group
from tests.docs.runner import check_example, run_example

PAGE = """# A page

<!-- docs-test: workdir shared -->

```bash
echo "detinf-0123456789abcdef"
printf 'a\\nb\\nc\\n'
```

```text title="Output"
<fingerprint>
...
c
```

<!-- docs-test: exit 3 -->
```bash
exit 3
```

<!-- docs-test: skip needs a GPU -->
```python
raise SystemExit(1)
```

```json
{"not": "an example"}
```
"""


def test_extract_reads_blocks_outputs_and_directives() -> None:
    first, second, third = extract("page.md", PAGE)
    assert first.language == "bash" and first.line == 5 and first.expected is not None
    assert first.expected.startswith("<fingerprint>\n...")
    assert (second.exit_code, second.expected, second.skip) == (3, None, None)
    assert third.skip == "needs a GPU" and third.language == "python"
    assert workdir_group(PAGE) == "shared"


def test_placeholders_and_any_lines() -> None:
    assert output_matches("x <sha256> y\n", "x sha256:" + "ab" * 32 + " y\n")
    assert not output_matches("x <sha256> y\n", "x sha256:abc y\n")
    assert output_matches("a\n...\nz\n", "a\nb\nc\nz\n")
    assert output_matches("a\n...\nz\n", "a\nz\n")
    assert output_matches("[<number>, <int>]", "[-0.25, 7]\n\n")
    assert output_matches("t: <...>!", "t: anything at all!  \n")
    assert not output_matches("a\nz\n", "a\nb\nz\n")
    assert not output_matches("grade: conformant", "grade: mismatch_outputs")


def test_running_examples_checks_output_and_exit_code(tmp_path: Path) -> None:
    first, second, _ = extract("page.md", PAGE)
    assert check_example(first, run_example(first, tmp_path, None)) is None
    assert check_example(second, run_example(second, tmp_path, None)) is None
    wrong_output = extract("p.md", '```bash\necho 2\n```\n\n```text title="Output"\n1\n```\n')[0]
    failure = check_example(wrong_output, run_example(wrong_output, tmp_path, None))
    assert failure is not None and "output differs" in failure
    failing = extract("p.md", "```bash\nfalse\necho never\n```\n")[0]
    failure = check_example(failing, run_example(failing, tmp_path, None))
    assert failure is not None and "exit code 1" in failure


def test_python_examples_run_with_the_venv(tmp_path: Path) -> None:
    example = extract(
        "p.md",
        "```python\nimport deterministic_inference\nprint('ok')\n```\n```text title=\"Output\"\nok\n```\n",
    )[0]
    assert check_example(example, run_example(example, tmp_path, None)) is None


@pytest.mark.parametrize(
    "text",
    [
        "<!-- docs-test: skip -->\n```bash\ntrue\n```\n",  # no reason
        "<!-- docs-test: sometimes -->\n```bash\ntrue\n```\n",  # unknown directive
        '```text title="Output"\nx\n```\n',  # output of nothing
        "```bash\ntrue\n",  # never closed
    ],
)
def test_broken_conventions_are_errors(text: str) -> None:
    with pytest.raises(DocsFormatError):
        extract("p.md", text)
