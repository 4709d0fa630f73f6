"""Slow: structured outputs and tool calls on the real default model (SmolLM2-135M-Instruct, whose chat
template has no tool support, so tools use the generic format), with the official openai client over
loopback HTTP; vLLM's and SGLang's field shapes with httpx."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from deterministic_inference.model.default_model import DEFAULT_MODEL_NAME
from tests.server.harness import RunningServer, subprocess_server

pytestmark = pytest.mark.slow
MODEL = DEFAULT_MODEL_NAME
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with their name, age and city."}]
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with subprocess_server(["--num-kv-blocks", "1024", "--threads", "1", "--log-level", "warning"]) as (
        running,
        _,
    ):
        yield running


@pytest.fixture(scope="module")
def api(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600)


def chat(api: openai.OpenAI, **kwargs: Any) -> Any:
    """`chat.completions.create` (typed loosely: the tests pass vLLM extras and dict messages)."""
    return api.chat.completions.create(**kwargs)


def complete(api: openai.OpenAI, **kwargs: Any) -> Any:
    """`completions.create`, typed loosely."""
    return api.completions.create(**kwargs)


def bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def test_json_schema_answers_validate_over_many_seeds(api: openai.OpenAI) -> None:
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for seed in range(12):
        answer = chat(
        api,
            model=MODEL, messages=ASK_PERSON, temperature=1.0, seed=seed, max_tokens=96,
            response_format=response_format,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)


def test_json_object_answers_are_objects(api: openai.OpenAI) -> None:
    for seed in range(4):
        answer = chat(
        api,
            model=MODEL, messages=ASK_PERSON, temperature=1.0, seed=seed, max_tokens=160,
            response_format={"type": "json_object"},
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        assert isinstance(json.loads(choice.message.content or ""), dict)


class City(pydantic.BaseModel):
    """What `.parse()` fills."""

    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population: int


def test_parse_with_a_pydantic_model(api: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Give me a city as JSON."}]
    answer = api.chat.completions.parse(
        model=MODEL, messages=messages, temperature=0.8, seed=1, max_tokens=96, response_format=City
    )
    parsed = answer.choices[0].message.parsed
    assert isinstance(parsed, City)


def streamed_call(api: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) joined from the streamed deltas."""
    content: str | None = None
    calls: list[list[str]] = []
    finish = None
    for chunk in chat(api, **kwargs, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(calls) and call.type == "function"
                    assert call.function is not None and call.function.arguments == ""
                    calls.append([call.function.name or "", ""])
                else:
                    assert call.function is not None and call.function.name is None
                    calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [(name, args) for name, args in calls], finish


def check_calls(api: openai.OpenAI, allowed: set[str], **kwargs: Any) -> list[tuple[str, str]]:
    """Non-streamed calls: valid names, arguments valid against the tool's schema; the stream equal."""
    answer = chat(api, **kwargs)
    choice = answer.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, arguments in calls:
        assert name in allowed
        jsonschema.validate(json.loads(arguments), schemas[name])
    assert streamed_call(api, **kwargs) == (choice.message.content, calls, choice.finish_reason)
    return calls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_calls(api: openai.OpenAI, seed: int) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0,
        seed=seed, max_tokens=120,
    )
    calls = check_calls(api, {"get_weather", "get_time"}, **kwargs)
    assert calls
    one = check_calls(api, {"get_weather", "get_time"}, **kwargs, parallel_tool_calls=False)
    assert len(one) == 1


def test_named_tool_call(api: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        kwargs: dict[str, Any] = dict(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=named, temperature=1.0,
            seed=seed, max_tokens=120,
        )
        calls = check_calls(api, {"get_weather"}, **kwargs)
        assert calls and all(name == "get_weather" for name, _ in calls)


def test_auto_tool_calls_text_or_call(api: openai.OpenAI) -> None:
    """With `auto` the model writes text or a call; over some seeds both happen here, and every call
    is valid (the grammar takes over after `<tool_call>`)."""
    kinds = set()
    for seed in range(8):
        kwargs: dict[str, Any] = dict(
            model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME], temperature=1.0, seed=seed,
            max_tokens=120,
        )
        calls = check_calls(api, {"get_weather", "get_time"}, **kwargs)
        kinds.add("call" if calls else "text")
        if kinds == {"call", "text"}:
            break
    assert kinds == {"call", "text"}


def test_tool_history_round_trip(api: openai.OpenAI) -> None:
    first = chat(
        api,
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=120,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: Any = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    answer = chat(
        api,
        model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=24
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_constrained_stream_equals_non_stream_bitwise(api: openai.OpenAI) -> None:
    kwargs: Any = dict(
        model=MODEL, messages=ASK_PERSON, temperature=1.0, seed=7, max_tokens=96, logprobs=True,
        top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    full = chat(api, **kwargs)
    text, entries = "", list[Any]()
    for chunk in chat(api, **kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            entries += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    content = full.choices[0].logprobs.content
    assert text == full.choices[0].message.content
    assert [(e.token, bits(e.logprob)) for e in entries] == [
        (e.token, bits(e.logprob)) for e in content or []
    ]


VLLM_CASES: list[tuple[dict[str, Any], Any]] = [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"json": PERSON}}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
    ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
    ({"guided_grammar": 'root ::= [0-9] [0-9]? [0-9]? "!"'}, lambda t: re.fullmatch("[0-9]{1,3}!", t)),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
]


@pytest.mark.parametrize(("extra", "check"), VLLM_CASES)
def test_vllm_fields_on_completions_and_chat(api: openai.OpenAI, extra: dict[str, Any], check: Any) -> None:
    completion = complete(
        api,
        model=MODEL, prompt="Answer: ", max_tokens=96, temperature=1.0, seed=3, extra_body=extra
    )
    assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text)
    if "response_format" in extra:
        return
    answer = chat(
        api,
        model=MODEL, messages=ASK_PERSON, max_tokens=96, temperature=1.0, seed=3, extra_body=extra
    )
    assert answer.choices[0].finish_reason == "stop" and check(answer.choices[0].message.content)


def test_vllm_structural_tag(api: openai.OpenAI) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<city>", "schema": {"type": "string", "enum": ["Paris", "Rome"]},
                        "end": "</city>"}],
        "triggers": ["<city>"],
    }
    prompt = "Name a city inside <city></city> tags, as a JSON string. <city>"
    completion = complete(
        api,
        model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"structured_outputs": {
            "structural_tag": json.dumps(tag)}}
    )
    assert completion.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("field", "value", "check"),
    [
        ("json_schema", json.dumps(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        ("regex", "(yes|no), [0-9]{2}", lambda t: re.fullmatch("(yes|no), [0-9]{2}", t)),
        ("ebnf", 'root ::= "The answer is " [0-9] "."', lambda t: re.fullmatch("The answer is [0-9][.]", t)),
    ],
)
def test_sglang_generate_fields(server: RunningServer, field: str, value: str, check: Any) -> None:
    body = {"text": "Answer: ", "sampling_params": {field: value, "max_new_tokens": 96, "sampling_seed": 5}}
    answer = httpx.post(server.base_url + "/generate", json=body, timeout=600).json()
    assert answer["meta_info"]["finish_reason"]["type"] == "stop", answer
    assert check(answer["text"])
