"""Bad inputs get a 4xx with an OpenAI error body, never a 500, and the server keeps serving."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.harness import TINY_NAME, RunningServer

CHAT = [{"role": "user", "content": "Hi"}]
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 60  # far beyond the tiny model's 512 tokens

CASES: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, JSON body or raw bytes, status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("not utf-8", "/v1/chat/completions", b"\xff\xfe", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("string max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (
        "string temperature",
        "/v1/chat/completions",
        {"messages": CHAT, "temperature": "hot"},
        400,
        "temperature",
    ),
    ("messages not a list", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("n = 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    (
        "negative max_completion_tokens",
        "/v1/chat/completions",
        {"messages": CHAT, "max_completion_tokens": -1},
        400,
        "max_tokens",
    ),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("empty stop", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "x"}, 404, "model"),
    ("too-long prompt", "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 4}, 400, "prompt"),
    ("too-long prompt ids", "/v1/completions", {"prompt": [5] * 600, "max_tokens": 4}, 400, "prompt"),
    (
        "prompt + max_tokens over context",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 100000},
        400,
        "max_tokens",
    ),
    ("token id outside vocab", "/v1/completions", {"prompt": [0, 99999]}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "tool_choice names an unknown function",
        "/v1/chat/completions",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
         "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    ("tool_choice without tools", "/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("bad tool name", "/v1/chat/completions",
     {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name"),
    ("json_schema without its object", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema"),
    ("invalid json schema", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "frobnicate"}}}}, 400, "response_format.json_schema.schema"),
    ("unsupported schema feature", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"json": {"type": "object", "patternProperties": {"[": {}}}}}, 400,
     "structured_outputs.json"),
    ("invalid regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(ab"}}, 400,
     "structured_outputs.regex"),
    ("invalid grammar", "/v1/completions", {"prompt": "x", "guided_grammar": "root ::= (("}, 400,
     "guided_grammar"),
    ("empty choice", "/v1/completions", {"prompt": "x", "guided_choice": []}, 400, "guided_choice"),
    ("two constraints", "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice"),
    ("two constraints in structured_outputs", "/v1/chat/completions",
     {"messages": CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "structured_outputs"),
    ("tools and response_format", "/v1/chat/completions",
     {"messages": CHAT, "response_format": {"type": "json_object"}, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("generate bad regex", "/generate", {"text": "x", "sampling_params": {"regex": "[a-"}}, 400,
     "sampling_params.regex"),
    ("generate bad json_schema text", "/generate", {"text": "x", "sampling_params": {"json_schema": "{"}},
     400, "sampling_params.json_schema"),
    ("generate two constraints", "/generate",
     {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, 400, "sampling_params.ebnf"),
    ("bad tool call in history", "/v1/chat/completions",
     {"messages": [*CHAT, {"role": "assistant", "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments"),
    (
        "image part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ("audio", "/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "x"}}, 400, "audio"),
    ("logit_bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("generate without text", "/generate", {"sampling_params": {}}, 400, "text"),
    (
        "generate bad seed type",
        "/generate",
        {"text": "x", "sampling_params": {"sampling_seed": "1"}},
        400,
        "sampling_params.sampling_seed",
    ),
]


def post(server: RunningServer, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            server.base_url + path, content=body, headers={"Content-Type": "application/json"}, timeout=60
        )
    return httpx.post(server.base_url + path, json=body, timeout=60)


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(("name", "path", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_4xx_openai_error(
    tiny_server: RunningServer, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    assert_openai_error(post(tiny_server, path, body), status, param)


def test_unknown_path_and_method_are_openai_errors(tiny_server: RunningServer) -> None:
    assert_openai_error(httpx.get(tiny_server.base_url + "/v1/nothing"), 404, None)
    assert_openai_error(httpx.get(tiny_server.v1 + "/completions"), 405, None)


def test_streamed_bad_input_fails_before_the_stream(tiny_server: RunningServer) -> None:
    response = post(tiny_server, "/v1/completions", {"prompt": [5] * 600, "stream": True})
    assert_openai_error(response, 400, "prompt")


def test_server_keeps_serving_after_bad_inputs(tiny_server: RunningServer) -> None:
    for _, path, body, _, _ in CASES:
        post(tiny_server, path, body)
    ok = post(tiny_server, "/v1/chat/completions", {"model": TINY_NAME, "messages": CHAT, "max_tokens": 3})
    assert ok.status_code == 200
    metrics = httpx.get(tiny_server.base_url + "/metrics").text
    assert 'status="500"' not in metrics
    assert 'status="422"' not in metrics
