"""Progress of `detinf run` on stderr: a live bar on a pseudo-terminal, plain lines on a pipe, nothing
with --quiet; stdout keeps only the machine-readable result line."""

from __future__ import annotations

import io
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from deterministic_inference.workflow.progress import Progress

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """A settable monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_every_interval_with_rate_and_eta() -> None:
    clock, stream = FakeClock(), io.StringIO()
    progress = Progress("run", 10, stream, interval=5.0, clock=clock)
    clock.now += 60.0  # loading the engine: not in the rate
    progress.begin()
    progress.skip(2, 999)  # read back from a checkpoint: done, but not in the rate
    clock.now += 2.0
    progress(1, 20)
    assert stream.getvalue() == ""  # within the interval
    clock.now += 3.0
    progress(1, 30)
    assert stream.getvalue() == "run: 4/10 requests, 50 tokens, 10.0 tokens/s, ETA 0:00:15\n"
    progress.close()
    assert stream.getvalue().splitlines()[-1].startswith("run: 4/10 requests")


def test_disabled_progress_writes_nothing() -> None:
    stream = io.StringIO()
    progress = Progress("run", 3, stream, enabled=False)
    progress(3, 10)
    progress.close()
    assert stream.getvalue() == ""


def _command(manifest: Path, target: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deterministic_inference", "run", "--config", str(manifest),
            "--output-dir", str(target), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "100"}


def test_progress_on_a_pipe_is_plain_lines(tiny_manifest: Path, tmp_path: Path) -> None:
    target = tmp_path / "piped"
    result = subprocess.run(_command(tiny_manifest, target), env=_env(), capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {target}\n"
    lines = [line for line in result.stderr.splitlines() if line.startswith("run: ")]
    assert lines and lines[-1].startswith("run: 3/3 requests, ") and "tokens/s, ETA 0:00:00" in lines[-1]
    assert "\x1b[" not in result.stderr and "\r" not in result.stderr


def test_progress_on_a_terminal_is_a_live_bar(tiny_manifest: Path, tmp_path: Path) -> None:
    target = tmp_path / "tty"
    leader, follower = pty.openpty()
    process = subprocess.Popen(_command(tiny_manifest, target), env=_env(), stdout=subprocess.PIPE,
                               stderr=follower, cwd=ROOT)
    os.close(follower)
    shown = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 600)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process ended
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 0, shown.decode(errors="replace")
    assert stdout.decode() == f"wrote {target}\n"
    screen = shown.decode(errors="replace")
    assert "\x1b[" in screen and "3/3" in screen and "tok/s" in screen and "run" in screen
    assert "requests, " not in screen  # the bar, not the plain lines


def test_quiet_turns_progress_off(tiny_manifest: Path, tmp_path: Path) -> None:
    target = tmp_path / "quiet"
    result = subprocess.run(_command(tiny_manifest, target, "--quiet"), env=_env(), capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "requests" not in result.stderr and result.stdout == f"wrote {target}\n"


def test_work_of_unknown_size_shows_counts_and_rate_without_eta() -> None:
    clock, stream = FakeClock(), io.StringIO()
    progress = Progress("audit", None, stream, interval=1.0, clock=clock)
    clock.now += 2.0
    progress(4, 40)
    assert stream.getvalue() == "audit: 4 requests, 40 tokens, 20.0 tokens/s\n"


def test_verify_and_bundle_show_progress_on_large_files(tiny_manifest: Path, tmp_path: Path) -> None:
    """A run directory with a large capture (the real run's files plus a 40 MiB one, sealed as `run`
    seals them): verify and bundle report hashing it on stderr, stdout keeps their result lines."""
    from deterministic_inference.workflow.rundir import REQUIRED_FILES, write_run_dir
    from tests.workflow.helpers import detinf, read_json

    assert detinf("run", "--config", tiny_manifest, "--output-dir", tmp_path / "small").code == 0
    files = {name: (tmp_path / "small" / name).read_bytes() for name in REQUIRED_FILES}
    files["captures/big.bin"] = bytes(range(256)) * (40 << 12)  # 40 MiB
    bundle = {k: v for k, v in read_json(tmp_path / "small" / "bundle.json").items()
              if k not in ("files", "bundle_digest", "complete")}
    large = write_run_dir(tmp_path / "large", files, bundle)
    for args in (["verify", "--bundle-a", str(large), "--bundle-b", str(large), "--output-dir",
                  str(tmp_path / "report")],
                 ["bundle", "--run-dir", str(large), "--output", str(tmp_path / "large.tar.gz")]):
        result = subprocess.run([sys.executable, "-m", "deterministic_inference", *args], env=_env(),
                                capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert "hashing captures/big.bin (40 MiB)" in result.stderr
        assert "hashing" not in result.stdout
