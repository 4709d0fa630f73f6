"""Runs the documentation's examples: shell blocks with bash, Python blocks with the venv's python, every
one bounded in time; `detinf serve` blocks as background servers shared by every page that shows the
same command (one process per distinct command for the whole test session).

Examples run with the venv's `bin/` first on PATH (as after `source .venv/bin/activate`) and with
OMP_NUM_THREADS=1 (the machine is shared; thread counts do not change outputs, which the engine's
tests prove). `localhost:8000` and `127.0.0.1:8000` in an example point at the page's current server.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.docs.examples import Example, output_matches

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_TIMEOUT = 600.0  # seconds per example
SERVER_START_TIMEOUT = 300.0
DOCS_PORT = "8000"  # the port the pages show
_ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):" + DOCS_PORT + r"\b")
_PORT_FLAG = re.compile(r"--port[ =]" + DOCS_PORT + r"\b")


def example_env() -> dict[str, str]:
    """The environment examples run in."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    env["NO_MKDOCS_2_WARNING"] = "1"
    env.pop("DETINF_API_KEY", None)
    return env


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerPool:
    """`detinf serve` processes keyed by the command a page shows."""

    logs: Path
    servers: dict[tuple[str, str], tuple[int, subprocess.Popen[bytes]]] = field(default_factory=dict)

    def port_for(self, example: Example, workdir: Path) -> int:
        """Start (or reuse) the server of this `detinf serve` example, run in `workdir` (relative paths
        such as `--config m.json` are the page's files); its port. A command that reads no file of the
        page (no `--config`) is shared by every page that shows it."""
        command = example.code.strip()
        cwd = workdir if "--config" in command else REPO
        key = (command, str(cwd))
        if key in self.servers:
            port, process = self.servers[key]
            if process.poll() is None:
                return port
        if not command.startswith("detinf serve") or "\n" in command:
            raise AssertionError(f"{example.where}: a server block must be one `detinf serve` command")
        port = free_port()
        shown = shlex.split(command)
        if "--port" not in command:
            shown += ["--port", DOCS_PORT]
        argv = [_ADDRESS.sub(f"127.0.0.1:{port}", part) for part in shown]
        argv = [str(port) if argv[i - 1] == "--port" else part for i, part in enumerate(argv)]
        log = self.logs / f"server-{len(self.servers)}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "deterministic_inference", *argv[1:]],
                env=example_env(), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.servers[key] = (port, process)
        _wait_healthy(port, process, log)
        return port

    def stop_all(self, workdir: Path | None = None) -> None:
        """SIGTERM every server (or those running in `workdir`), SIGKILL what does not exit within a
        minute."""
        keys = [key for key in self.servers if workdir is None or key[1] == str(workdir)]
        for key in keys:
            if self.servers[key][1].poll() is None:
                self.servers[key][1].send_signal(signal.SIGTERM)
        for key in keys:
            _, process = self.servers.pop(key)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _wait_healthy(port: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"detinf serve exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"detinf serve not healthy after {SERVER_START_TIMEOUT} s:\n{log.read_text()}")


@contextmanager
def server_pool(logs: Path) -> Iterator[ServerPool]:
    """A pool whose servers are stopped when the block exits."""
    pool = ServerPool(logs)
    try:
        yield pool
    finally:
        pool.stop_all()


@dataclass(frozen=True)
class Outcome:
    """What one example did."""

    code: int
    stdout: str
    stderr: str


def run_example(example: Example, workdir: Path, port: int | None) -> Outcome:
    """Run one (non-server) example; `port` replaces 8000 in its addresses."""
    code = example.code
    if port is not None:
        code = _PORT_FLAG.sub(f"--port {port}", _ADDRESS.sub(f"127.0.0.1:{port}", code))
    cwd = REPO if example.in_repo else workdir
    if example.language == "python":
        script = workdir / f"example_{example.line}.py"
        script.write_text(code, encoding="utf-8")
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    done = subprocess.run(
        argv, cwd=cwd, env=example_env(), capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


def check_example(example: Example, outcome: Outcome) -> str | None:
    """None when the example behaved as the page says, else a message saying how it differed."""
    problems = []
    if outcome.code != example.exit_code:
        problems.append(f"exit code {outcome.code}, the page expects {example.exit_code}")
    if example.expected is not None and not output_matches(example.expected, outcome.stdout):
        problems.append(f"output differs from the page's Output block:\n{example.expected}")
    if not problems:
        return None
    return (
        f"{example.where}: " + "; ".join(problems) + f"\n--- stdout ---\n{outcome.stdout}"
        f"\n--- stderr ---\n{outcome.stderr[-4000:]}"
    )


def run_pages(examples: list[Example], workdir: Path, pool: ServerPool) -> list[str]:
    """Run a group of pages' examples in order in `workdir`; the failures (empty when all passed).
    A failure stops the group (later examples may depend on the failed one's files). Servers started
    in `workdir` are stopped at the end."""
    try:
        return _run_in_order(examples, workdir, pool)
    finally:
        pool.stop_all(workdir)


def _run_in_order(examples: list[Example], workdir: Path, pool: ServerPool) -> list[str]:
    port: int | None = None
    page = None
    for example in examples:
        if example.page != page:
            page, port = example.page, None
        if example.skip is not None:
            continue
        if example.server:
            port = pool.port_for(example, workdir)
            continue
        if port is None and _ADDRESS.search(example.code):
            return [f"{example.where}: talks to port {DOCS_PORT} but the page started no server before it"]
        failure = check_example(example, run_example(example, workdir, port))
        if failure is not None:
            return [failure]
    return []
