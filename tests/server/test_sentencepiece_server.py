"""A SentencePiece GGUF model served over real HTTP to the official `openai` client: streamed text
equals the full response, offsets count the prefix space, the chat template comes from the file."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import accumulate

import openai
import pytest

from deterministic_inference.model.loader import load_model
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.server.app import ServerSettings
from tests.server.harness import TINY_NAME, RunningServer, thread_server, tiny_config
from tests.tiny_models import TinyModel

PROMPTS = ["Hello world", "  two spaces, 你好 and 🦀\n", "<start_of_turn>user\nhi"]


@pytest.fixture(scope="module")
def spm_server(tiny_spm_gguf: TinyModel) -> Iterator[RunningServer]:
    with thread_server(tiny_config(tiny_spm_gguf), ServerSettings(served_model_name=TINY_NAME)) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(tiny_spm_gguf: TinyModel) -> Tokenizer:
    return load_model(str(tiny_spm_gguf.path)).tokenizer


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_stream_equals_response(
    spm_server: RunningServer, tokenizer: Tokenizer, prompt: str
) -> None:
    api = _client(spm_server)
    params = dict(model=TINY_NAME, prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
    full = api.completions.create(**params, logprobs=1, extra_body={"return_token_ids": True})  # type: ignore[call-overload]
    choice = full.choices[0]
    ids = choice.model_extra["token_ids"]  # type: ignore[index]
    assert choice.text == tokenizer.decode(ids, continuation=True)
    chunks = [c.choices[0].text for c in api.completions.create(**params, stream=True)]  # type: ignore[call-overload]
    assert "".join(chunks) == choice.text
    assert all(not chunk.endswith("\ufffd") for chunk in chunks[:-1])  # no character split across chunks
    # offsets advance by each token's text as a continuation, the prefix space included
    lengths = [len(tokenizer.decode([i], continuation=True)) for i in ids]
    assert choice.logprobs.text_offset == list(accumulate([0, *lengths[:-1]]))
    assert full.choices[0].model_extra["prompt_token_ids"] == tokenizer.encode(prompt)  # type: ignore[index]


def test_chat_uses_the_files_template(spm_server: RunningServer, tokenizer: Tokenizer) -> None:
    api = _client(spm_server)
    messages = [{"role": "user", "content": "Hi 你好"}]
    params = dict(model=TINY_NAME, messages=messages, max_tokens=12, temperature=1.0, seed=3)
    full = api.chat.completions.create(**params)  # type: ignore[call-overload]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered.startswith("<s><start_of_turn>user\nHi 你好<end_of_turn>")
    assert full.usage.prompt_tokens == len(tokenizer.encode(rendered))
    stream = api.chat.completions.create(**params, stream=True)  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full.choices[0].message.content
