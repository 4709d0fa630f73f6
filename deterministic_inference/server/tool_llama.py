"""Tool calls in Llama 3.x's JSON form out of an answer's text, whole or streamed.

A call is `{"name": "f", "parameters": {...}}` (compact JSON, as the grammar of `tools.llama_grammar`
writes it); parallel calls are separated by "; ". The same rule as `tool_parser.parse_calls`: on a
prefix (`final=False`) the undecided tail is held back (a tail that may start a call, the separator after
a call, a call's closing `}`), so every partial parse is a prefix of the final one and the streamed
deltas join to the whole answer. A call ends where its JSON object ends (found by decoding it); one cut
short keeps the parameters written so far.
"""

from __future__ import annotations

import json
import re

from deterministic_inference.server.tool_parser import Parsed, ParsedCall
from deterministic_inference.server.tools import LLAMA_OPEN

_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "parameters": ')
_NAME_SO_FAR = re.compile(r'\{"name": "[A-Za-z0-9_-]{0,64}')
_AFTER_NAME = '", "parameters": '
_DECODER = json.JSONDecoder()


def _held_open(tail: str) -> int:
    """Length of the longest suffix of `tail` that is a proper prefix of `{"name": `."""
    for size in range(min(len(tail), len(LLAMA_OPEN) - 1), 0, -1):
        if LLAMA_OPEN.startswith(tail[-size:]):
            return size
    return 0


def _may_become_head(body: str) -> bool:
    """True when more text could still make `body` a call's head."""
    if '{"name": "'.startswith(body):
        return True
    so_far = _NAME_SO_FAR.match(body)
    return so_far is not None and _AFTER_NAME.startswith(body[so_far.end() :])


def _call_end(text: str, start: int) -> int:
    """Index just past the call object starting at `start`, or -1 while it is not complete."""
    try:
        value, end = _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return -1
    return end if isinstance(value, dict) else -1


def _open_parameters(rest: str) -> str:
    """Parameters text of a call not closed yet: without a trailing `}` that may be the call's own."""
    rest = rest.rstrip()
    return rest[:-1] if rest.endswith("}") else rest


def parse_llama_calls(text: str, final: bool, max_calls: int | None = None) -> Parsed:
    """Content and calls of `text` (see the module docstring; `max_calls` as in `parse_calls`)."""
    content: list[str] = []
    calls: list[ParsedCall] = []
    position = 0
    after_call = False
    while True:
        if after_call:  # the separator and whitespace after a call are layout, not content
            skipped = len(text) - len(text[position:].lstrip("; \n\t"))
            if skipped == len(text) and not final:
                break
            position = skipped
        start = text.find(LLAMA_OPEN, position)
        if max_calls is not None and len(calls) >= max_calls:
            start = -1
        if start < 0:
            tail = text[position:]
            content.append(tail if final else tail[: len(tail) - _held_open(tail)])
            break
        content.append(text[position:start])
        head = _HEAD.match(text, start)
        if head is None:
            if not final and _may_become_head(text[start:]):
                break
            content.append(text[start])
            position, after_call = start + 1, False
            continue
        end = _call_end(text, start)
        if end < 0:
            calls.append(ParsedCall(head.group(1), _open_parameters(text[head.end() :])))
            break
        calls.append(ParsedCall(head.group(1), text[head.end() : end - 1].rstrip()))
        position, after_call = end, True
    return Parsed("".join(content), tuple(calls))

