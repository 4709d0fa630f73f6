"""Load with faults against a real `detinf serve`: 1000 requests at concurrency 64, 10% hostile, 10% of
the streams dropped by the client mid-way. Every valid request completes, each distinct request gets
one output (text and logprob bits) however often it runs and whatever runs beside it, no KV block is
left in use, and the server's RSS after the run is within 5% of its RSS after a warm-up."""

from __future__ import annotations

import asyncio
import json
import random
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.harness import RunningServer, metric, subprocess_server, tiny_serve_args, wait_for
from tests.server.hostile import Hostile, hostile_requests
from tests.tiny_models import TinyModel

TOTAL = 1000
CONCURRENCY = 64
WARMUP = 200
PROMPTS = ["Hello, world!", "The quick brown fox", "Numbers 0123456789", "def add(a, b):", "Grüße aus Köln"]


@dataclass(frozen=True)
class Valid:
    """A valid request; `key` names the distinct request (same key, same expected output)."""

    key: str
    path: str
    body: dict[str, Any]
    drop: bool = False  # a stream the client abandons after its first events


def bits(value: float | None) -> int | None:
    return None if value is None else int(struct.unpack("<I", struct.pack("<f", value))[0])


def valid_requests() -> list[Valid]:
    """Distinct valid requests over the three endpoints, streamed and not."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        sampling = {"max_tokens": 8, "temperature": 0.8, "seed": i}
        for stream in (False, True):
            requests.append(
                Valid(
                    f"cmpl/{i}/{stream}",
                    "/v1/completions",
                    {"prompt": prompt, "logprobs": 1, "stream": stream, **sampling},
                )
            )
            chat = {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "stream": stream}
            requests.append(Valid(f"chat/{i}/{stream}", "/v1/chat/completions", {**chat, **sampling}))
        gen = {"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": i}
        requests.append(
            Valid(f"gen/{i}", "/generate", {"text": prompt, "sampling_params": gen, "return_logprob": True})
        )
    return requests


def workload(total: int, seed: int) -> list[Valid | Hostile]:
    """`total` requests: 10% hostile, the rest valid; 10% of the valid streams are dropped mid-way."""
    rng = random.Random(seed)
    hostile = [h for h in hostile_requests() if len(h.body) < 100_000]
    valid = valid_requests()
    items: list[Valid | Hostile] = []
    for index in range(total):
        if index % 10 == 0:
            items.append(rng.choice(hostile))
            continue
        request = rng.choice(valid)
        if request.body.get("stream") and rng.random() < 0.1:
            request = Valid(request.key, request.path, request.body, drop=True)
        items.append(request)
    return items


def stream_signature(key: str, events: list[dict[str, Any]]) -> tuple[Any, ...]:
    """Concatenated text and logprob bits of a streamed completion or chat completion."""
    text, values = "", []
    for event in events:
        for choice in event.get("choices", []):
            if key.startswith("cmpl"):
                text += choice["text"]
                values += (choice["logprobs"] or {}).get("token_logprobs", [])
            else:
                text += choice["delta"].get("content") or ""
                values += [e["logprob"] for e in ((choice.get("logprobs") or {}).get("content") or [])]
    return text, tuple(map(bits, values))


def json_signature(key: str, document: dict[str, Any]) -> tuple[Any, ...]:
    if key.startswith("gen"):
        return document["text"], tuple(bits(v) for v, _, _ in document["meta_info"]["output_token_logprobs"])
    choice = document["choices"][0]
    if key.startswith("cmpl"):
        return choice["text"], tuple(map(bits, choice["logprobs"]["token_logprobs"]))
    return choice["message"]["content"], tuple(bits(e["logprob"]) for e in choice["logprobs"]["content"])


async def send(client: httpx.AsyncClient, base: str, item: Valid | Hostile) -> tuple[str, Any]:
    """(kind, result): ("hostile", status), ("dropped", None), ("ended before its drop", signature) for a
    stream to drop that ended before its second event (under load the server may coalesce tokens into
    fewer events), or (key, output signature)."""
    if isinstance(item, Hostile):
        response = await client.post(
            base + item.path, content=item.body, headers={"Content-Type": "application/json"}
        )
        return "hostile", response.status_code
    if not item.body.get("stream"):
        response = await client.post(base + item.path, json=item.body)
        assert response.status_code == 200, response.text
        return item.key, json_signature(item.key, response.json())
    events: list[dict[str, Any]] = []
    async with client.stream("POST", base + item.path, json=item.body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":  # a stream to drop can end first: the server may send few events
                kind = "ended before its drop" if item.drop else item.key
                return kind, stream_signature(item.key, events)
            events.append(json.loads(line[6:]))
            if item.drop and len(events) == 2:
                return "dropped", None  # leaving the block closes the connection mid-stream
    raise AssertionError(f"{item.key}: the stream ended without [DONE]")


async def run(base: str, items: list[Valid | Hostile]) -> list[tuple[str, Any]]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(item: Valid | Hostile) -> tuple[str, Any]:
            async with semaphore:
                return await send(client, base, item)

        return list(await asyncio.gather(*(one(item) for item in items)))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def idle(server: RunningServer) -> bool:
    return (
        metric(server, "detinf_kv_blocks_used") == 0 and metric(server, "detinf_num_inflight_sequences") == 0
    )


@pytest.mark.slow
def test_load_with_hostile_requests_and_dropped_streams(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    args = tiny_serve_args(tiny_llama_dir, "--threads", "1", "--max-num-seqs", "64")
    with subprocess_server(args, log=tmp_path / "serve.log") as (server, process):
        asyncio.run(run(server.base_url, workload(WARMUP, seed=1)))
        wait_for(lambda: idle(server))
        warm = rss_kib(process.pid)
        items = workload(TOTAL, seed=2)
        results = asyncio.run(run(server.base_url, items))
        wait_for(lambda: idle(server))
        after = rss_kib(process.pid)
        assert process.poll() is None
    outputs: dict[str, set[Any]] = defaultdict(set)
    for (kind, result), item in zip(results, items, strict=True):
        if kind == "hostile":
            assert 400 <= result < 500, (item, result)
        elif kind not in ("dropped", "ended before its drop"):
            outputs[kind].add(result)
    valid = [item for item in items if isinstance(item, Valid)]
    dropped = sum(1 for item in valid if item.drop)
    assert sum(1 for kind, _ in results if kind == "hostile") == TOTAL // 10
    kinds = [kind for kind, _ in results]
    assert kinds.count("dropped") > 0
    assert kinds.count("dropped") + kinds.count("ended before its drop") == dropped
    assert {key: len(seen) for key, seen in outputs.items() if len(seen) != 1} == {}
    # a stream and a non-stream request of the same body and prompt give the same text and bits
    for i in range(len(PROMPTS)):
        for kind in ("cmpl", "chat"):
            if f"{kind}/{i}/False" in outputs and f"{kind}/{i}/True" in outputs:
                assert outputs[f"{kind}/{i}/False"] == outputs[f"{kind}/{i}/True"]
    print(f"RSS after warm-up {warm} KiB, after the run {after} KiB; {dropped} streams dropped")
    assert abs(after - warm) <= 0.05 * warm, (warm, after)
