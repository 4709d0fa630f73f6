"""`detinf serve` as a user runs it: plain serve never imports Ray; `--replicas` deploys on Ray with the
same API (auth, errors) and stops cleanly on SIGTERM."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import (
    TINY_NAME,
    detinf_command,
    free_port,
    stop_process,
    subprocess_server,
    tiny_serve_args,
    wait_for,
)
from tests.tiny_models import TinyModel

READY = "detinf serve: ready: 1 replica(s) on Ray"
RAY_IMPORT = re.compile(r"^import time:.*\|\s+ray(\.[\w.]+)?\s*$", re.MULTILINE)


def _complete(base_url: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", headers=headers, timeout=60,
                      json={"model": TINY_NAME, "prompt": "hello there", "max_tokens": 4, "logprobs": 1})


def test_plain_serve_does_not_import_ray(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with subprocess_server(tiny_serve_args(tiny_llama_dir), env={"PYTHONPROFILEIMPORTTIME": "1"},
                           log=log) as (server, _):
        assert _complete(server.base_url, {}).status_code == 200
    text = log.read_text(errors="replace")
    assert "import time:" in text and "deterministic_inference.server.app" in text  # the log is real
    assert not RAY_IMPORT.search(text), RAY_IMPORT.search(text)


@pytest.mark.slow
def test_serve_replicas_cli(tiny_llama_dir: TinyModel, ray_cluster: str, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    args = tiny_serve_args(tiny_llama_dir, "--replicas", "1", "--ray-address", ray_cluster, "--threads", "1")
    env = {"DETINF_API_KEY": "secret", "PYTHONPROFILEIMPORTTIME": "1"}
    with subprocess_server(args, env=env, log=log) as (server, process):
        unauthorized = _complete(server.base_url, {})
        assert unauthorized.status_code == 401
        assert unauthorized.json()["error"]["code"] == "invalid_api_key"
        answer = _complete(server.base_url, server.headers())
        assert answer.status_code == 200, answer.text
        assert answer.json()["system_fingerprint"] == httpx.get(server.base_url + "/healthz").json()[
            "system_fingerprint"]
        bad = httpx.post(server.base_url + "/v1/completions", headers=server.headers(), timeout=30,
                         json={"model": TINY_NAME, "prompt": "x", "max_tokens": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        # the router answers before `serve` itself has polled it: wait for its ready line, then stop it
        wait_for(lambda: READY in log.read_text(errors="replace"), timeout=60, interval=0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0
    text = log.read_text(errors="replace")
    assert READY in text
    assert RAY_IMPORT.search(text)  # the detector sees Ray where it is imported (negative control)
    assert _applications() == []  # nothing left running on the shared cluster


def _applications() -> list[str]:
    """Serve applications on the cluster this test process is connected to (ray_cluster)."""
    from ray import serve

    return sorted(serve.status().applications)


def _first_http_answer(base_url: str, process: subprocess.Popen[bytes], timeout: float = 300.0) -> int:
    """Poll until Serve's proxy answers anything (it starts before the application is deployed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        try:
            return httpx.get(base_url + "/healthz", timeout=2.0).status_code
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError(f"the proxy never answered (exit code {process.poll()})")


@pytest.mark.slow
def test_sigterm_while_deploying_exits_zero_and_undeploys(
    tiny_llama_dir: TinyModel, ray_cluster: str, tmp_path: Path
) -> None:
    """A SIGTERM that arrives before the application is routable (a supervisor stopping a slow start)
    still undeploys: ray.init's own handler (sys.exit(15)) would leave the replicas holding the
    cluster's CPUs."""
    port = free_port()
    args = tiny_serve_args(tiny_llama_dir, "--replicas", "1", "--ray-address", ray_cluster, "--threads", "1")
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen([*detinf_command(), "serve", "--host", "127.0.0.1", "--port", str(port),
                                    *args], stdout=log, stderr=log)
        try:
            _first_http_answer(f"http://127.0.0.1:{port}", process)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text(errors="replace")
        finally:
            stop_process(process)
    assert _applications() == []
