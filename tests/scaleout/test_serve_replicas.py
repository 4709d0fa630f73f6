"""Ray Serve replicas behind one endpoint answer with the one-process server's bits.

One deployment on the local Ray instance: replica-0 and replica-1 run the tiny model in bf16; replica-2
runs it in fp32 (other numerics, so another fingerprint) and must be refused routing. The reference is
a one-process server (uvicorn in a thread) with replica-0's settings.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from deterministic_inference.server.app import ServerSettings
from tests.scaleout.helpers import bits, fold_stream, labelled_metric, sse_documents
from tests.server.harness import TINY_NAME, RunningServer, free_port, thread_server, tiny_config, wait_for
from tests.tiny_models import TinyModel

pytestmark = pytest.mark.slow

WORDS = ("river", "mountain", "quiet", "engine", "orange", "window", "seven", "paper", "cloud", "garden")


@pytest.fixture(scope="module")
def replicated(ray_cluster: str, tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """Router + 3 replicas (replica-2 with fp32 numerics) on Serve's proxy at a free loopback port."""
    from ray import serve

    from deterministic_inference.scaleout.serve_app import APP_NAME, ReplicatedSpec, build_application

    base = tiny_config(tiny_llama_dir, dtype="bfloat16")
    spec = ReplicatedSpec(
        replicas=3,
        engine=base,
        settings=ServerSettings(served_model_name=TINY_NAME),
        cpus_per_replica=0.5,
        replica_engines=((2, base.replace(dtype="float32")),),
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_application(spec), name=APP_NAME, route_prefix="/")
        base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _all_joined(base_url), timeout=300, interval=0.5)
        yield RunningServer(base_url)
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def one_process(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """The reference: one server process with replica-0's settings."""
    config = tiny_config(tiny_llama_dir, dtype="bfloat16")
    with thread_server(config, ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server


def _all_joined(base_url: str) -> bool:
    try:
        replicas = httpx.get(base_url + "/healthz", timeout=10).json().get("replicas", [])
    except (httpx.HTTPError, ValueError):
        return False
    return len(replicas) == 3 and all(r["state"] == "ready" and r["system_fingerprint"] for r in replicas)


def _requests() -> list[tuple[str, dict[str, Any]]]:
    """20 distinct requests (completions and chat, streamed or not, greedy and seeded), each sent twice."""
    distinct = []
    for i in range(20):
        text = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(2 + i % 5)) + f" {i}"
        sampling: dict[str, Any] = {"max_tokens": 6 + i % 5, "temperature": 0.0 if i % 2 else 0.8, "seed": i}
        stream = i % 4 in (1, 3)
        if i % 4 < 2:
            distinct.append(("/v1/completions", {"model": TINY_NAME, "prompt": text, "logprobs": 2,
                                                 "stream": stream, **sampling}))
        else:
            distinct.append(("/v1/chat/completions", {"model": TINY_NAME, "stream": stream, "logprobs": True,
                                                      "top_logprobs": 2, **sampling,
                                                      "messages": [{"role": "user", "content": text}]}))
    return distinct + distinct


async def _send_all(base_url: str, requests: list[tuple[str, dict[str, Any]]], concurrency: int) -> list[Any]:
    """Send every request (at most `concurrency` at once); each result as bits (streams: folded)."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(path: str, body: dict[str, Any]) -> Any:
            async with gate:
                response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            return bits(fold_stream(sse_documents(response.text)) if body["stream"] else response.json())

        return await asyncio.gather(*(one(path, body) for path, body in requests))


def _routed(server: RunningServer, replica: str) -> float:
    return labelled_metric(server.base_url, "detinf_replica_routed_requests", {"replica": replica})


def test_replicas_give_the_one_process_bits(replicated: RunningServer, one_process: RunningServer) -> None:
    requests = _requests()
    reference = asyncio.run(_send_all(one_process.base_url, requests[:20], concurrency=1))
    before = {name: _routed(replicated, name) for name in ("replica-0", "replica-1", "replica-2")}
    got = asyncio.run(_send_all(replicated.base_url, requests, concurrency=8))
    for index in range(20):
        assert got[index] == got[index + 20], f"request {index}: two answers from the replicated server"
        assert got[index] == reference[index], f"request {index}: differs from the one-process server"
    fingerprints = {fp for result in got for fp in result.get("system_fingerprints", [])} | {
        result["system_fingerprint"] for result in got if "system_fingerprint" in result}
    assert fingerprints == {reference[0]["system_fingerprint"]}
    served = {name: _routed(replicated, name) - before[name] for name in before}
    assert served["replica-0"] > 0 and served["replica-1"] > 0, served  # both replicas served
    assert served["replica-2"] == 0 and sum(served.values()) == 40, served


def test_a_replica_with_other_numerics_is_refused(replicated: RunningServer) -> None:
    health = httpx.get(replicated.base_url + "/healthz", timeout=10).json()
    states = {r["name"]: r for r in health["replicas"]}
    assert states["replica-0"]["routable"] and states["replica-1"]["routable"]
    refused = states["replica-2"]
    assert not refused["routable"] and "numerics.dtype: bfloat16 != float32" in refused["reason"]
    assert refused["system_fingerprint"] != health["system_fingerprint"]
    match = "detinf_replica_fingerprint_match"
    assert labelled_metric(replicated.base_url, match, {"replica": "replica-0"}) == 1
    assert labelled_metric(replicated.base_url, match, {"replica": "replica-2"}) == 0
    assert labelled_metric(replicated.base_url, "detinf_replica_routable", {"replica": "replica-2"}) == 0


def test_negative_control_the_refused_replica_gives_other_bits(
    replicated: RunningServer, one_process: RunningServer
) -> None:
    """Why the check matters: replica-2, asked directly, answers the same request with other bits."""
    from ray import serve
    from ray.serve.handle import DeploymentResponseGenerator

    from deterministic_inference.scaleout.asgi_bridge import ForwardedRequest, ResponseHead
    from deterministic_inference.scaleout.serve_app import APP_NAME

    path, body = _requests()[0]
    reference = asyncio.run(_send_all(one_process.base_url, [(path, body)], concurrency=1))[0]
    forwarded = ForwardedRequest("POST", path, b"", ((b"content-type", b"application/json"),),
                                 httpx.Request("POST", "/", json=body).content)

    async def ask(name: str) -> Any:
        handle = serve.get_deployment_handle(name, APP_NAME)
        stream = handle.options(stream=True).handle.remote(forwarded)
        if not isinstance(stream, DeploymentResponseGenerator):  # options(stream=True) gives a generator
            raise TypeError(f"a streaming handle returned {type(stream).__name__}")
        items = [item async for item in stream]
        assert isinstance(items[0], ResponseHead) and items[0].status == 200
        return bits(httpx.Response(200, content=b"".join(items[1:])).json())

    assert asyncio.run(ask("replica-0")) == reference  # the same path to an accepted replica: equal
    assert asyncio.run(ask("replica-2")) != reference


def test_shared_long_prefix_hits_the_prefix_cache_of_one_replica(replicated: RunningServer) -> None:
    prefix = "the quick brown fox jumps over the lazy dog " * 8  # 352 characters > AFFINITY_CHARS
    names = ("replica-0", "replica-1")
    hits = "detinf_prefix_cache_hit_tokens_total"
    routed_before = {name: _routed(replicated, name) for name in names}
    hits_before = {name: labelled_metric(replicated.base_url, hits, {"replica": name}) for name in names}
    for i in range(5):
        response = httpx.post(replicated.base_url + "/v1/completions", timeout=60,
                              json={"model": TINY_NAME, "prompt": f"{prefix}{WORDS[i]}", "max_tokens": 2})
        assert response.status_code == 200, response.text
    routed = {name: _routed(replicated, name) - routed_before[name] for name in names}
    owner = max(routed, key=lambda name: routed[name])
    assert routed[owner] == 5, routed  # every request sharing the prefix went to one replica
    gained = {name: labelled_metric(replicated.base_url, hits, {"replica": name}) - hits_before[name]
              for name in names}
    assert gained[owner] >= 4 * 16, gained  # the 4 later requests reused at least one KV block each
