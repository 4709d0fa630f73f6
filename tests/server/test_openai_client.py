"""The official `openai` client (sync, async, streaming) against a real uvicorn server on loopback."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionTokenLogprob

from deterministic_inference.engine.sampling_params import derive_choice_seed
from tests.server.harness import TINY_NAME, RunningServer

MODEL = TINY_NAME
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Hello, world! Tell me about the quick brown fox."}
]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def bits(value: float) -> int:
    """float32 bits of a JSON logprob (the server writes float32 values exactly)."""
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def chat_key(message_text: str | None, logprobs: Any) -> tuple[Any, ...]:
    content = logprobs.content if logprobs is not None else []
    return (
        message_text,
        tuple(
            (e.token, bits(e.logprob), tuple((t.token, bits(t.logprob)) for t in e.top_logprobs))
            for e in content
        ),
    )


def test_models_lists_the_fingerprint(tiny_server: RunningServer) -> None:
    models = client(tiny_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    fingerprint = models.data[0].model_extra["system_fingerprint"]  # type: ignore[index]
    assert fingerprint.startswith("detinf-")
    health = httpx.get(tiny_server.base_url + "/healthz").json()
    assert health == {"status": "ok", "system_fingerprint": fingerprint}


def test_sync_completion_and_chat(tiny_server: RunningServer) -> None:
    api = client(tiny_server)
    completion = api.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0
    )
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage is not None and completion.usage.completion_tokens <= 5
    assert completion.system_fingerprint and completion.system_fingerprint.startswith("detinf-")
    chat = api.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.system_fingerprint == completion.system_fingerprint


def test_async_client_concurrency_100_at_10_is_one_output(tiny_server: RunningServer) -> None:
    """100 identical requests, 10 in flight at a time: one unique output (text + logprob bits)."""

    async def main() -> set[tuple[Any, ...]]:
        api = openai.AsyncOpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0, timeout=120)
        semaphore = asyncio.Semaphore(10)

        async def one() -> tuple[Any, ...]:
            async with semaphore:
                r = await api.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    max_tokens=4,
                    temperature=0,
                    logprobs=True,
                    top_logprobs=2,
                )
                return chat_key(r.choices[0].message.content, r.choices[0].logprobs)

        try:
            return set(await asyncio.gather(*(one() for _ in range(100))))
        finally:
            await api.close()

    assert len(asyncio.run(main())) == 1


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_stream_equals_non_stream(tiny_server: RunningServer, temperature: float) -> None:
    api = client(tiny_server)
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=temperature,
        seed=7,
        logprobs=True,
        top_logprobs=3,
    )
    full = api.chat.completions.create(**kwargs)
    text, entries, finish, usage = "", list[ChatCompletionTokenLogprob](), None, None
    for chunk in api.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        assert chunk.system_fingerprint == full.system_fingerprint
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
            finish = choice.finish_reason or finish
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    streamed = chat_key(text, type("L", (), {"content": entries})())
    assert streamed == chat_key(full.choices[0].message.content, full.choices[0].logprobs)
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_equals_non_stream_with_echo(tiny_server: RunningServer) -> None:
    api = client(tiny_server)
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt="Hello, world!", max_tokens=10, temperature=0.7, seed=3, logprobs=2, echo=True
    )
    full = api.completions.create(**kwargs)
    text = ""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for chunk in api.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens or []
                values += choice.logprobs.token_logprobs or []
                tops += choice.logprobs.top_logprobs or []
                offsets += choice.logprobs.text_offset or []
    reference = full.choices[0].logprobs
    assert reference is not None
    assert text == full.choices[0].text
    assert tokens == reference.tokens
    assert [None if v is None else bits(v) for v in values] == [
        None if v is None else bits(v) for v in reference.token_logprobs or []
    ]
    assert tops == reference.top_logprobs
    assert offsets == reference.text_offset
    assert reference.token_logprobs is not None and reference.token_logprobs[0] is None  # first prompt token


def test_n3_choices_reproducible_and_equal_single_requests(tiny_server: RunningServer) -> None:
    api = client(tiny_server)
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=11, logprobs=True
    )
    first = api.chat.completions.create(**kwargs, n=3)
    second = api.chat.completions.create(**kwargs, n=3)
    keys = [chat_key(c.message.content, c.logprobs) for c in sorted(first.choices, key=lambda c: c.index)]
    assert keys == [
        chat_key(c.message.content, c.logprobs) for c in sorted(second.choices, key=lambda c: c.index)
    ]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(keys)) > 1  # different derived seeds
    single_kwargs = {**kwargs, "seed": derive_choice_seed(11, 2)}
    single = api.chat.completions.create(**single_kwargs)
    assert chat_key(single.choices[0].message.content, single.choices[0].logprobs) == keys[2]


def test_multiple_prompts_and_token_id_prompts(tiny_server: RunningServer) -> None:
    api = client(tiny_server)
    texts = api.completions.create(
        model=MODEL, prompt=["Hello", "Numbers 012"], max_tokens=4, temperature=0, n=2
    )
    assert sorted(c.index for c in texts.choices) == [0, 1, 2, 3]
    ids = httpx.post(
        tiny_server.v1 + "/completions", json={"prompt": [0, 40, 41, 42], "max_tokens": 3}
    ).json()
    assert ids["usage"]["prompt_tokens"] == 4


def test_generate_endpoint_matches_completions(tiny_server: RunningServer) -> None:
    """SGLang-style /generate with sampling_seed == /v1/completions with the same seed and ids."""
    body = {
        "input_ids": [0, 50, 60, 70],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 5},
    }
    native = httpx.post(
        tiny_server.base_url + "/generate", json={**body, "return_logprob": True}, timeout=60
    ).json()
    again = httpx.post(
        tiny_server.base_url + "/generate", json={**body, "return_logprob": True}, timeout=60
    ).json()
    assert native == {**again, "meta_info": {**again["meta_info"], "id": native["meta_info"]["id"]}}
    openai_body = {"prompt": [0, 50, 60, 70], "max_tokens": 6, "temperature": 0.8, "seed": 5, "logprobs": 0}
    completion = httpx.post(tiny_server.v1 + "/completions", json=openai_body, timeout=60).json()
    assert native["text"] == completion["choices"][0]["text"]
    native_values = [bits(v) for v, _, _ in native["meta_info"]["output_token_logprobs"]]
    assert native_values == [bits(v) for v in completion["choices"][0]["logprobs"]["token_logprobs"]]
    streamed = []
    with httpx.stream(
        "POST", tiny_server.base_url + "/generate", json={**body, "stream": True}, timeout=60
    ) as r:
        streamed = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert streamed[-1] == "[DONE]"
    assert json.loads(streamed[-2])["output_ids"] == native["output_ids"]


def test_stop_string_stream_equals_non_stream(tiny_server: RunningServer) -> None:
    """Text held back while a stop string may be forming never leaks into the stream."""
    api = client(tiny_server)
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, stop=["oo"])
    full = api.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "stop" and "oo" not in full.choices[0].text
    assert full.choices[0].model_extra["stop_reason"] == "oo"  # type: ignore[index]
    streamed = "".join(c.choices[0].text for c in api.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == full.choices[0].text


def test_lm_eval_style_scoring_request(tiny_server: RunningServer) -> None:
    """lm-eval-harness `local-completions` loglikelihood: token-id prompts, echo, logprobs=1, max_tokens=1."""
    body = {
        "model": MODEL,
        "prompt": [[0, 40, 41, 42], [0, 50]],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
    }
    out = httpx.post(tiny_server.v1 + "/completions", json=body, timeout=60).json()
    for choice, length in zip(out["choices"], (4, 2), strict=True):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == length + 1
        assert logprobs["token_logprobs"][0] is None
        for value, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True):
            assert value <= max(top.values())  # the chosen token is never above the best alternative
