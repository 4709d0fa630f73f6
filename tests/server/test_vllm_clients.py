"""What vLLM's clients send: several prompts in one /v1/completions request (official `openai` client),
vLLM's `prompt_logprobs` and `return_token_ids` extras, and POST /reset_prefix_cache."""

from __future__ import annotations

import json
import struct
from typing import Any

import httpx
import openai

from tests.server.harness import TINY_NAME, RunningServer

PROMPTS = ["Hello, world", "The quick brown fox", "def add(a, b):"]


def bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def complete(server: RunningServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(server.v1 + "/completions", json={"model": TINY_NAME, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_list_of_prompts_in_one_request_equals_single_requests(tiny_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0)
    batch = client.completions.create(model=TINY_NAME, prompt=PROMPTS, max_tokens=6, temperature=0.0,
                                      logprobs=2)
    assert [choice.index for choice in batch.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, batch.choices, strict=True):
        alone = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=6, temperature=0.0,
                                          logprobs=2).choices[0]
        assert choice.text == alone.text
        assert choice.logprobs is not None and alone.logprobs is not None
        values = choice.logprobs.token_logprobs or []
        assert [bits(v) for v in values] == [bits(v) for v in alone.logprobs.token_logprobs or []]


def test_prompt_logprobs_and_token_ids_in_vllm_shapes(tiny_server: RunningServer) -> None:
    data = complete(tiny_server, prompt=PROMPTS[:2], max_tokens=4, temperature=0.0, prompt_logprobs=2,
                    return_token_ids=True, logprobs=0)
    for choice in data["choices"]:
        ids, entries = choice["prompt_token_ids"], choice["prompt_logprobs"]
        assert len(entries) == len(ids) and entries[0] is None
        for token, entry in zip(ids[1:], entries[1:], strict=True):
            assert str(token) in entry and 2 <= len(entry) <= 3
            assert all(set(item) == {"logprob", "rank", "decoded_token"} for item in entry.values())
            ranked = sorted(item["rank"] for key, item in entry.items() if key != str(token) or item["rank"])
            assert ranked[:2] == [1, 2]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 4
    # the same values as echo + logprobs (one computation, two formats)
    echoed = complete(tiny_server, prompt=PROMPTS[0], max_tokens=1, temperature=0.0, echo=True, logprobs=0)
    first = data["choices"][0]
    expected = echoed["choices"][0]["logprobs"]["token_logprobs"][1 : len(first["prompt_token_ids"])]
    pairs = zip(first["prompt_token_ids"][1:], first["prompt_logprobs"][1:], strict=True)
    got = [entry[str(token)]["logprob"] for token, entry in pairs]
    assert [bits(v) for v in got] == [bits(v) for v in expected]


def test_decoded_logprobs_equal_prompt_logprobs_of_the_sequence(tiny_server: RunningServer) -> None:
    first = complete(tiny_server, prompt=PROMPTS[1], max_tokens=8, temperature=0.0, logprobs=0,
                     return_token_ids=True)["choices"][0]
    sequence = first["prompt_token_ids"] + first["token_ids"]
    scored = complete(tiny_server, prompt=sequence, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    entries = scored["choices"][0]["prompt_logprobs"][len(first["prompt_token_ids"]):]
    values = [entry[str(token)]["logprob"] for token, entry in zip(first["token_ids"], entries, strict=True)]
    assert [bits(v) for v in values] == [bits(v) for v in first["logprobs"]["token_logprobs"]]


def test_stream_carries_prompt_fields_once_and_token_ids(tiny_server: RunningServer) -> None:
    body = {"model": TINY_NAME, "prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0.0,
            "prompt_logprobs": 1, "return_token_ids": True, "stream": True}
    with httpx.stream("POST", tiny_server.v1 + "/completions", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [chunk["choices"][0] for chunk in chunks]
    assert "prompt_logprobs" in choices[0] and all("prompt_logprobs" not in c for c in choices[1:])
    whole = complete(tiny_server, **{**body, "stream": False})["choices"][0]
    assert choices[0]["prompt_logprobs"] == whole["prompt_logprobs"]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]


def test_reset_prefix_cache_empties_the_cache(tiny_server: RunningServer) -> None:
    prompt = "A prompt long enough to fill a couple of KV blocks: " + "reproducible " * 12
    complete(tiny_server, prompt=prompt, max_tokens=1, temperature=0.0)
    warm = complete(tiny_server, prompt=prompt, max_tokens=1, temperature=0.0)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    reset = httpx.post(tiny_server.base_url + "/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and reset.json()["flushed_blocks"] > 0
    cold = complete(tiny_server, prompt=prompt, max_tokens=1, temperature=0.0)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]
