"""Faults inside the engine, injected with `FaultInjection` (engine/faults.py; never reachable by a
request): one request's failure is that request's alone (500, no traceback, neighbours keep their
bits); an engine bug turns /healthz 503 at once, fails in-flight requests with 503 and makes
`detinf serve` exit non-zero in bounded time, with the traceback in its log only."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import ENV_VAR, FaultInjection
from deterministic_inference.server.app import ServerSettings
from tests.server.harness import (
    TINY_NAME,
    RunningServer,
    metric,
    subprocess_server,
    thread_server,
    tiny_config,
    tiny_serve_args,
    wait_for,
)
from tests.server.test_hostile_inputs import VALID, server_errors, signature
from tests.tiny_models import TinyModel

SAMPLE_MARKER = 299  # token ids that none of the valid requests' prompts encode to
DETOKENIZE_MARKER = 297


@pytest.fixture(scope="module")
def faulty_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """A server whose engine fails the sampling / detokenization of requests carrying a marker token."""
    config = tiny_config(tiny_llama_dir)
    faults = FaultInjection(fail_sample_token=SAMPLE_MARKER, fail_detokenize_token=DETOKENIZE_MARKER)
    settings = ServerSettings(served_model_name=TINY_NAME)
    with thread_server(config, settings, engine_factory=lambda: Engine(config, faults=faults)) as server:
        yield server


def failing_body(marker: int, stream: bool) -> dict[str, Any]:
    return {"prompt": [0, 40, 41, marker, 42], "max_tokens": 6, "temperature": 0, "stream": stream}


async def post_valid(client: httpx.AsyncClient, base: str, kind: str) -> tuple[Any, ...]:
    path, body = VALID[kind]
    response = await client.post(base + path, json=body)
    assert response.status_code == 200, response.text
    return signature(kind, response.json())


async def post_failing(client: httpx.AsyncClient, base: str, marker: int, stream: bool) -> httpx.Response:
    return await client.post(base + "/v1/completions", json=failing_body(marker, stream))


@pytest.mark.parametrize("marker", [SAMPLE_MARKER, DETOKENIZE_MARKER], ids=["sampling", "detokenization"])
def test_a_request_failing_in_the_engine_fails_alone(faulty_server: RunningServer, marker: int) -> None:
    base = faulty_server.base_url

    async def main() -> tuple[dict[str, Any], list[Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            idle = {kind: await post_valid(client, base, kind) for kind in VALID}
            tasks: list[Coroutine[Any, Any, object]] = [
                post_failing(client, base, marker, stream) for stream in (False, True) * 3
            ]
            tasks += [post_valid(client, base, kind) for kind in list(VALID) * 3]
            return idle, list(await asyncio.gather(*tasks))

    idle, results = asyncio.run(main())
    failed, valid = results[:6], results[6:]
    assert valid == [idle[kind] for kind in list(VALID) * 3]
    for response in failed[0::2]:  # not streamed: a 500 naming no file and showing no traceback
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "request_failed" and error["type"] == "server_error"
        assert "Traceback" not in error["message"] and ".py" not in error["message"]
    for response in failed[1::2]:  # streamed: the error in-band, then [DONE]
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
    assert httpx.get(base + "/healthz", timeout=30).status_code == 200
    wait_for(lambda: metric(faulty_server, "detinf_kv_blocks_used") == 0)
    assert metric(faulty_server, "detinf_num_inflight_sequences") == 0
    assert [line for line in server_errors(faulty_server) if 'status="500"' not in line] == []


def test_an_engine_bug_means_503_and_a_nonzero_exit(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    body = {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with subprocess_server(tiny_serve_args(tiny_llama_dir), {ENV_VAR: "fail_step=30"}, log) as (
        server,
        process,
    ):
        answers: list[httpx.Response] = []
        request = threading.Thread(
            target=lambda: answers.append(httpx.post(server.v1 + "/completions", json=body, timeout=60))
        )
        request.start()
        health = None
        deadline = time.monotonic() + 60
        while health is None and time.monotonic() < deadline:
            response = httpx.get(server.base_url + "/healthz", timeout=5)
            if response.status_code == 503:
                health = response
            time.sleep(0.01)
        failed_at = time.monotonic()
        request.join(timeout=60)
        code = process.wait(timeout=30)
        exit_seconds = time.monotonic() - failed_at
    assert health is not None and health.json()["status"] == "failed"
    assert "Traceback" not in health.text and ".py" not in health.text and "InjectedFault" in health.text
    assert answers and answers[0].status_code == 503
    assert answers[0].json()["error"]["code"] == "engine_dead"
    assert code == 1
    assert exit_seconds < 10
    text = log.read_text(errors="replace")
    assert "Traceback" in text and "injected engine fault at step 30" in text
