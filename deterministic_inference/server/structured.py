"""Request fields that constrain the output -> one `StructuredOutput` (or None), checked before admission.

The APIs name constraints differently: OpenAI `response_format`, vLLM `structured_outputs` and the older
`guided_*` fields, SGLang `sampling_params.json_schema` / `regex` / `ebnf`. Each is mapped here, and a
request may carry at most one constraint (two are a 400 naming both). A JSON schema is sent to the engine
as canonical JSON (sorted keys, no spaces; `workflow.canonical`), so equal schemas compile once; keys are
therefore generated in sorted order. Unless the schema says otherwise (its own `x-guidance` key), JSON is
generated compact, in Python's `json.dumps` layout (`", "` and `": "`, no other whitespace): a small model
at T=1 cannot then loop on whitespace, and the answers read like ordinary JSON.

`compile_checked` asks the engine's grammar compiler (off the event loop) and turns its refusal into a 400
naming the request field, so an invalid, unsupported or too-large grammar never reaches the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError, WorkflowError
from deterministic_inference.workflow.canonical import canonical_json

# JSON layout the grammar allows (llguidance's JSON options): compact, json.dumps separators.
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_VLLM_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}

Constraint = tuple[str, StructuredOutput]  # (the request field it came from, the constraint)


def bad(param: str, message: str) -> InvalidRequestError:
    """A 400 naming `param`, with the message prefixed by it."""
    return InvalidRequestError(f"{param}: {message}", param=param)


def _loads(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise bad(param, f"not valid JSON ({error.msg} at character {error.pos})") from None


def schema_source(schema: Any, param: str) -> str:
    """Canonical JSON text of a JSON schema given as an object or as JSON text (compact layout added)."""
    if isinstance(schema, str):
        schema = _loads(schema, param)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise bad(param, "a JSON schema must be an object")
    schema = dict(schema)
    schema.setdefault("x-guidance", JSON_LAYOUT)
    try:
        return canonical_json(schema)
    except WorkflowError as error:
        raise bad(param, str(error)) from None


def json_schema(schema: Any, param: str) -> StructuredOutput:
    """A json_schema constraint."""
    return StructuredOutput("json_schema", schema_source(schema, param))


def regex(pattern: Any, param: str) -> StructuredOutput:
    """A regex constraint (the whole output matches it)."""
    if not isinstance(pattern, str) or not pattern:
        raise bad(param, "must be a non-empty string (a regular expression)")
    return StructuredOutput("regex", pattern)


def choice(options: Any, param: str) -> StructuredOutput:
    """A choice constraint: the output is exactly one of the strings."""
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise bad(param, "must be a non-empty list of non-empty strings")
    return StructuredOutput("choice", json.dumps(options, ensure_ascii=False))


def ebnf(grammar: Any, param: str) -> StructuredOutput:
    """An EBNF (GBNF, root rule `root`) constraint."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise bad(param, "must be a non-empty string (a GBNF grammar with a `root` rule)")
    return StructuredOutput("ebnf", grammar)


def structural_tag(spec: Any, param: str) -> StructuredOutput:
    """A structural_tag constraint from its spec (an object or JSON text)."""
    if isinstance(spec, str):
        spec = _loads(spec, param)
    if not isinstance(spec, Mapping):
        raise bad(param, "a structural tag must be an object")
    try:
        return StructuredOutput("structural_tag", canonical_json(dict(spec)))
    except WorkflowError as error:
        raise bad(param, str(error)) from None


def response_format(value: Mapping[str, Any] | None, param: str = "response_format") -> Constraint | None:
    """OpenAI `response_format` (text / json_object / json_schema; vLLM's structural_tag too)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return param, StructuredOutput("json_object", "")
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping):
            raise bad(f"{param}.json_schema", "required object for type 'json_schema'")
        if "schema" not in inner:  # OpenAI: the schema is optional; without one, any JSON object
            return param, StructuredOutput("json_object", "")
        where = f"{param}.json_schema.schema"
        return where, json_schema(inner["schema"], where)
    if kind == "structural_tag":
        return param, structural_tag({k: v for k, v in value.items() if k != "type"}, param)
    raise bad(f"{param}.type", f"{kind!r} is not one of text, json_object, json_schema, structural_tag")


def vllm_structured(value: Mapping[str, Any] | None, param: str = "structured_outputs") -> Constraint | None:
    """vLLM `structured_outputs`: exactly one of json / regex / choice / grammar / json_object /
    structural_tag (its other keys, e.g. backend options, are ignored)."""
    if value is None:
        return None
    given = [key for key in _VLLM_KEYS if value.get(key) not in (None, False)]
    if len(given) > 1:
        raise bad(param, f"give one constraint, not {len(given)} ({', '.join(given)})")
    if not given:
        return None
    key = given[0]
    return f"{param}.{key}", _vllm_one(key, value[key], f"{param}.{key}")


def _vllm_one(key: str, value: Any, param: str) -> StructuredOutput:
    if key == "json":
        return json_schema(value, param)
    if key == "regex":
        return regex(value, param)
    if key == "choice":
        return choice(value, param)
    if key == "grammar":
        return ebnf(value, param)
    if key == "json_object":
        return StructuredOutput("json_object", "")
    return structural_tag(value, param)


def vllm_guided(fields: Mapping[str, Any]) -> list[Constraint]:
    """vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields."""
    found = []
    for name, key in _GUIDED.items():
        value = fields.get(name)
        if value is not None:
            found.append((name, _vllm_one(key, value, name)))
    if fields.get("guided_json_object"):
        found.append(("guided_json_object", StructuredOutput("json_object", "")))
    return found


def only_one(constraints: list[Constraint | None]) -> Constraint | None:
    """The request's single constraint; a 400 naming the fields when there are several."""
    present = [c for c in constraints if c is not None]
    if len(present) > 1:
        names = ", ".join(name for name, _ in present)
        raise bad(present[1][0], f"one output constraint per request; this one sets {names}")
    return present[0] if present else None


async def compile_checked(grammars: Any, constraint: Constraint | None) -> StructuredOutput | None:
    """Compile the constraint with the engine's grammar compiler (cached by digest), in a worker thread;
    its refusal is a 400 naming the request field. Returns the spec for `SamplingParams`."""
    if constraint is None:
        return None
    param, spec = constraint
    try:
        await asyncio.to_thread(grammars.compile, spec)
    except InvalidRequestError as error:
        message = str(error)
        raise InvalidRequestError(message if message.startswith(param) else f"{param}: {message}",
                                  param=param) from None
    return spec
