"""Response bodies of tool calls (chat `message.tool_calls` and streamed `delta.tool_calls`), as pydantic
models for `/openapi.json`; `schemas` uses them in the chat message and delta."""

from __future__ import annotations

from pydantic import BaseModel


class ToolCallFunction(BaseModel):
    """The function a call names and its arguments as JSON text, exactly as the model wrote them."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call of an assistant message."""

    id: str
    type: str  # always "function"
    function: ToolCallFunction


class ToolCallFunctionDelta(BaseModel):
    """A streamed piece of a call's function: the name (first piece only) and an arguments fragment."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: the first carries index, id, type, function name and empty arguments,
    later ones the index and an arguments fragment; the fragments join to the call's arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: ToolCallFunctionDelta
