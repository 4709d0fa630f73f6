"""OpenAI `tools` / `tool_choice`: validation, the tool-call grammar, and tool history in the prompt.

Tool calls are written in one format, Hermes-style (Qwen2.5 / Qwen3 use it too):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call (parallel calls: blocks separated by a newline); models whose chat template asks for
Llama 3.x's JSON form (`{"name": ..., "parameters": {...}}`, parallel calls separated by "; ") are
constrained to and parsed in that form instead (`tool_style`, `tool_llama`). `tool_choice` picks the
grammar:
"none" -> no grammar (and no parsing); "required" -> one call (or several with `parallel_tool_calls`) of
any of the tools; a named function -> calls of that function only; "auto" -> free text, and once the
model writes `<tool_call>` (a lazy trigger) the rest of the block must be a valid call. Inside a call the
name is one of the tools and the arguments validate against its `parameters` schema (compact JSON).

History: when the model's chat template renders tools (it uses `tools`, as Qwen's and Llama 3.x's do),
`tools`, assistant `tool_calls` and `tool` messages go to the template as they are (arguments as
objects). Otherwise the generic format: a system message lists the tools and this call format, an
assistant message's calls are appended to its text as blocks, and a `tool` message becomes a `user`
message `<tool_response>\\n{content}\\n</tool_response>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.server.structured import bad, schema_source

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
GENERIC_TOOLS_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions, one JSON "
    "object per line:\n<tools>\n{tools}\n</tools>\nTo call a function, answer with its name and "
    "arguments as a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Tool:
    """One function tool of a request."""

    name: str
    definition: dict[str, Any]  # the `function` object as sent (name, description, parameters, strict)
    schema_source: str  # canonical JSON of its parameters schema (compact layout added)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools mean for generation and for the response."""

    tools: tuple[Tool, ...]
    choice: str  # "none", "auto" or "required" (a named function is "required" with one tool allowed)
    allowed: tuple[Tool, ...]  # the tools a call may name
    parallel: bool
    style: str = "hermes"  # the call format: "hermes" (<tool_call> blocks) or "llama3_json"

    @property
    def parses_calls(self) -> bool:
        """True when the answer's text is scanned for tool calls."""
        return self.choice != "none" and bool(self.tools)

    def grammar(self) -> StructuredOutput | None:
        """The constraint for this plan (None for "none")."""
        if not self.parses_calls:
            return None
        lazy = self.choice == "auto"
        if self.style == "llama3_json":
            return StructuredOutput("lark", llama_grammar(self.allowed, lazy, self.parallel))
        return StructuredOutput("lark", call_grammar(self.allowed, lazy, self.parallel))

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template (or the generic prompt) receives them."""
        return [{"type": "function", "function": tool.definition} for tool in self.tools]


def parse_tools(tools: Any, tool_choice: Any, parallel: bool | None, style: str = "hermes") -> ToolPlan:
    """Validate `tools` and `tool_choice` (400 naming the field) and resolve the choice; `style`: the
    call format (`tool_style` of the model's chat template)."""
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", "must be a list of tools")
    parsed = tuple(_tool(index, item) for index, item in enumerate(tools or []))
    names = [tool.name for tool in parsed]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise bad(f"tools[{index}].function.name", f"{name!r} is given twice")
    choice, allowed = _resolve_choice(tool_choice, parsed)
    return ToolPlan(parsed, choice, allowed, True if parallel is None else bool(parallel), style)


def _tool(index: int, item: Any) -> Tool:
    where = f"tools[{index}]"
    if not isinstance(item, Mapping) or item.get("type", "function") != "function":
        raise bad(f"{where}.type", "only tools of type 'function' are supported")
    function = item.get("function")
    if not isinstance(function, Mapping):
        raise bad(f"{where}.function", "required object with the function's name and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    source = schema_source(parameters, f"{where}.function.parameters")
    return Tool(name, dict(function), source)


def _resolve_choice(tool_choice: Any, tools: tuple[Tool, ...]) -> tuple[str, tuple[Tool, ...]]:
    if tool_choice is None:
        return ("auto" if tools else "none"), tools
    if tool_choice == "none":
        return "none", ()
    if not tools:
        raise bad("tool_choice", f"{_shown(tool_choice)} needs `tools`; this request has none")
    if tool_choice in ("auto", "required"):
        return str(tool_choice), tools
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        for tool in tools:
            if tool.name == name:
                return "required", (tool,)
        raise bad("tool_choice", f"names function {name!r}, which is not in `tools`")
    raise bad("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}")


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def call_grammar(allowed: Sequence[Tool], lazy: bool, parallel: bool) -> str:
    """The Lark grammar (llguidance dialect) of the tool-call format: each call names an allowed tool
    and its arguments are an inline JSON schema (`%json`). `lazy`: free text until the model writes
    `<tool_call>` ("auto"); else the answer is the call(s) only."""
    choices, rules = _function_rules(allowed, "arguments")
    body = f'"\\n{{\\"name\\": " ({choices}) "}}\\n{CALL_CLOSE}"'
    if lazy:
        return _lazy_calls(f'"{CALL_OPEN}"', body, parallel, rules)
    repeat = ' ("\\n" call)*' if parallel else ""
    return f'start: call{repeat}\ncall: "{CALL_OPEN}" {body}\n{rules}\n'


def _function_rules(allowed: Sequence[Tool], arguments_key: str) -> tuple[str, str]:
    """("fn_0 | fn_1 | ...", the rules): rule fn_i is tool i's name then its arguments under
    `arguments_key` as an inline JSON schema (`%json`)."""
    rules = []
    for index, tool in enumerate(allowed):
        head = json.dumps(f'"{tool.name}", "{arguments_key}": ')
        rules.append(f"fn_{index}: {head} %json{tool.schema_source}")
    return " | ".join(f"fn_{i}" for i in range(len(allowed))), "\n".join(rules)


def _lazy_calls(trigger: str, body: str, parallel: bool, rules: str) -> str:
    """A lazy grammar ("auto"): free text until the model writes the `trigger` literal, then `body`."""
    return (
        "%llguidance {}\n"
        f"start: call{'*' if parallel else '?'} free\n"
        "free: FREE_TEXT\n"
        "FREE_TEXT: /(.|\\n)*/\n"
        f"trigger[lazy]: FREE_TEXT {trigger}\n"
        f"call: trigger {body}\n{rules}\n"
    )


LLAMA_OPEN = '{"name": '  # what starts a call in the Llama 3.x JSON form
LLAMA_SEPARATOR = "; "


def tool_style(template_source: str | None) -> str:
    """The call format a chat template teaches: "llama3_json" when it renders tools and describes calls
    with "parameters" but has no `<tool_call>` tag (Llama 3.1 / 3.2), else "hermes"."""
    source = str(template_source or "")
    if supports_tools(source) and CALL_OPEN not in source and '"parameters"' in source:
        return "llama3_json"
    return "hermes"


def llama_grammar(allowed: Sequence[Tool], lazy: bool, parallel: bool) -> str:
    """The Lark grammar of Llama 3.x JSON calls (`{"name": "f", "parameters": {...}}`, "; " between
    parallel calls); `lazy`: free text until the model writes `{"name": ` ("auto")."""
    choices, rules = _function_rules(allowed, "parameters")
    if lazy:
        return _lazy_calls(json.dumps(LLAMA_OPEN), f'({choices}) "}}"', parallel, rules)
    repeat = f" ({json.dumps(LLAMA_SEPARATOR)} call)*" if parallel else ""
    return f'start: call{repeat}\ncall: {json.dumps(LLAMA_OPEN)} ({choices}) "}}"\n{rules}\n'


def supports_tools(template_source: str | None) -> bool:
    """True when the chat template renders `tools` itself (Qwen, Llama 3.x, ...)."""
    return bool(template_source) and "tools" in str(template_source)


def render_block(name: str, arguments: Any) -> str:
    """One call in the generic format (`arguments`: the object, or its JSON text)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}"


def generic_messages(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """The conversation in the generic format, for templates without tool support (see the module
    docstring); `messages` carry `tool_calls` with arguments as objects and `tool` roles."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            out.append({"role": "user", "content": response})
        elif role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            blocks = [render_block(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            text = message.get("content") or ""
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)})
        else:
            out.append({"role": role, "content": message["content"]})
    if plan.tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.template_tools())
        prompt = GENERIC_TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
