"""POST /update_weights over real HTTP (uvicorn on loopback, tiny random Llama, bf16, quantization none).

- An optimizer step's weights saved with `Policy.save_weights` and pushed: 200, the fingerprint changes in
  /v1/models and in responses (official `openai` client), and the next sampled logprobs equal the
  policy's bit for bit and differ from the pre-update ones.
- A request in flight when the update arrives finishes on the old weights with the old fingerprint; the
  update answers after it; a request sent while the update waits reports the fingerprint of the weights
  it ran on.
- A bad path, unreadable files, mismatched shapes or a foreign load_format: 400 naming the field, and
  the same request afterwards gives the same bits and fingerprint as before.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.rl import Policy
from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

LONG = 32  # tokens of the in-flight stream
STEP_SLEEP = 0.05  # seconds each engine step sleeps on the slow server
PROMPTS = [[5, 17, 42, 99, 7, 250, 31], [12, 8, 8, 140, 201, 3, 66, 77, 88, 9, 10, 60, 61, 62, 63, 64, 65]]


def config_for(tiny: TinyModel) -> EngineConfig:
    return tiny_config(tiny, dtype="bfloat16", quantization="none", selfcheck=False)


@pytest.fixture()
def server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    with thread_server(config_for(tiny_llama_dir), ServerSettings(served_model_name=TINY_NAME)) as running:
        yield running


def stream_body(max_tokens: int) -> dict[str, Any]:
    """A /generate body for PROMPTS (seeded, T=1.0; one prompt when streamed)."""
    return {
        "input_ids": PROMPTS[0],
        "sampling_params": {
            "temperature": 1.0,
            "sampling_seed": 7,
            "max_new_tokens": max_tokens,
            "ignore_eos": True,
        },
        "return_logprob": True,
        "stream": True,
    }


def generate(server: RunningServer, max_tokens: int = 8, stream: bool = False) -> list[dict[str, Any]]:
    """POST /generate of PROMPTS: the items, or the last event of a stream of the first prompt."""
    body = {**stream_body(max_tokens), "input_ids": PROMPTS[0] if stream else PROMPTS, "stream": stream}
    if not stream:
        response = httpx.post(server.base_url + "/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return list(response.json())
    last: dict[str, Any] = {}
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                last = json.loads(line[len("data: ") :])
    return [last]


def logprob_bits(item: dict[str, Any]) -> list[int]:
    values = [entry[0] for entry in item["meta_info"]["output_token_logprobs"]]
    return torch.tensor(values, dtype=torch.float32).view(torch.int32).tolist()


def policy_bits(policy: Policy, prompts: list[list[int]], items: list[dict[str, Any]]) -> list[list[int]]:
    with torch.no_grad():
        values = policy.completion_logprobs(prompts, [item["output_ids"] for item in items])
    return [v.view(torch.int32).tolist() for v in values]


def update(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/update_weights", json=body, timeout=120)


def stepped_weights(policy: Policy, items: list[dict[str, Any]], directory: Path) -> None:
    """One Adam step on -sum(logprobs) of the sampled completions, saved for /update_weights."""
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    values = policy.completion_logprobs(PROMPTS, [item["output_ids"] for item in items])
    loss = -torch.cat(values).sum()
    loss.backward()
    optimizer.step()
    policy.save_weights(directory)


def test_update_over_http_keeps_parity_and_changes_the_fingerprint(
    server: RunningServer, tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    policy = Policy.from_config(config_for(tiny_llama_dir))
    before = generate(server)
    assert [logprob_bits(item) for item in before] == policy_bits(policy, PROMPTS, before)
    old = before[0]["meta_info"]["system_fingerprint"]
    stepped_weights(policy, before, tmp_path)
    response = update(server, {"model_path": str(tmp_path), "load_format": "safetensors"})
    assert response.status_code == 200, response.text
    new = response.json()["system_fingerprint"]
    assert new != old and response.json()["success"] is True
    after = generate(server)
    assert {item["meta_info"]["system_fingerprint"] for item in after} == {new}
    assert [logprob_bits(item) for item in after] == policy_bits(policy, PROMPTS, after)
    assert [logprob_bits(item) for item in after] != [logprob_bits(item) for item in before]
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    completion = client.completions.create(model=TINY_NAME, prompt="Hello", max_tokens=2, seed=1)
    assert completion.system_fingerprint == new
    assert client.models.list().data[0].model_extra["system_fingerprint"] == new  # type: ignore[index]


@pytest.fixture()
def slow_server(tiny_llama_dir: TinyModel) -> Iterator[RunningServer]:
    """Every engine step sleeps STEP_SLEEP first: a LONG-token stream takes at least 1.6 s."""
    config = config_for(tiny_llama_dir)
    slow = FaultInjection(step_sleep=STEP_SLEEP)
    settings = ServerSettings(served_model_name=TINY_NAME)
    with thread_server(config, settings, engine_factory=lambda: Engine(config, faults=slow)) as running:
        yield running


def test_in_flight_requests_finish_on_the_old_weights(
    slow_server: RunningServer, tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    server = slow_server
    policy = Policy.from_config(config_for(tiny_llama_dir))
    reference = generate(server, max_tokens=LONG, stream=True)[0]  # old weights, nothing else running
    stepped_weights(policy, generate(server), tmp_path)
    results: dict[str, Any] = {}
    pusher = threading.Thread(
        target=lambda: results.update(update=update(server, {"model_path": str(tmp_path)}))
    )
    latecomer = threading.Thread(target=lambda: results.update(late=generate(server)))
    body = stream_body(LONG)
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as response:
        events = (json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {"))
        last = next(events)  # the request is in flight: its first tokens arrived
        pusher.start()
        time.sleep(0.3)  # the update is waiting for this stream
        latecomer.start()
        time.sleep(0.3)
        assert "update" not in results  # it cannot finish before the stream does
        last = list(events)[-1]
    pusher.join(timeout=120)
    latecomer.join(timeout=120)
    assert results["update"].status_code == 200, results["update"].text
    new = results["update"].json()["system_fingerprint"]
    old = reference["meta_info"]["system_fingerprint"]
    assert last["meta_info"]["system_fingerprint"] == old
    assert logprob_bits(last) == logprob_bits(reference)  # finished on the old weights
    # the latecomer ran on one set of weights and says which (normally the new ones: it waited)
    late_items = results["late"]
    fingerprint = late_items[0]["meta_info"]["system_fingerprint"]
    assert fingerprint in (old, new)
    if fingerprint == new:
        assert [logprob_bits(item) for item in late_items] == policy_bits(policy, PROMPTS, late_items)
    assert {item["meta_info"]["system_fingerprint"] for item in generate(server)} == {new}


def test_bad_updates_are_400_and_the_old_weights_keep_serving(
    server: RunningServer, tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    before = generate(server)
    weights = Policy.from_config(config_for(tiny_llama_dir)).engine_weights()
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    wrong = {**weights, "model.norm.weight": torch.ones(3, dtype=torch.bfloat16)}
    save_file(wrong, str(mismatched / "model.safetensors"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    cases = [
        ({"model_path": str(tmp_path / "absent")}, "model_path", "no such directory"),
        ({"model_path": str(corrupt)}, "model_path", "no readable safetensors"),
        ({"model_path": str(mismatched)}, "model_path", "shape"),
        ({"model_path": str(mismatched), "load_format": "pt"}, "load_format", "not read"),
        ({"path": str(mismatched)}, None, ""),
    ]
    for body, param, needle in cases:
        response = update(server, body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert needle in error["message"] and str(tmp_path) not in error["message"]
        if param is not None:
            assert error["param"] == param
    after = generate(server)
    assert [item["meta_info"]["system_fingerprint"] for item in after] == [
        item["meta_info"]["system_fingerprint"] for item in before
    ]
    assert [logprob_bits(item) for item in after] == [logprob_bits(item) for item in before]
