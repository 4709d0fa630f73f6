"""Llama 3.x JSON tool calls: the grammar (checked with llguidance on a byte-level vocabulary), the
parser, streamed deltas joining to the whole answer at every split, and the format's detection."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deterministic_inference.server.tool_llama import parse_llama_calls
from deterministic_inference.server.tool_parser import ParsedCall, ToolCallStream
from deterministic_inference.server.tools import parse_tools, tool_style
from tests.server.grammar_check import lark_accepts
from tests.server.test_tool_parser import joined

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}
NOW = {"type": "function", "function": {"name": "now"}}


def call(name: str, parameters: dict[str, Any]) -> str:
    return json.dumps({"name": name, "parameters": parameters})


CALL = call("get_weather", {"city": "Paris"})
TEXTS = [
    "plain text",
    CALL,
    CALL + "; " + call("now", {}),
    "Sure: " + CALL,
    CALL[:-7],  # cut short
    '{"name": "get_wea',  # cut inside the name
    '{"name": 5} is not a call',
    call("f", {"s": "}; {"}),
]


def grammar(choice: Any, parallel: bool = True) -> str:
    spec = parse_tools([WEATHER, NOW], choice, parallel, "llama3_json").grammar()
    assert spec is not None
    return spec.source


def test_grammar() -> None:
    required = grammar("required")
    assert lark_accepts(required, CALL) and lark_accepts(required, CALL + "; " + call("now", {}))
    assert not lark_accepts(required, call("get_weather", {"town": "Paris"}))
    assert not lark_accepts(required, call("other", {}))
    assert not lark_accepts(grammar("required", parallel=False), CALL + "; " + CALL)
    assert not lark_accepts(grammar({"type": "function", "function": {"name": "now"}}), CALL)
    auto = grammar("auto")
    assert lark_accepts(auto, "No call needed.") and lark_accepts(auto, "Sure: " + CALL)
    assert not lark_accepts(auto, "Sure: " + call("other", {}))


def test_parse() -> None:
    parsed = parse_llama_calls("Sure: " + CALL + "; " + call("now", {}), True)
    assert parsed.content == "Sure: "
    assert parsed.calls == (ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("now", "{}"))
    assert parse_llama_calls('{"name": 5}', True).calls == ()
    assert parse_llama_calls('{"name": 5}', True).content == '{"name": 5}'


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streamed_deltas_join_to_the_whole_answer(text: str, max_calls: int | None) -> None:
    final = parse_llama_calls(text, True, max_calls)
    for step in (1, 2, 5):
        stream = ToolCallStream(max_calls, parse_llama_calls)
        deltas: list[dict[str, Any]] = []
        for start in range(0, len(text), step):
            deltas += stream.advance(text[start : start + step], False)
        deltas += stream.advance("", True)
        content, calls = joined(deltas)
        assert content == final.content
        assert calls == [(c.name, c.arguments) for c in final.calls]


def test_style_detection() -> None:
    llama_like = '{% if tools %}Respond with {"name": function name, "parameters": dictionary}{% endif %}'
    hermes_like = "{% if tools %}<tool_call>{% endif %}"
    assert tool_style(llama_like) == "llama3_json"
    assert tool_style(hermes_like) == "hermes"
    assert tool_style("{{ messages }}") == "hermes" and tool_style(None) == "hermes"
