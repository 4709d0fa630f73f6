"""Structured outputs on the real default model (SmolLM2-135M-Instruct): JSON-schema answers validate over
many seeds at T=1.0, and a constrained chat request has the same bits alone, in a mixed batch with
chunked prefill, and after preemption; masks from another row's state (negative control) are seen."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.engine.test_structured_engine import Result, result_of

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")))
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None)


def engine_for(loaded: LoadedModel, budget: int = 2048, blocks: int | None = None, **faults: bool) -> Engine:
    config = EngineConfig(max_num_batched_tokens=budget, num_kv_blocks=blocks, selfcheck=False,
                          enable_prefix_caching=False)  # fmt: skip
    return Engine(config, loaded=loaded, record_trace=True, faults=FaultInjection(**faults))


def chat(engine: Engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_json_schema_answers_validate_over_seeds(smollm2: LoadedModel) -> None:
    engine = engine_for(smollm2)
    prompt = chat(engine, "Describe a city as JSON with its name, population and whether it is a capital.")
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_output=JSON_SPEC) for s in range(16)
    ]
    for output in engine.generate([prompt] * 16, params):
        choice = output.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def mixed(engine: Engine, target: str, params: SamplingParams, check_others: bool = True) -> Result:
    others = [chat(engine, f"Write a date in the year {1990 + i}.") for i in range(6)]
    date = StructuredOutput("regex", DATE)
    other_params = [
        SamplingParams(max_tokens=16, temperature=0.7, seed=i, structured_output=date if i % 2 else None)
        for i in range(6)
    ]
    outputs = engine.generate(
        [*others[:3], target, *others[3:]], [*other_params[:3], params, *other_params[3:]]
    )
    for output, p in zip([*outputs[:3], *outputs[4:]], [*other_params[:3], *other_params[3:]], strict=True):
        if check_others and p.structured_output is not None:
            assert re.fullmatch(DATE, output.outputs[0].text) or output.outputs[0].finish_reason == "length"
    return result_of(outputs[3])


def test_constrained_chat_alone_equals_mixed_chunked_and_preempted(smollm2: LoadedModel) -> None:
    engine = engine_for(smollm2)
    target = chat(engine, "Give me a JSON record for Paris.")
    params = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.95, seed=77, logprobs=2,
                            structured_output=JSON_SPEC)  # fmt: skip
    alone = result_of(engine.generate([target], params)[0])
    assert alone.finish_reason == "stop"
    assert mixed(engine_for(smollm2, budget=32), target, params) == alone
    small = engine_for(smollm2, blocks=20)
    assert mixed(small, target, params) == alone
    assert sum(len(plan.preempted_ids) for plan in small.trace) > 0
    rotated = mixed(engine_for(smollm2, rotate_grammar_masks=True), target, params, check_others=False)
    assert rotated != alone, "masks from another row went unnoticed: the comparison cannot fail"
