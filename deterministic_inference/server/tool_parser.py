"""Tool calls out of an answer's text, whole or streamed, with one rule for both.

`parse_calls(text, final)` splits the text into content and calls (see `tools` for the format). On a
prefix of an answer (`final=False`) it holds back what more text could still change: a tail that may be
the start of `<tool_call>`, trailing whitespace after a call, and the arguments' last characters that
may be the block's closing `}` and tag. So every partial parse is a prefix of the final one, and
`ToolCallStream` sends the growth as OpenAI-shaped deltas: the joined content and arguments equal the
non-streamed message exactly. A block cut short (finish_reason "length") keeps the arguments written so
far, as OpenAI does; a block whose name is not complete stays text.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from deterministic_inference.server.tools import CALL_CLOSE, CALL_OPEN

_HEAD = re.compile(r'\s*\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


@dataclass(frozen=True)
class ParsedCall:
    """One call: the function's name and its arguments as written (JSON text)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """An answer split into content (text outside the calls) and calls."""

    content: str
    calls: tuple[ParsedCall, ...]


def _held_open(tail: str) -> int:
    """Length of the longest suffix of `tail` that is a proper prefix of `<tool_call>`."""
    for size in range(min(len(tail), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(tail[-size:]):
            return size
    return 0


def _arguments(rest: str, closed: bool) -> str:
    """The arguments text of a block body after its head: without the closing `}` and tag (or, when
    the block is not closed yet, without whatever could still turn out to be them)."""
    if not closed:
        for size in range(min(len(rest), len(CALL_CLOSE) - 1), 0, -1):
            if CALL_CLOSE.startswith(rest[-size:]):
                rest = rest[:-size]
                break
    rest = rest.rstrip()
    if rest.endswith("}"):
        rest = rest[:-1].rstrip()
    return rest


def parse_calls(text: str, final: bool, max_calls: int | None = None) -> Parsed:
    """Content and calls of `text`; `final=False` for a prefix of a longer answer (holds back the
    undecided tail); `max_calls`: later blocks stay text (one call when parallel calls are off)."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    position = 0
    while True:
        start = text.find(CALL_OPEN, position)
        if max_calls is not None and len(calls) >= max_calls:
            start = -1
        segment = text[position:] if start < 0 else text[position:start]
        if calls and content_is_after_call(content, position, text):
            segment = segment.lstrip()
            if start < 0 and not final and not segment:
                break
        if start < 0:
            if not final:
                segment = segment[: len(segment) - _held_open(segment)]
            content.append(segment)
            break
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        head = _HEAD.match(body)
        if head is None:
            if end < 0 and not final:  # the head may still come: hold the block back
                content.append(segment)
                break
            content.append(segment + text[start : body_start if end < 0 else end])
            position = len(text) if end < 0 else end
            continue
        content.append(segment)
        calls.append(ParsedCall(head.group(1), _arguments(body[head.end() :], end >= 0)))
        if end < 0:
            break
        position = end + len(CALL_CLOSE)
    return Parsed("".join(content), tuple(calls))


def content_is_after_call(content: list[str], position: int, text: str) -> bool:
    """True when the text at `position` directly follows a closed call block (whitespace there is
    part of the block layout, not content)."""
    return position >= len(CALL_CLOSE) and text[position - len(CALL_CLOSE) : position] == CALL_CLOSE


def new_call_id() -> str:
    """An OpenAI-style call id (metadata, like the response id; never part of compared output)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def message_fields(parsed: Parsed, ids: list[str]) -> dict[str, Any]:
    """`content` and `tool_calls` of a non-streamed assistant message (content None when only calls)."""
    calls = [
        {"id": ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(parsed.calls)
    ]
    if not calls:
        return {"content": parsed.content, "tool_calls": None}
    return {"content": parsed.content or None, "tool_calls": calls}


@dataclass
class ToolCallStream:
    """What one streamed choice has sent; `advance` returns the delta dicts for the text so far."""

    max_calls: int | None
    text: str = ""
    content_sent: str = ""
    arguments_sent: list[str] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)

    def advance(self, piece: str, final: bool) -> list[dict[str, Any]]:
        """Add `piece` of text; the deltas (each a chat `delta` object) that the new text decides."""
        self.text += piece
        parsed = parse_calls(self.text, final, self.max_calls)
        deltas: list[dict[str, Any]] = []
        if len(parsed.content) > len(self.content_sent) and parsed.content.startswith(self.content_sent):
            deltas.append({"content": parsed.content[len(self.content_sent) :]})
            self.content_sent = parsed.content
        for index, call in enumerate(parsed.calls):
            if index == len(self.ids):
                self.ids.append(new_call_id())
                self.arguments_sent.append("")
                deltas.append(_call_delta(index, {"name": call.name, "arguments": ""}, self.ids[index]))
            sent = self.arguments_sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(_call_delta(index, {"arguments": call.arguments[len(sent) :]}))
                self.arguments_sent[index] = call.arguments
        return deltas

    def finish(self) -> Parsed:
        """The final parse (what the non-streamed response holds)."""
        return parse_calls(self.text, True, self.max_calls)


def _call_delta(index: int, function: dict[str, Any], call_id: str | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index}
    if call_id is not None:
        call.update({"id": call_id, "type": "function"})
    call["function"] = function
    return {"tool_calls": [call]}
