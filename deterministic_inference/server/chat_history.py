"""A chat request's messages as the chat template receives them, tool history included.

Roles system / developer / user / assistant / tool. An assistant message's `tool_calls` (OpenAI shape:
id, type "function", function.name, function.arguments as JSON text) are checked and their arguments
parsed into objects, which is what tool-aware templates (Qwen's `tojson`, Llama 3.x) expect. When the
template renders tools itself the messages and `tools` go to it as they are; otherwise they are rewritten
into the generic format of `server.tools`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deterministic_inference.server.structured import bad
from deterministic_inference.server.tools import ToolPlan, generic_messages, supports_tools

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def template_input(
    messages: Sequence[Mapping[str, Any]], plan: ToolPlan, template_source: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. `messages`: role, text content (parts already joined),
    and optional `tool_calls` / `tool_call_id` as the request sent them."""
    converted = [_message(index, message) for index, message in enumerate(messages)]
    uses_tools = bool(plan.tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in converted)
    if not uses_tools:
        return converted, None
    if supports_tools(template_source):
        return converted, (plan.template_tools() or None)
    return generic_messages(converted, plan), None


def _message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    role = message["role"]
    if role not in CHAT_ROLES:
        raise bad(f"messages[{index}].role", f"{role!r} is not one of {', '.join(CHAT_ROLES)}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": message["content"]}
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise bad(f"messages[{index}].tool_calls", "only assistant messages carry tool calls")
        out["tool_calls"] = [_call(f"messages[{index}].tool_calls[{k}]", c) for k, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"messages[{index}].tool_call_id", "a tool message needs the id of the call it answers")
        out["tool_call_id"] = call_id
    return out


def _call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping) or call.get("type", "function") != "function":
        raise bad(f"{where}.type", "only calls of type 'function' are supported")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise bad(f"{where}.function", "required object with a string name and arguments")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise bad(f"{where}.function.arguments", "must be JSON text (an object)") from None
    if not isinstance(arguments, Mapping):
        raise bad(f"{where}.function.arguments", "must be a JSON object")
    call_id = call.get("id")
    return {
        "id": call_id if isinstance(call_id, str) else "",
        "type": "function",
        "function": {"name": function["name"], "arguments": dict(arguments)},
    }
