"""Structured outputs through the engine on a tiny random Llama: outputs follow their grammar, and a
constrained request's tokens, logprob bits and text are the same alone or in any batch.

Invariance is compared bitwise (token ids, float32 bits of logprobs and top logprobs, text, finish
reason) across mixed batches with unconstrained and other constrained requests, chunked prefill,
preemption, prefix-cache hits, n > 1 and streaming. The negative control samples every constrained row
with the next constrained row's mask (`FaultInjection.rotate_grammar_masks`) and must be detected.
"""

from __future__ import annotations

import json
import random
import re
import struct
from dataclasses import dataclass

import jsonschema
import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams, derive_choice_seed
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.tiny_models import TinyModel

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
JSON_SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA, sort_keys=True, separators=(",", ":")))
REGEX = r"[a-c]{2,6}-[0-9]{1,3}"
REGEX_SPEC = StructuredOutput("regex", REGEX)
CHOICES = ["alpha", "beta", "gamma", "delta"]
CHOICE_SPEC = StructuredOutput("choice", json.dumps(CHOICES))

# the constrained requests whose bits must not depend on the batch: seeded with filters and logprobs,
# greedy with penalties, and seeded with min-p (the per-row path)
TARGETS = {
    "json-seeded": SamplingParams(
        max_tokens=60, temperature=1.0, top_p=0.9, seed=11, logprobs=3, structured_output=JSON_SPEC
    ),
    "regex-greedy-penalties": SamplingParams(
        max_tokens=20,
        temperature=0.0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        logprobs=2,
        structured_output=REGEX_SPEC,
    ),
    "choice-min-p": SamplingParams(
        max_tokens=10, temperature=0.9, min_p=0.05, top_k=40, seed=3, structured_output=CHOICE_SPEC
    ),
}


@dataclass(frozen=True)
class Result:
    token_ids: tuple[int, ...]
    logprob_bits: tuple[int, ...]
    top_bits: tuple[tuple[tuple[int, int], ...], ...]
    text: str
    finish_reason: str | None


def bits(value: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", value))[0])


def result_of(output: RequestOutput, choice: int = 0) -> Result:
    out = output.outputs[choice]
    return Result(
        tuple(out.token_ids),
        tuple(bits(v) for v in out.logprobs),
        tuple(tuple((t, bits(v)) for t, v in step) for step in out.top_logprobs),
        out.text,
        out.finish_reason,
    )


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


def make_engine(
    loaded: LoadedModel,
    budget: int = 512,
    num_kv_blocks: int | None = None,
    prefix: bool = False,
    faults: FaultInjection | None = None,
) -> Engine:
    config = EngineConfig(
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=budget,
        num_kv_blocks=num_kv_blocks,
        enable_prefix_caching=prefix,
        selfcheck=False,
    )
    return Engine(config, loaded=loaded, record_trace=True, faults=faults)


def prompt(seed: int, length: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def test_json_schema_outputs_validate_over_many_seeds(tiny_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_loaded)
    params = [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured_output=JSON_SPEC) for s in range(32)
    ]
    outputs = engine.generate([prompt(s) for s in range(32)], params)
    texts = set()
    for output in outputs:
        choice = output.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), SCHEMA)
        texts.add(choice.text)
    assert len(texts) > 8  # T=1.0 explores: the grammar, not a degenerate sampler, made them valid


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_and_choice_outputs_match(tiny_loaded: LoadedModel, temperature: float) -> None:
    engine = make_engine(tiny_loaded)
    regex = [
        SamplingParams(max_tokens=20, temperature=temperature, seed=s, structured_output=REGEX_SPEC)
        for s in range(12)
    ]
    choice = [
        SamplingParams(max_tokens=20, temperature=temperature, seed=s, structured_output=CHOICE_SPEC)
        for s in range(12)
    ]
    outputs = engine.generate([prompt(s) for s in range(24)], regex + choice)
    for output in outputs[:12]:
        assert re.fullmatch(REGEX, output.outputs[0].text), output.outputs[0].text
    for output in outputs[12:]:
        assert output.outputs[0].text in CHOICES and output.outputs[0].finish_reason == "stop"


def test_constrained_logprobs_are_the_raw_model_logprobs(tiny_loaded: LoadedModel) -> None:
    """Decode logprobs of a constrained request equal, bitwise, the prompt logprobs of the same sequence
    scored in one prefill (the RL identity): the mask never renormalizes them."""
    engine = make_engine(tiny_loaded)
    target = prompt(5)
    out = engine.generate([target], TARGETS["json-seeded"])[0].outputs[0]
    scored = engine.generate([target + list(out.token_ids)], SamplingParams(max_tokens=1, prompt_logprobs=0))[
        0
    ]
    assert scored.prompt_logprobs is not None
    prefill = [bits(v) for v in scored.prompt_logprobs[len(target) :]]  # type: ignore[arg-type]
    assert prefill == [bits(v) for v in out.logprobs]


def run_mixed(
    engine: Engine, target: list[int], params: SamplingParams, others: int, position: str
) -> Result:
    """The target's result in a batch of `others` requests: unconstrained and constrained, mixed."""
    prompts = [prompt(100 + i, 5 + 7 * i % 50) for i in range(others)]
    kinds = [
        SamplingParams(max_tokens=12, temperature=0.7, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, seed=7, structured_output=REGEX_SPEC),
        SamplingParams(max_tokens=40, temperature=0.0, structured_output=JSON_SPEC),
        SamplingParams(max_tokens=10, temperature=0.8, seed=1, structured_output=CHOICE_SPEC),
    ]
    params_list = [kinds[i % len(kinds)] for i in range(others)]
    index = {"first": 0, "last": others, "middle": others // 2}[position]
    prompts.insert(index, target)
    params_list.insert(index, params)
    return result_of(engine.generate(prompts, params_list)[index])


CASES = [  # (others, position, budget, num_kv_blocks)
    (3, "first", 512, None),
    (8, "last", 16, None),
    (12, "middle", 7, None),
    (16, "first", 512, 14),
]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_constrained_request_alone_equals_in_any_batch(tiny_loaded: LoadedModel, name: str) -> None:
    params, target = TARGETS[name], prompt(42, 37)
    alone = result_of(make_engine(tiny_loaded).generate([target], params)[0])
    assert alone.finish_reason == "stop" and alone.token_ids
    preempted = 0
    for others, position, budget, blocks in CASES:
        engine = make_engine(tiny_loaded, budget=budget, num_kv_blocks=blocks)
        assert run_mixed(engine, target, params, others, position) == alone, (
            others,
            position,
            budget,
            blocks,
        )
        preempted += sum(len(plan.preempted_ids) for plan in engine.trace)
    assert preempted > 0, "the small-pool case must actually preempt"


def test_prefix_cache_hits_and_streaming_keep_the_bits(tiny_loaded: LoadedModel) -> None:
    params, target = TARGETS["json-seeded"], prompt(42, 37)
    alone = result_of(make_engine(tiny_loaded).generate([target], params)[0])
    engine = make_engine(tiny_loaded, prefix=True)
    cold = run_mixed(engine, target, params, 4, "last")
    warm = run_mixed(engine, target, params, 4, "first")
    assert engine.kv.stats.hit_tokens > 0
    assert cold == alone and warm == alone
    streamed = list(make_engine(tiny_loaded).stream(target, params))
    assert result_of(streamed[-1]) == alone and len(streamed) > 1


def test_choice_i_of_n_equals_a_single_request_with_its_seed(tiny_loaded: LoadedModel) -> None:
    base = TARGETS["json-seeded"]
    target = prompt(9)
    engine = make_engine(tiny_loaded)
    several = engine.generate([target], SamplingParams(**{**vars(base), "n": 3}))[0]
    for i in range(3):
        single = SamplingParams(**{**vars(base), "seed": derive_choice_seed(base.seed or 0, i)})
        assert result_of(make_engine(tiny_loaded).generate([target], single)[0]) == result_of(several, i)


def test_negative_control_masks_from_another_row_are_detected(tiny_loaded: LoadedModel) -> None:
    """The same comparisons with each constrained row sampled under the next constrained row's mask:
    at least one case must differ, or the invariance test above could not fail."""
    differing = []
    for name in sorted(TARGETS):
        params, target = TARGETS[name], prompt(42, 37)
        alone = result_of(make_engine(tiny_loaded).generate([target], params)[0])
        rotated = make_engine(tiny_loaded, faults=FaultInjection(rotate_grammar_masks=True))
        if run_mixed(rotated, target, params, 8, "middle") != alone:
            differing.append(name)
    assert differing, "rotated masks gave identical results: the invariance test cannot fail"


def test_a_token_its_grammar_rejects_fails_only_its_own_request(tiny_loaded: LoadedModel) -> None:
    """With rotated masks (test-only fault) a row samples a token its own grammar rejects: that request
    ends with finish_reason "error", an unconstrained neighbour keeps its bits, the engine keeps serving."""
    free = SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True, logprobs=2)
    alone = result_of(make_engine(tiny_loaded).generate([prompt(1)], free)[0])
    engine = make_engine(tiny_loaded, faults=FaultInjection(rotate_grammar_masks=True))
    greedy_json = SamplingParams(max_tokens=40, temperature=0.0, structured_output=JSON_SPEC)
    greedy_regex = SamplingParams(max_tokens=20, temperature=0.0, structured_output=REGEX_SPEC)
    outputs = engine.generate([prompt(2), prompt(1), prompt(3)], [greedy_json, free, greedy_regex])
    assert result_of(outputs[1]) == alone
    reasons = [outputs[i].outputs[0].finish_reason for i in (0, 2)]
    assert "error" in reasons and all(outputs[i].error for i in (0, 2) if reasons[i // 2] == "error")
    assert engine.generate([prompt(2)], greedy_json)[0].outputs[0].finish_reason == "stop"
