"""429 with Retry-After when the bounded queue is full; a client disconnect aborts and frees KV blocks."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, metric, thread_server, tiny_config, wait_for
from tests.tiny_models import TinyModel

LONG = {"model": TINY_NAME, "prompt": "Hello", "max_tokens": 490, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def one_slot(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """Capacity 1: max_num_seqs 1 and no waiting room."""
    config = tiny_config(tiny_llama_dir, max_num_seqs=1)
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME, max_waiting=0)) as server:
        yield server


def idle(server: RunningServer) -> bool:
    return (
        metric(server, "detinf_kv_blocks_used") == 0 and metric(server, "detinf_num_inflight_sequences") == 0
    )


def test_full_queue_is_429_with_retry_after_then_recovers(one_slot: RunningServer) -> None:
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", one_slot.v1 + "/completions", json={**LONG, "stream": True}) as stream,
    ):
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # admitted and generating
        busy = httpx.post(one_slot.v1 + "/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert busy.status_code == 429
        assert busy.headers["Retry-After"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
    wait_for(lambda: idle(one_slot))
    ok = httpx.post(one_slot.v1 + "/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_stream_disconnect_aborts_and_frees_blocks(one_slot: RunningServer) -> None:
    wait_for(lambda: idle(one_slot))
    aborted = metric(one_slot, "detinf_aborted_requests_total")
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", one_slot.v1 + "/completions", json={**LONG, "stream": True}) as stream,
    ):
        lines = stream.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert metric(one_slot, "detinf_kv_blocks_used") > 0
    # leaving the block closes the connection mid-stream
    wait_for(lambda: idle(one_slot))
    assert metric(one_slot, "detinf_aborted_requests_total") == aborted + 1


def test_non_stream_disconnect_aborts_and_frees_blocks(one_slot: RunningServer) -> None:
    wait_for(lambda: idle(one_slot))
    aborted = metric(one_slot, "detinf_aborted_requests_total")
    body = json.dumps(LONG).encode()
    host, port = one_slot.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: metric(one_slot, "detinf_kv_blocks_used") > 0, interval=0.005)  # generating
    # the socket is closed while the (490-token) request is still generating
    wait_for(lambda: idle(one_slot))
    assert metric(one_slot, "detinf_aborted_requests_total") == aborted + 1
