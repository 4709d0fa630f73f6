"""Tool validation, tool-choice resolution, the tool-call grammar (checked with llguidance on a byte-level
vocabulary) and the generic history format."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.server.tools import generic_messages, parse_tools, render_block
from tests.server.grammar_check import lark_accepts

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOARGS = {"type": "function", "function": {"name": "now"}}
CALL = render_block("get_weather", {"city": "Paris"})
CALL_NOW = render_block("now", {})


def grammar(tool_choice: Any, parallel: bool = True) -> str:
    spec = parse_tools([WEATHER, NOARGS], tool_choice, parallel).grammar()
    assert spec is not None and spec.kind == "lark"
    return spec.source


def test_required_accepts_only_valid_calls() -> None:
    source = grammar("required")
    assert lark_accepts(source, CALL) and lark_accepts(source, CALL_NOW)
    assert lark_accepts(source, CALL + "\n" + CALL_NOW)  # parallel calls
    assert not lark_accepts(source, "hello")
    assert not lark_accepts(source, render_block("unknown", {}))
    assert not lark_accepts(source, render_block("get_weather", {"town": "Paris"}))  # schema violated
    assert not lark_accepts(source, render_block("get_weather", {"city": 3}))


def test_parallel_false_allows_one_call() -> None:
    source = grammar("required", parallel=False)
    assert lark_accepts(source, CALL)
    assert not lark_accepts(source, CALL + "\n" + CALL)


def test_named_function_allows_only_that_one() -> None:
    source = grammar({"type": "function", "function": {"name": "now"}})
    assert lark_accepts(source, CALL_NOW)
    assert not lark_accepts(source, CALL)


def test_auto_allows_text_or_valid_calls() -> None:
    source = grammar("auto")
    assert lark_accepts(source, "The weather is fine.")
    assert lark_accepts(source, CALL)
    assert lark_accepts(source, "Let me check. " + CALL)
    assert not lark_accepts(source, "Let me check. " + render_block("unknown", {}))


def test_none_and_no_tools_have_no_grammar() -> None:
    assert parse_tools([WEATHER], "none", None).grammar() is None
    assert parse_tools(None, None, None).grammar() is None
    assert parse_tools([WEATHER], None, None).choice == "auto"


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (None, "required", "tool_choice"),
        (None, "auto", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "bad name"}}], "auto", "tools[0].function.name"),
        ([{"type": "retrieval"}], "auto", "tools[0].type"),
        ([{"type": "function"}], "auto", "tools[0].function"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "auto",
         "tools[0].function.parameters"),
        ("x", "auto", "tools"),
    ],
)
def test_bad_tools_name_the_field(tools: Any, choice: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        parse_tools(tools, choice, None)
    assert caught.value.param == param and str(caught.value).startswith(param)


def test_generic_history_format() -> None:
    plan = parse_tools([WEATHER], "auto", None)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    out = generic_messages(messages, plan)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert json.dumps(WEATHER) in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == CALL
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>"
    with_system = generic_messages([{"role": "system", "content": "Be brief."}, messages[0]], plan)
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2
