"""Chat-template rendering: a model's Jinja2 template run in an immutable sandbox.

Rendering is a pure function of (template, messages, add_generation_prompt, special-token strings):
no clock, no environment. Templates that ask for the date get no `strftime_now` helper, so they fall
back to the fixed date they carry themselves, which keeps prompts reproducible.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deterministic_inference.errors import InvalidRequestError


def _raise_exception(message: str) -> NoReturn:
    """Called by templates that reject a conversation (e.g. roles not alternating)."""
    raise InvalidRequestError(f"messages: the chat template rejected them: {message}", param="messages")


def _tojson(value: Any, indent: int | None = None) -> str:
    """`tojson` without HTML escaping (Jinja's default escapes <, >, & and ')."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


class ChatTemplate:
    """A compiled chat template. Construction never fails; a broken template fails on `render`."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self._template: jinja2.Template | None = None
        self._error: str | None = None
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            self._error = f"the model's chat template does not compile: {exc}"

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` (and `tools`, None = no tools); InvalidRequestError if the
        template rejects them."""
        if self._template is None:
            raise InvalidRequestError(f"messages: {self._error}", param="messages")
        _check_messages(messages)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                tools=tools,
            )
        except InvalidRequestError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise InvalidRequestError(
                f"messages: the chat template failed on them: {exc}", param="messages"
            ) from exc


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages: must be a non-empty list", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}]: must be an object with a string 'role'", param="messages"
            )
