"""Bad constraints over real HTTP: each is a 400 naming the field, and 200 of them sent beside valid
(constrained and free) requests change none of the valid answers' bits."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

import httpx

from tests.server.harness import TINY_NAME, RunningServer

CHAT = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
VALID: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.8, "seed": 5,
                         "logprobs": 2}),
    ("/v1/completions", {"prompt": "Number:", "max_tokens": 8, "temperature": 1.0, "seed": 6, "logprobs": 2,
                         "structured_outputs": {"regex": "[0-9]{1,6}"}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, "temperature": 1.0, "seed": 7,
                              "logprobs": True, "top_logprobs": 2,
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": SCHEMA}}}),
]


def bad_bodies(count: int) -> list[tuple[str, dict[str, Any], str]]:
    """`count` distinct bad bodies (path, body, the param the 400 must name), each grammar distinct so
    none is answered from the compiler's cache."""
    makers: list[Callable[[int], tuple[str, dict[str, Any], str]]] = [
        lambda i: ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": f"(a{i}"}},
                   "structured_outputs.regex"),
        lambda i: ("/v1/completions", {"prompt": "x", "guided_grammar": f'root ::= "a{i}" (('},
                   "guided_grammar"),
        lambda i: ("/v1/chat/completions", {"messages": CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": f"t{i}"}}}},
            "response_format.json_schema.schema"),
        lambda i: ("/v1/chat/completions", {"messages": CHAT, "tools": [TOOL], "tool_choice": {
            "type": "function", "function": {"name": f"g{i}"}}}, "tool_choice"),
        lambda i: ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required", "seed": i},
                   "tool_choice"),
        lambda i: ("/v1/completions", {"prompt": "x", "guided_regex": f"a{i}", "guided_choice": ["b"]},
                   "guided_choice"),
        lambda i: ("/generate", {"text": "x", "sampling_params": {"ebnf": f"root ::= [{i}"}},
                   "sampling_params.ebnf"),
        lambda i: ("/v1/completions", {"prompt": "x", "structured_outputs": {
            "grammar": "root ::= " + " ".join(f'"{k}{i}"' for k in range(30000))}},
            "structured_outputs.grammar"),  # over the compiler's size limit
    ]
    return [makers[i % len(makers)](i) for i in range(count)]


def bits(value: float | None) -> int | None:
    return None if value is None else int(struct.unpack("<I", struct.pack("<f", value))[0])


def signature(document: dict[str, Any]) -> tuple[Any, ...]:
    choice = document["choices"][0]
    if "text" in choice:
        return choice["text"], tuple(map(bits, choice["logprobs"]["token_logprobs"]))
    content = choice["logprobs"]["content"]
    return choice["message"]["content"], tuple((e["token"], bits(e["logprob"])) for e in content)


async def _valid(client: httpx.AsyncClient, base: str, index: int, **change: Any) -> tuple[Any, ...]:
    path, body = VALID[index]
    response = await client.post(base + path, json={"model": TINY_NAME, **body, **change})
    assert response.status_code == 200, response.text[:300]
    return signature(response.json())


async def _bad(client: httpx.AsyncClient, base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post(base + path, json=body)


def test_bad_constraints_are_400s_and_change_no_valid_answer(tiny_server: RunningServer) -> None:
    base = tiny_server.base_url
    cases = bad_bodies(200)

    async def main() -> tuple[list[Any], list[Any], list[httpx.Response], Any]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
            alone = [await _valid(client, base, i) for i in range(len(VALID))]
            valid = [_valid(client, base, i % len(VALID)) for i in range(3 * len(VALID))]
            bad = [_bad(client, base, path, body) for path, body, _ in cases]
            mixed: list[Any] = []
            for k in range(len(valid)):  # valid requests interleaved with the bad ones
                mixed += [valid[k], *bad[k * len(bad) // len(valid) : (k + 1) * len(bad) // len(valid)]]
            results = await asyncio.gather(*mixed)
            reseeded = await _valid(client, base, 2, seed=8)
        beside = [r for r in results if isinstance(r, tuple)]
        answers = [r for r in results if isinstance(r, httpx.Response)]
        return alone, beside, answers, reseeded

    alone, beside, answers, reseeded = asyncio.run(main())
    assert len(answers) == len(cases)
    for (_, _, param), response in zip(cases, answers, strict=True):
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"] == param, response.text[:300]
    assert beside == [alone[i % len(VALID)] for i in range(3 * len(VALID))]
    assert reseeded != alone[2]  # negative control: the signature tells different answers apart
