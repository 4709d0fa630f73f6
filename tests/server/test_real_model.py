"""Slow: `detinf serve` with the embedded default model (SmolLM2-135M-Instruct), as the README starts it,
driven by the official openai client and by `detinf audit`."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionTokenLogprob

from deterministic_inference.cli.main import build_parser, main
from tests.server.harness import RunningServer, subprocess_server

pytestmark = pytest.mark.slow
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France? Answer in one word."}
]


def test_serve_defaults_match_the_readme() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    assert args.no_batch_invariant is False and args.no_prefix_cache is False


@pytest.fixture(scope="module")
def real_server() -> Iterator[RunningServer]:
    with subprocess_server(["--num-kv-blocks", "1024", "--threads", "1", "--log-level", "warning"]) as (
        server,
        process,
    ):
        yield server
    assert process.returncode == 0  # SIGTERM at exit drained and exited 0


def bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def key(text: str | None, content: list[Any]) -> tuple[Any, ...]:
    return text, tuple(
        (e.token, bits(e.logprob), tuple(bits(t.logprob) for t in e.top_logprobs)) for e in content
    )


def test_chat_answers_and_stream_equals_non_stream(real_server: RunningServer) -> None:
    api = openai.OpenAI(base_url=real_server.v1, api_key="unused", max_retries=0, timeout=300)
    model = api.models.list().data[0].id
    answer = api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or "")
    kwargs: dict[str, Any] = dict(
        model=model, messages=QUESTION, max_tokens=12, temperature=0.8, seed=42, logprobs=True, top_logprobs=2
    )
    full = api.chat.completions.create(**kwargs)
    text, content = "", list[ChatCompletionTokenLogprob]()
    for chunk in api.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            content += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    assert full.choices[0].logprobs is not None and full.choices[0].logprobs.content is not None
    assert key(text, content) == key(full.choices[0].message.content, full.choices[0].logprobs.content)


def test_concurrent_requests_are_one_output(real_server: RunningServer) -> None:
    async def run() -> set[tuple[Any, ...]]:
        api = openai.AsyncOpenAI(base_url=real_server.v1, api_key="unused", max_retries=0, timeout=300)
        model = (await api.models.list()).data[0].id
        semaphore = asyncio.Semaphore(5)

        async def one() -> tuple[Any, ...]:
            async with semaphore:
                r = await api.chat.completions.create(
                    model=model,
                    messages=QUESTION,
                    max_tokens=6,
                    temperature=0,
                    logprobs=True,
                )
                return key(r.choices[0].message.content, r.choices[0].logprobs.content or [])  # type: ignore[union-attr]

        try:
            return set(await asyncio.gather(*(one() for _ in range(20))))
        finally:
            await api.close()

    assert len(asyncio.run(run())) == 1


@pytest.mark.parametrize("mode", ["mixed", "radix"])
def test_audit_passes_on_the_real_model(real_server: RunningServer, mode: str, tmp_path: Path) -> None:
    report = tmp_path / "audit.json"
    small = ["--n-trials", "1", "--concurrency", "4", "--max-tokens", "6", "--max-prompt-tokens", "64"]
    assert (
        main(["audit", "--base-url", real_server.base_url, "--mode", mode, *small, "--json", str(report)])
        == 0
    )
    assert json.loads(report.read_text())["passed"] is True
