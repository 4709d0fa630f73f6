"""Tool history reaches the chat template: as it is for a template that renders tools (arguments as
objects), in the generic format for one that does not; malformed history is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.model.chat_template import ChatTemplate
from deterministic_inference.server.chat_history import template_input
from deterministic_inference.server.tools import parse_tools

# A small tool-aware template in the Hermes style (written for this test): tools in the system turn,
# calls as <tool_call> blocks with the arguments object, tool results in <tool_response>.
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|tool|>{{ m.content }}\n"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>'
    "{% endfor %}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather?", "tool_calls": None, "tool_call_id": None},
    {"role": "assistant", "content": "", "tool_call_id": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "content": "cold", "tool_calls": None, "tool_call_id": "c1"},
]


def render(source: str, messages: list[dict[str, Any]], tools: Any = None) -> str:
    converted, template_tools = template_input(messages, parse_tools(tools, None, None), source)
    return ChatTemplate(source, None, None).render(converted, False, template_tools)


def test_a_tool_aware_template_gets_tools_and_calls_as_they_are() -> None:
    text = render(TOOL_TEMPLATE, HISTORY, [WEATHER])
    assert text == (  # (the sandbox trims the newline after a block tag)
        '<|system|>tools:{"type": "function", "function": {"name": "get_weather", "parameters": '
        '{"type": "object"}}}<|user|>Weather?\n'
        '<|assistant|><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        "<|tool|>cold\n"
    )


def test_a_plain_template_gets_the_generic_format() -> None:
    text = render(PLAIN_TEMPLATE, HISTORY, [WEATHER])
    assert text.startswith("<|system|>You may call one or more functions")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert f"<|assistant|>{call}\n" in text
    assert text.endswith("<|user|><tool_response>\ncold\n</tool_response>\n")


def test_without_tools_messages_are_unchanged() -> None:
    plain = [{"role": "developer", "content": "Be brief.", "tool_calls": None, "tool_call_id": None}]
    assert render(PLAIN_TEMPLATE, plain) == "<|system|>Be brief.\n"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "robot", "content": "x"}, "messages[0].role"),
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
         "messages[0].tool_calls"),
        ({"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
         "messages[0].tool_calls[0].function"),
        ({"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "[1]"}}]},
         "messages[0].tool_calls[0].function.arguments"),
    ],
)
def test_malformed_history_names_the_field(message: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        template_input([message], parse_tools(None, None, None), PLAIN_TEMPLATE)
    assert caught.value.param == param
