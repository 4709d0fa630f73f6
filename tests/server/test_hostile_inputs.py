"""Hostile input over real HTTP: every answer is a 4xx OpenAI error naming the field (never a 5xx, never a
traceback), and valid requests sent at the same time get the same bits as on an idle server."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import httpx

from tests.server.harness import TINY_NAME, RunningServer
from tests.server.hostile import Hostile, hostile_requests

VALID: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": (
        "/v1/completions",
        {
            "model": TINY_NAME,
            "prompt": "The quick brown fox",
            "max_tokens": 8,
            "temperature": 0.8,
            "seed": 5,
            "logprobs": 2,
        },
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "model": TINY_NAME,
            "messages": [{"role": "user", "content": "Hello, world!"}],
            "max_tokens": 8,
            "temperature": 0.7,
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    "generate": (
        "/generate",
        {
            "text": "Numbers 0123",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.9, "sampling_seed": 9},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    ),
}


def bits(value: float | None) -> int | None:
    return None if value is None else int(struct.unpack("<I", struct.pack("<f", value))[0])


def signature(kind: str, document: dict[str, Any]) -> tuple[Any, ...]:
    """Text, token ids or tokens, and the float32 bits of every logprob of a valid response."""
    if kind == "completions":
        choice = document["choices"][0]
        lp = choice["logprobs"]
        tops = tuple(tuple(sorted((k, bits(v)) for k, v in t.items())) for t in lp["top_logprobs"])
        return choice["text"], tuple(lp["tokens"]), tuple(map(bits, lp["token_logprobs"])), tops
    if kind == "chat":
        choice = document["choices"][0]
        content = choice["logprobs"]["content"]
        return choice["message"]["content"], tuple(
            (
                e["token"],
                bits(e["logprob"]),
                tuple((t["token"], bits(t["logprob"])) for t in e["top_logprobs"]),
            )
            for e in content
        )
    meta = document["meta_info"]
    return (
        document["text"],
        tuple(document["output_ids"]),
        tuple((bits(v), t) for v, t, _ in meta["output_token_logprobs"]),
        tuple(tuple((bits(v), t) for v, t, _ in step) for step in meta["output_top_logprobs"]),
    )


def problem(case: Hostile, response: httpx.Response) -> str | None:
    """What is wrong with the answer to a hostile request (None: a clean 4xx naming the field)."""
    if not 400 <= response.status_code < 500:
        return f"status {response.status_code}: {response.text[:200]}"
    error = response.json().get("error")
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not an OpenAI error body: {response.text[:200]}"
    message = error["message"]
    if not isinstance(message, str) or not message or "Traceback" in message or ".py" in message:
        return f"bad message: {message!r}"
    if case.param is not None and error["param"] != case.param:
        return f"param {error['param']!r}, expected {case.param!r} ({message})"
    return None


async def valid(client: httpx.AsyncClient, base: str, kind: str) -> tuple[Any, ...]:
    path, body = VALID[kind]
    response = await client.post(base + path, json=body)
    assert response.status_code == 200, (kind, response.text[:300])
    return signature(kind, response.json())


async def hostile(client: httpx.AsyncClient, base: str, case: Hostile) -> tuple[Hostile, httpx.Response]:
    headers = {"Content-Type": "application/json"}
    return case, await client.post(base + case.path, content=case.body, headers=headers)


def test_hostile_inputs_are_4xx_and_valid_neighbours_keep_their_bits(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    cases = hostile_requests()

    async def main() -> tuple[dict[str, tuple[Any, ...]], list[Any], list[Any]]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            idle = {kind: await valid(client, base, kind) for kind in VALID}
            hostile_tasks = [hostile(client, base, case) for case in cases]
            valid_tasks = [valid(client, base, kind) for kind in list(VALID) * 4]
            results = await asyncio.gather(*hostile_tasks, *valid_tasks)
        return idle, list(results[: len(cases)]), list(results[len(cases) :])

    idle, hostile_results, valid_results = asyncio.run(main())
    problems = {case.name: problem(case, response) for case, response in hostile_results}
    assert {name: p for name, p in problems.items() if p is not None} == {}
    assert valid_results == [idle[kind] for kind in list(VALID) * 4]
    paths = {case.path for case in cases}
    assert paths == {"/v1/completions", "/v1/chat/completions", "/generate"}
    assert server_errors(tiny_server) == []


def server_errors(server: RunningServer) -> list[str]:
    """Request counters with a 5xx status (the start-up /healthz polls, 503 while loading, excepted)."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return [
        line
        for line in text.splitlines()
        if line.startswith("detinf_requests_total") and 'status="5' in line and 'path="/healthz"' not in line
    ]


def test_the_issue_example_is_a_400_and_the_server_keeps_serving(tiny_server: RunningServer) -> None:
    """`curl -s localhost:8000/generate -d '{"text": "\\udcff"}'` (form content type, lone surrogate)."""
    response = httpx.post(
        tiny_server.base_url + "/generate",
        content=b'{"text": "\\udcff"}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        timeout=60,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "text"
    health = httpx.get(tiny_server.base_url + "/healthz", timeout=30)
    assert health.status_code == 200
    ok = httpx.post(tiny_server.base_url + "/generate", content=b'{"text": "Hello"}', timeout=60)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] > 0
