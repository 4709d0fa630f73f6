"""Start-up (/healthz 503 until the engine is built), load failure, and SIGTERM drain of `detinf serve`."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from typing import Any

import httpx
import uvicorn

from deterministic_inference.engine.engine import Engine
from deterministic_inference.server.app import create_app
from tests.server.harness import (
    TINY_NAME,
    detinf_command,
    free_port,
    subprocess_server,
    tiny_config,
    wait_for,
)
from tests.tiny_models import TinyModel

KEY = "sk-drain-test"


def test_healthz_is_503_until_the_engine_is_built(tiny_llama_dir: TinyModel) -> None:
    config = tiny_config(tiny_llama_dir)
    gate = threading.Event()

    def slow_factory() -> Engine:
        gate.wait(timeout=60)
        return Engine(config)

    app = create_app(config, engine_factory=slow_factory)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=30)
        loading = httpx.get(base + "/healthz")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        busy = httpx.post(base + "/v1/completions", json={"prompt": "x"})
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "engine_not_ready"
        gate.set()
        wait_for(lambda: httpx.get(base + "/healthz").status_code == 200, timeout=60)
        assert httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        gate.set()
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


def test_serve_exits_1_when_the_model_cannot_load(tmp_path: Any) -> None:
    command = [*detinf_command(), "serve", "--port", str(free_port()), "--model", str(tmp_path / "missing")]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 1
    assert "failed to start" in finished.stderr


def test_sigterm_finishes_inflight_requests_and_exits_0(tiny_llama_dir: TinyModel) -> None:
    args = ["--model", str(tiny_llama_dir.path), "--num-kv-blocks", "512", "--served-model-name", TINY_NAME]
    with subprocess_server(args, env={"DETINF_API_KEY": KEY}) as (server, process):
        assert httpx.get(server.v1 + "/models").status_code == 401  # the key from the environment applies
        body = {
            "prompt": "Hello",
            "max_tokens": 40,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[str] = []
        with httpx.Client(timeout=120, headers=server.headers()) as client:
            with client.stream("POST", server.v1 + "/completions", json=body) as stream:
                lines = stream.iter_lines()
                events.append(next(line for line in lines if line.startswith("data: ")))
                process.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                try:  # no new connections once shutting down
                    refused = httpx.get(server.base_url + "/healthz", timeout=5).status_code != 200
                except httpx.HTTPError:
                    refused = True
                assert refused
                events += [line for line in lines if line.startswith("data: ")]
        assert process.wait(timeout=60) == 0
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 40
