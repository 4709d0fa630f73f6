"""A Ray head started with Ray's own CLI (`ray start --head --block`), as a user starts one, on loopback.

Token authentication comes on the way Ray 2.60 turns it on for a user: `ray start` finds a token and
enables it by itself. The token is a file of the test's own (RAY_AUTH_TOKEN_PATH), never `~/.ray`. The
head runs in Ray's single-machine mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0), so it binds and
advertises 127.0.0.1 only, and every port it would pick by a fixed default is given a free one.

It stops by SIGTERM to `ray start` (which drains and stops what it started), bounded; whatever is
left of its process group (its own session) is then killed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.server.harness import free_port

START_TIMEOUT = 180.0
STOP_TIMEOUT = 60.0
RAY_CLIENT_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
PORT_OPTIONS = (
    "--port", "--ray-client-server-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
    "--metrics-export-port", "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port",
)  # fmt: skip


@dataclass(frozen=True)
class CliHead:
    """A running head: its GCS address and the environment of a client on this machine as a user has it
    by default (the head's token file where Ray looks for it, RAY_AUTH_MODE unset)."""

    address: str
    client_env: dict[str, str]


@contextlib.contextmanager
def cli_head(num_cpus: int = 2) -> Iterator[CliHead]:
    """Start the head, yield it once `ray start` reported the runtime started, stop it (bounded)."""
    work = Path(tempfile.mkdtemp(prefix="detinf-ray-"))  # short: Ray's socket paths live under it
    token = work / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {key: value for key, value in os.environ.items() if key not in RAY_CLIENT_ENV}
    env.update(RAY_AUTH_TOKEN_PATH=str(token), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    ports = _distinct_free_ports(len(PORT_OPTIONS))
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address",
        "127.0.0.1", "--temp-dir", str(work / "ray"), "--include-dashboard", "false", "--num-cpus",
        str(num_cpus), "--disable-usage-stats",
        *(item for option, port in zip(PORT_OPTIONS, ports, strict=True) for item in (option, str(port))),
    ]  # fmt: skip
    log = work / "ray-start.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        _wait_started(process, log)
        yield CliHead(f"127.0.0.1:{ports[0]}", env)
    finally:
        _stop(process)
        shutil.rmtree(work, ignore_errors=True)


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def _wait_started(process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"ray start did not start the head:\n{tail}")
        time.sleep(0.2)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # the head's session: what `ray start` left behind
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
