"""Real servers on loopback for tests: uvicorn in a thread (fast) or `detinf serve` in a subprocess.

Every wait is bounded; servers stop by themselves when the context exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.server.app import ServerSettings, create_app
from tests.tiny_models import TinyModel

START_TIMEOUT = 120.0
TINY_KV_BLOCKS = 512
TINY_NAME = "tiny"  # served model name of test servers on the tiny model


def tiny_config(tiny: TinyModel, **changes: Any) -> EngineConfig:
    """Engine settings for tests on the tiny model (small KV pool)."""
    return EngineConfig(model=str(tiny.path), num_kv_blocks=TINY_KV_BLOCKS).replace(**changes)


@dataclass(frozen=True)
class RunningServer:
    """Where a test server listens."""

    base_url: str  # http://127.0.0.1:PORT
    api_key: str | None = None

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def wait_healthy(
    base_url: str, timeout: float = START_TIMEOUT, process: subprocess.Popen[bytes] | None = None
) -> None:
    """Poll /healthz until 200 (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited early with {process.returncode}")
        try:
            if httpx.get(base_url + "/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url} not healthy after {timeout} s")


@contextmanager
def thread_server(
    config: EngineConfig,
    settings: ServerSettings | None = None,
    engine_factory: Callable[[], Engine] | None = None,
    without_paths: Sequence[str] = (),
) -> Iterator[RunningServer]:
    """uvicorn + app in a background thread on a free loopback port (`engine_factory`: e.g. an engine
    with injected faults; `without_paths`: endpoints removed, to stand for servers that lack them)."""
    app = create_app(config, settings, engine_factory=engine_factory)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in without_paths]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=30)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url)
        yield RunningServer(base_url, settings.api_key if settings else None)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def free_port() -> int:
    """A port that was free a moment ago (loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def detinf_command() -> list[str]:
    """`detinf` run with this interpreter."""
    return [sys.executable, "-m", "deterministic_inference"]


@contextmanager
def subprocess_server(
    args: Sequence[str], env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[tuple[RunningServer, subprocess.Popen[bytes]]]:
    """`detinf serve ARGS --port P` in a subprocess (its output into `log` when given); SIGTERM (then
    SIGKILL) when the context exits."""
    port = free_port()
    command = [*detinf_command(), "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    full_env = {**os.environ, **(env or {})}
    with contextlib.ExitStack() as stack:
        output = stack.enter_context(open(log, "wb")) if log is not None else None
        process = subprocess.Popen(
            command, env=full_env, cwd=Path(__file__).resolve().parents[2], stdout=output, stderr=output
        )
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url, process=process)
            yield RunningServer(base_url, full_env.get("DETINF_API_KEY")), process
        finally:
            stop_process(process)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process if it still runs, SIGKILL it if it does not exit in 60 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def tiny_serve_args(tiny: TinyModel, *extra: str) -> list[str]:
    """`detinf serve` arguments for the tiny model (small KV pool, the test model name)."""
    return [
        "--model",
        str(tiny.path),
        "--num-kv-blocks",
        str(TINY_KV_BLOCKS),
        "--served-model-name",
        TINY_NAME,
        *extra,
    ]


def metric(server: RunningServer, name: str) -> float:
    """Value of an unlabelled metric from GET /metrics."""
    text = httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=10).text
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == name:
            return float(value)
    raise KeyError(name)


def wait_for(condition: Any, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Poll `condition()` until truthy (bounded); AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
