"""Tool calls parsed from an answer, whole and streamed: at every split of the text, the streamed deltas
join to exactly the non-streamed message."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deterministic_inference.server.tool_parser import ParsedCall, ToolCallStream, message_fields, parse_calls
from deterministic_inference.server.tools import render_block

CALL = render_block("get_weather", {"city": "Paris"})
CALL2 = render_block("now", {})
TEXTS = [
    "Just text, no call.",
    CALL,
    CALL + "\n" + CALL2,
    "Let me look. " + CALL,
    CALL + "\nDone.",
    "a <tool b <tool_cal c",
    "<tool_call>\nnot json</tool_call> after",
    CALL[:-20],  # cut short (finish_reason length)
    "<tool_call>\n{\"name\": \"get_wea",  # cut inside the name: stays text
    render_block("f", {"s": "}</tool_call"}),  # the close tag inside a string is not the end... until it is
]


def joined(deltas: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", list[list[str]]()
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls.append([call["function"]["name"], ""])
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [(name, args) for name, args in calls]


def test_whole_answers() -> None:
    parsed = parse_calls("Let me look. " + CALL + "\n" + CALL2, True)
    assert parsed.content == "Let me look. "
    assert parsed.calls == (ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("now", "{}"))
    assert json.loads(parsed.calls[0].arguments) == {"city": "Paris"}
    assert parse_calls("plain", True).calls == ()
    first = parse_calls(CALL + "\n" + CALL2, True, max_calls=1)
    assert first.calls == (ParsedCall("get_weather", '{"city": "Paris"}'),)
    cut = parse_calls(CALL[:-20], True)
    assert cut.calls[0].name == "get_weather" and '{"city": "Paris"}'.startswith(cut.calls[0].arguments)


def test_message_fields() -> None:
    only_calls = message_fields(parse_calls(CALL, True), ["call_a"])
    assert only_calls["content"] is None
    assert only_calls["tool_calls"] == [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]
    assert message_fields(parse_calls("hi", True), []) == {"content": "hi", "tool_calls": None}


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("max_calls", [None, 1])
def test_streamed_deltas_join_to_the_whole_answer(text: str, max_calls: int | None) -> None:
    final = parse_calls(text, True, max_calls)
    for step in (1, 2, 3, 7):  # every chunking of the text
        stream = ToolCallStream(max_calls)
        deltas: list[dict[str, Any]] = []
        for start in range(0, len(text), step):
            deltas += stream.advance(text[start : start + step], False)
        deltas += stream.advance("", True)
        content, calls = joined(deltas)
        assert content == final.content
        assert calls == [(c.name, c.arguments) for c in final.calls]
        assert stream.finish() == final
