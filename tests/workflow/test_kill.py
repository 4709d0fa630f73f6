"""kill -9 during `run` leaves nothing that verify accepts as a complete run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.workflow.helpers import detinf, edit_manifest

WRITER = """
import sys
from pathlib import Path
from deterministic_inference.workflow.rundir import write_run_dir
files = {f"captures/part{i:02d}.bin": bytes([i]) * (8 << 20) for i in range(40)}
write_run_dir(Path(sys.argv[1]), files, {"kind": "detinf.run"})
"""


def _kill_when(process: subprocess.Popen[bytes], ready: object, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if callable(ready) and ready():
            break
        time.sleep(0.005)
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def _leftovers(parent: Path) -> list[Path]:
    return sorted(parent.glob(".detinf-tmp-*"))


def test_kill_while_writing_the_run_dir(tmp_path: Path) -> None:
    target = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(target)])
    _kill_when(process, lambda: any(_leftovers(tmp_path)) and any(_leftovers(tmp_path)[0].rglob("*.bin")))
    assert process.returncode == -signal.SIGKILL
    assert not target.exists()
    temporary = _leftovers(tmp_path)
    assert temporary, "the writer was not interrupted while writing"
    for candidate in [target, *temporary]:
        result = detinf("verify", "--bundle-a", candidate, "--bundle-b", candidate,
                        "--output-dir", tmp_path / "v")
        assert result.code == 2 and ("incomplete run" in result.err or "not a run directory" in result.err)


def test_kill_during_real_runs(tiny_manifest: Path, tmp_path: Path) -> None:
    """Kill real runs at several points; whatever is left is either absent, refused, or complete."""
    edit_manifest(tiny_manifest, {"inference": {"request_template": {"sampling": {"max_tokens": 40}}},
                                  "capture": {"activations": {"full_tensors": True}}})
    assert detinf("lock", "--config", tiny_manifest).code == 0
    outcomes = set()
    for delay in (0.5, 2.0, 4.0, 6.0, 8.0):
        target = tmp_path / f"run-{delay}"
        command = [sys.executable, "-m", "deterministic_inference", "run", "--config", str(tiny_manifest),
                   "--output-dir", str(target)]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = time.monotonic()
        _kill_when(process, lambda started=started, delay=delay: time.monotonic() - started > delay)
        verdict = detinf("verify", "--bundle-a", target, "--bundle-b", target, "--output-dir", tmp_path / "v")
        if target.exists():  # published before the kill: the rename made it complete in one step
            outcomes.add("complete")
            assert verdict.code == 0, verdict.err
        else:
            outcomes.add("absent")
            assert verdict.code == 2 and "not a run directory" in verdict.err
        for leftover in _leftovers(tmp_path):
            refused = detinf("verify", "--bundle-a", leftover, "--bundle-b", leftover)
            assert refused.code == 2 and "incomplete run" in refused.err
    assert "absent" in outcomes
