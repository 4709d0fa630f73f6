"""Request fields -> StructuredOutput: each API's names, one constraint per request, 400s naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.server import structured

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_json_schema_is_canonical_and_compact() -> None:
    spec = structured.json_schema(SCHEMA, "x")
    assert spec.kind == "json_schema"
    loaded = json.loads(spec.source)
    assert loaded["x-guidance"] == structured.JSON_LAYOUT
    assert spec == structured.json_schema(json.dumps(SCHEMA, indent=2), "x")  # text or object: one spec
    assert list(loaded["properties"]) == ["a", "b"]  # sorted keys
    own = structured.json_schema({**SCHEMA, "x-guidance": {"whitespace_flexible": True}}, "x")
    assert json.loads(own.source)["x-guidance"] == {"whitespace_flexible": True}


def test_response_format() -> None:
    assert structured.response_format(None) is None
    assert structured.response_format({"type": "text"}) is None
    assert structured.response_format({"type": "json_object"}) == (
        "response_format", StructuredOutput("json_object", ""))
    param, spec = structured.response_format(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    ) or ("", None)
    assert param == "response_format.json_schema.schema" and spec == structured.json_schema(SCHEMA, "")


def test_vllm_fields() -> None:
    got = structured.vllm_structured({"regex": "[0-9]+"})
    assert got == ("structured_outputs.regex", StructuredOutput("regex", "[0-9]+"))
    got = structured.vllm_structured({"choice": ["yes", "no"]})
    assert got == ("structured_outputs.choice", StructuredOutput("choice", '["yes", "no"]'))
    got = structured.vllm_structured({"grammar": 'root ::= "a"'})
    assert got == ("structured_outputs.grammar", StructuredOutput("ebnf", 'root ::= "a"'))
    assert structured.vllm_structured({"json": SCHEMA}) == (
        "structured_outputs.json", structured.json_schema(SCHEMA, ""))
    assert structured.vllm_structured({"json_object": True}) == (
        "structured_outputs.json_object", StructuredOutput("json_object", ""))
    tag = structured.vllm_structured({"structural_tag": {"type": "structural_tag", "structures": []}})
    assert tag is not None and tag[1].kind == "structural_tag"
    guided = structured.vllm_guided({"guided_regex": "a+", "guided_choice": None})
    assert guided == [("guided_regex", StructuredOutput("regex", "a+"))]


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda: structured.json_schema("{not json", "response_format.json_schema.schema"),
         "response_format.json_schema.schema"),
        (lambda: structured.json_schema([1], "structured_outputs.json"), "structured_outputs.json"),
        (lambda: structured.response_format({"type": "yaml"}), "response_format.type"),
        (lambda: structured.response_format({"type": "json_schema"}), "response_format.json_schema"),
        (lambda: structured.vllm_structured({"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (lambda: structured.vllm_structured({"choice": []}), "structured_outputs.choice"),
        (lambda: structured.vllm_structured({"choice": ["a", 1]}), "structured_outputs.choice"),
        (lambda: structured.vllm_structured({"regex": ""}), "structured_outputs.regex"),
        (lambda: structured.vllm_structured({"grammar": 7}), "structured_outputs.grammar"),
        (lambda: structured.vllm_guided({"guided_json": "[]"}), "guided_json"),
        (lambda: structured.json_schema({"minimum": float("nan")}, "guided_json"), "guided_json"),
    ],
)
def test_bad_values_name_the_field(call: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        call()
    assert caught.value.param == param


def test_only_one_constraint() -> None:
    one = ("guided_regex", StructuredOutput("regex", "a"))
    two = ("response_format", StructuredOutput("json_object", ""))
    assert structured.only_one([None, one]) == one
    assert structured.only_one([None, None]) is None
    with pytest.raises(InvalidRequestError) as caught:
        structured.only_one([one, None, two])
    assert caught.value.param == "response_format" and "guided_regex" in str(caught.value)


class _Compiler:
    def __init__(self, error: str | None) -> None:
        self.error = error
        self.seen: list[StructuredOutput] = []

    def compile(self, spec: StructuredOutput) -> object:
        self.seen.append(spec)
        if self.error:
            raise InvalidRequestError(self.error)
        return object()


def test_compile_checked_names_the_field() -> None:
    asyncio.run(_compile_checked())


async def _compile_checked() -> None:
    spec = StructuredOutput("regex", "(")
    ok = _Compiler(None)
    assert await structured.compile_checked(ok, ("guided_regex", spec)) == spec and ok.seen == [spec]
    assert await structured.compile_checked(ok, None) is None
    with pytest.raises(InvalidRequestError) as caught:
        await structured.compile_checked(_Compiler("unclosed group"), ("guided_regex", spec))
    assert caught.value.param == "guided_regex" and str(caught.value) == "guided_regex: unclosed group"
