"""Request bodies: always JSON, strictly decoded, and free of text the engine cannot take.

`JSONBodyRoute` is the route class of every endpoint with a body. Its request parses the body as JSON
whatever the Content-Type says (`curl -d` sends form encoding; the server always parsed JSON), decodes
UTF-8 strictly (no UTF-16 guessing, no replacement characters), and rejects, naming the field, any
string or object key holding a lone UTF-16 surrogate (JSON escapes like "\\udcff" decode to one; no
tokenizer, template or UTF-8 encoder accepts it) or a NUL character. Every failure is an OpenAI-style
400 raised as `InvalidBodyError`, before the body reaches pydantic or the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from deterministic_inference.server.errors import APIError, InvalidBodyError

_BAD_TEXT = re.compile("[\ud800-\udfff\x00]")


def parse_json_body(raw: bytes) -> Any:
    """The JSON document in `raw` (strict UTF-8), checked by `check_text`; InvalidBodyError if not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _invalid(f"malformed JSON body: invalid UTF-8 at byte {error.start}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise _invalid(f"malformed JSON body: {error.msg} at character {error.pos}") from None
    except (RecursionError, ValueError) as error:  # nesting too deep, an integer with too many digits
        raise _invalid(f"malformed JSON body: {type(error).__name__}") from None
    check_text(document)
    return document


def check_text(document: Any) -> None:
    """400 naming the first string (or object key) that holds a lone surrogate or a NUL character."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_string(value, path)
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                _check_string(key, path, is_key=True)  # a bad key: name the object holding it
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{index}]") for index, item in reversed(list(enumerate(value))))


def _check_string(value: str, path: str, is_key: bool = False) -> None:
    found = _BAD_TEXT.search(value)
    if found is None:
        return
    char = found.group()
    path = path if len(path) <= 200 else path[:200] + "..."
    what = "a NUL character (U+0000)" if char == "\x00" else f"a lone UTF-16 surrogate (U+{ord(char):04X})"
    subject = f"{path}: {'a key ' if is_key else ''}" if path else ("a key of the body " if is_key else "")
    raise InvalidBodyError(
        APIError(
            400,
            f"{subject}contains {what}, which is not valid text; send valid Unicode",
            param=path or None,
            code="invalid_unicode",
        )
    )


def _invalid(message: str) -> InvalidBodyError:
    return InvalidBodyError(APIError(400, message, code="invalid_json"))


class StrictJSONRequest(Request):
    """A request whose `json()` is `parse_json_body`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """An APIRoute whose body is always parsed as strict JSON (see the module docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            scope = request.scope
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope["headers"] = [*headers, (b"content-type", b"application/json")]
            return await handler(StrictJSONRequest(scope, request.receive))

        return route
