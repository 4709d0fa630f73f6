"""`detinf audit` shows requests answered and tokens/s on stderr (plain lines on a pipe), not with
--quiet; the case lines on stdout are unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.server.harness import RunningServer

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--n-trials", "1", "--concurrency", "2", "--max-tokens", "3"]


def _audit(server: RunningServer, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "deterministic_inference", "audit", "--base-url", server.base_url,
               "--mode", "single", *SMALL, *extra]
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_audit_progress_on_a_pipe(invariant_server: RunningServer) -> None:
    shown = _audit(invariant_server)
    assert shown.returncode == 0, shown.stderr
    (line,) = [line for line in shown.stderr.splitlines() if line.startswith("audit: ")]
    assert line.startswith("audit: 3 requests, 9 tokens, ") and line.endswith(" tokens/s")
    assert "\x1b[" not in shown.stderr and "audit: " not in shown.stdout
    quiet = _audit(invariant_server, "--quiet")
    assert quiet.returncode == 0 and "audit: " not in quiet.stderr
    assert quiet.stdout.splitlines()[0] == shown.stdout.splitlines()[0]
