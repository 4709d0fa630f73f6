"""Structured outputs under speculation: each drafted position is sampled with the grammar mask after
the drafts before it (the matcher consumes them, then rolls back), so constrained requests keep the bits
of plain decoding, alone and beside unconstrained and other constrained requests."""

from __future__ import annotations

import re
from typing import Any

import pytest

from deterministic_inference.engine import spec_verify
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.engine.structured_spec import StructuredOutput
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.engine.test_speculative import accepted, run
from tests.engine.test_structured_engine import CHOICE_SPEC, JSON_SPEC
from tests.tiny_models import TinyModel

REPEAT = r"(ab-|ba-){2,30}"
REPEAT_SPEC = StructuredOutput("regex", REPEAT)
NGRAM = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


def constrained(spec: StructuredOutput, **kwargs: Any) -> SamplingParams:
    settings: dict[str, Any] = {"max_tokens": 40, "logprobs": 2, "structured_output": spec}
    settings.update(kwargs)
    return SamplingParams(**settings)


def test_constrained_speculation_equals_plain(tiny_loaded: LoadedModel) -> None:
    prompt = "ab-ab-ab-ba-ab-ab-ab-ba-ab-ab-ab-ba-"
    cases = [
        constrained(REPEAT_SPEC, temperature=0.0),
        constrained(REPEAT_SPEC, temperature=0.1, seed=5, repetition_penalty=1.1),
        constrained(JSON_SPEC, temperature=1.0, top_p=0.9, seed=11),
        constrained(CHOICE_SPEC, temperature=0.9, min_p=0.05, seed=3, max_tokens=10),
    ]
    unconstrained = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    total = 0
    for params in cases:
        alone = run(tiny_loaded, [prompt], params, None)[0][0]
        got, engine = run(tiny_loaded, [prompt], params, NGRAM)
        assert got[0] == alone, f"alone differs for {params.structured_output}"
        total += accepted(engine)
        mixed, engine = run(
            tiny_loaded, [prompt, prompt + "ab", prompt], [unconstrained, params, params], NGRAM,
            max_num_batched_tokens=9,
        )
        assert mixed[0] == run(tiny_loaded, [prompt], unconstrained, None)[0][0]
        assert mixed[2] == alone
        total += accepted(engine)
        if params.structured_output is REPEAT_SPEC:
            for choice in got[0]:  # (a prefix of) the language: max_tokens may cut it
                assert re.fullmatch(REPEAT if choice[4] == "stop" else "[ab-]*", choice[3]), choice
    assert total > 0, "no draft of a constrained request was accepted: the masks were not exercised"


def test_negative_control_step_mask_only_differs(
    tiny_loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafted rows sampled without their own masks (only row 0 constrained) are detected: the test above
    can fail."""
    prompt = "ab-ab-ab-ba-ab-ab-ab-ba-ab-ab-ab-ba-"
    params = constrained(REPEAT_SPEC, temperature=0.0)
    alone = run(tiny_loaded, [prompt], params, None)[0][0]

    def step_mask_only(chunk: spec_verify.DraftedChunk, first: Any) -> list[Any]:
        return [first] + [None] * len(chunk.drafts)

    monkeypatch.setattr(spec_verify, "_hypothesis_masks", step_mask_only)
    got, _ = run(tiny_loaded, [prompt], params, NGRAM)
    assert got[0] != alone
