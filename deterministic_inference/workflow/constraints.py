"""Structured outputs in workflow requests: a dataset record's `response_format` and `tools`.

A JSONL record may carry the OpenAI fields `response_format` (json_object, json_schema, structural_tag),
`tools`, `tool_choice` and `parallel_tool_calls`, exactly as a chat request would send them; they are
copied into the run's requests (so they enter the requests digest and the run id) and turned into the
engine's `StructuredOutput` by the same functions the HTTP API uses (`server.structured`,
`server.tools`), so a JSON eval reruns through `detinf run` and `verify` like any other. Records without
these fields give requests without them: existing datasets keep their ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError, WorkflowError

CONSTRAINT_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")


def request_constraint(request: Mapping[str, Any]) -> StructuredOutput | None:
    """The one output constraint of a request (or record): response_format or the tool-call grammar.
    Raises InvalidRequestError naming the field when a value is malformed or both are set."""
    from deterministic_inference.server import structured
    from deterministic_inference.server.tools import parse_tools

    plan = parse_tools(request.get("tools"), request.get("tool_choice"), request.get("parallel_tool_calls"))
    grammar = plan.grammar()
    tools = None if grammar is None else ("tool_choice" if "tool_choice" in request else "tools", grammar)
    response_format = request.get("response_format")
    if response_format is not None and not isinstance(response_format, Mapping):
        raise InvalidRequestError("response_format: must be an object", param="response_format")
    found = structured.only_one([structured.response_format(response_format), tools])
    return None if found is None else found[1]


def check_record(record: Mapping[str, Any], where: str, chat: bool) -> None:
    """A dataset record's constraint fields are well formed (WorkflowError naming record and field)."""
    present = [name for name in CONSTRAINT_FIELDS if name in record]
    if not present:
        return
    if not chat and any(name != "response_format" for name in present):
        raise WorkflowError(f"{where}: 'tools' need chat requests; set request_template.kind to 'chat'")
    try:
        request_constraint(record)
    except InvalidRequestError as error:
        raise WorkflowError(f"{where}: {error}") from None


def chat_prompt(tokenizer: Any, request: Mapping[str, Any]) -> str:
    """A chat request's prompt text, its tools rendered by the model's template (or the generic format
    when the template has no tool support), as the chat API renders them."""
    from deterministic_inference.server.chat_history import template_input
    from deterministic_inference.server.tools import parse_tools

    plan = parse_tools(request.get("tools"), request.get("tool_choice"), request.get("parallel_tool_calls"))
    messages, tools = template_input(request["messages"], plan, tokenizer.chat_template)
    text: str = tokenizer.apply_chat_template(messages, tools=tools)
    return text


def compile_all(grammars: Any, requests: list[dict[str, Any]]) -> None:
    """Compile every request's constraint before any request runs (cached by digest), so a schema the
    grammar engine refuses stops the run with nothing written, naming the request and its prompt id."""
    for request in requests:
        try:
            spec = request_constraint(request)
            if spec is not None:
                grammars.compile(spec)
        except InvalidRequestError as error:
            raise WorkflowError(
                f"request {request['request_id']} (prompt {request['prompt_id']!r}): {error}; fix the dataset"
            ) from None
