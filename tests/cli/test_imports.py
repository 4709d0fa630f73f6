"""What building `detinf`'s command line imports: every command registers every subcommand, so a client
library imported there is resident in `detinf serve` too (memory target of issue 17)."""

from __future__ import annotations

import subprocess
import sys

_PROBE = (
    "import sys\n"
    "from deterministic_inference.cli.main import build_parser\n"
    "build_parser()\n"
    "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
)


def test_building_the_command_line_does_not_import_the_audit_http_client() -> None:
    """httpx (with the rich / pygments it pulls in: ~6 MB resident) is imported only when `detinf audit`
    runs; the parser lists the audit modes without it."""
    loaded = subprocess.run([sys.executable, "-c", _PROBE], check=True, capture_output=True, text=True)
    modules = set(loaded.stdout.split())
    assert "deterministic_inference" in modules  # the probe ran
    assert not modules & {"httpx", "rich", "pygments"}


def test_negative_control_importing_the_audit_modes_brings_httpx() -> None:
    """The check above can fail: the module that runs the audit modes imports the HTTP client."""
    probe = _PROBE.replace("build_parser()\n", "build_parser()\nimport deterministic_inference.audit.modes\n")
    loaded = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert "httpx" in loaded.stdout.split()
