"""Turn a JSON Schema validation error into one line: JSON path, what is wrong, how to fix it.

The schema carries an ``x-fix`` hint on most properties; when the failing node has none, a generic fix
for the kind of failure is used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jsonschema.exceptions import ValidationError


def json_path(parts: Iterable[Any]) -> str:
    """``$.a.b[0].c`` from path parts."""
    text = "$"
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def describe_error(error: ValidationError) -> str:
    """``<json path>: <problem>; fix: <fix>`` for one validation error."""
    path = list(error.absolute_path)
    schema = error.schema if isinstance(error.schema, dict) else {}
    validator = error.validator
    if validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = sorted(schema.get("properties", {}))
        unknown = sorted(key for key in error.instance if key not in allowed)
        where = json_path(path + unknown[:1])
        names = ", ".join(allowed)
        return f"{where}: unknown field; fix: remove it or correct the spelling (allowed: {names})"
    if validator == "required":
        missing = _missing_key(error)
        return f"{json_path(path + [missing])}: required field is missing; fix: add {missing!r}"
    problem = _problem(error)
    fix = _fix_hint(error, schema)
    return f"{json_path(path)}: {problem}; fix: {fix}"


def _missing_key(error: ValidationError) -> str:
    message = error.message
    if message.startswith("'") and "'" in message[1:]:
        return message[1:message.index("'", 1)]
    return "<field>"


def _problem(error: ValidationError) -> str:
    value = _short(error.instance)
    validator = error.validator
    if validator == "type":
        expected = error.validator_value
        names = expected if isinstance(expected, list) else [expected]
        return f"{value} is not of type {' or '.join(str(name) for name in names)}"
    if validator in ("enum", "const"):
        return f"{value} is not an accepted value"
    if validator in ("minimum", "exclusiveMinimum"):
        return f"{value} is below the minimum {error.validator_value}"
    if validator in ("maximum", "exclusiveMaximum"):
        return f"{value} is above the maximum {error.validator_value}"
    if validator in ("oneOf", "anyOf"):
        return f"{value} matches none of the accepted forms"
    return " ".join(error.message.split())


def _fix_hint(error: ValidationError, schema: dict[str, Any]) -> str:
    hint = schema.get("x-fix")
    if isinstance(hint, str):
        return hint
    parent = error.parent
    while parent is not None:
        parent_schema = parent.schema if isinstance(parent.schema, dict) else {}
        if isinstance(parent_schema.get("x-fix"), str):
            return str(parent_schema["x-fix"])
        parent = parent.parent
    if error.validator == "type":
        return f"write a value of type {error.validator_value}"
    if error.validator in ("enum", "const"):
        return f"use {error.validator_value!r}"
    return "see the manifest schema (deterministic_inference/workflow/manifest.schema.json)"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
