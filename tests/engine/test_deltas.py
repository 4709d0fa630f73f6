"""The engine step emits per-step deltas (only what is new); folded, they are exactly the full outputs.
Sequences carry their parent request and choice index."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.outputs import OutputAssembler, RequestDelta, RequestOutput, merge_deltas
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.tiny_models import TinyModel

PARAMS = [
    SamplingParams(max_tokens=9, temperature=0.0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.9, seed=4, n=3, logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.7, seed=2, stop=("e", "th"), prompt_logprobs=1),
]
PROMPTS = [[5, 6, 7], [40, 41, 42, 43], [0, 50, 60, 70, 80]]


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


def engine_of(loaded: LoadedModel, **settings: Any) -> Engine:
    config = EngineConfig(dtype="float32", selfcheck=False, num_kv_blocks=64, **settings)
    return Engine(config, loaded=loaded)


def bits(value: float | None) -> int | None:
    return None if value is None else int(struct.unpack("<I", struct.pack("<f", value))[0])


def signature(output: RequestOutput) -> tuple[Any, ...]:
    choices = tuple(
        (c.index, tuple(c.token_ids), tuple(map(bits, c.logprobs)), str(c.top_logprobs), c.text)
        + (c.finish_reason, c.stop_reason)
        for c in output.outputs
    )
    prompt = None if output.prompt_logprobs is None else tuple(map(bits, output.prompt_logprobs))
    return output.request_id, tuple(output.prompt_token_ids), prompt, choices, output.num_cached_tokens


def all_deltas(engine: Engine) -> list[RequestDelta]:
    deltas = []
    for prompt, params in zip(PROMPTS, PARAMS, strict=True):
        engine.add_request(prompt, params)
    while engine.has_unfinished:
        deltas.extend(engine.step_deltas())
    return deltas


def test_deltas_hold_only_the_new_tokens_and_fold_into_the_generate_outputs(tiny_loaded: LoadedModel) -> None:
    expected = engine_of(tiny_loaded).generate(PROMPTS, PARAMS)
    deltas = all_deltas(engine_of(tiny_loaded))
    assemblers: dict[str, OutputAssembler] = {}
    for delta in deltas:
        assert all(len(piece.token_ids) <= 1 for piece in delta.outputs)  # one step: at most one token each
        if delta.request_id not in assemblers:
            assert delta.prompt is not None  # the first delta of a request carries the prompt data
            assemblers[delta.request_id] = OutputAssembler(delta)
        else:
            assert delta.prompt is None
            assemblers[delta.request_id].add(delta)
    finished = [d.request_id for d in deltas if d.finished]
    assert sorted(finished) == sorted(assemblers)  # each request finishes exactly once
    folded = [assemblers[f"req-{i}"].output() for i in range(len(PROMPTS))]
    assert [signature(o) for o in folded] == [signature(o) for o in expected]


def test_merged_deltas_fold_to_the_same_output(tiny_loaded: LoadedModel) -> None:
    deltas = [d for d in all_deltas(engine_of(tiny_loaded)) if d.request_id == "req-1"]
    one_by_one = OutputAssembler(deltas[0])
    for delta in deltas[1:]:
        one_by_one.add(delta)
    merged = deltas[0]
    for delta in deltas[1:]:
        merged = merge_deltas(merged, delta)
    assert signature(OutputAssembler(merged).output()) == signature(one_by_one.output())


def test_sequences_carry_their_parent_and_choice_index(tiny_loaded: LoadedModel) -> None:
    engine = engine_of(tiny_loaded)
    request_id = engine.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=2))
    sequences = list(engine.scheduler.sequences.values())
    assert [s.choice_index for s in sequences] == [0, 1, 2]
    assert {s.parent.request_id for s in sequences} == {request_id}
    assert sequences[0].parent.sequences == sequences


def test_step_outputs_grow_and_stream_matches_generate(tiny_loaded: LoadedModel) -> None:
    """The offline `step()` keeps returning full outputs (assembled from the deltas)."""
    engine = engine_of(tiny_loaded)
    request_id = engine.add_request(PROMPTS[1], PARAMS[1])
    seen = []
    while engine.has_unfinished:
        seen += [o for o in engine.step() if o.request_id == request_id]
    lengths = [sum(len(c.token_ids) for c in o.outputs) for o in seen]
    assert lengths == sorted(lengths) and seen[-1].finished
    expected = engine_of(tiny_loaded).generate([PROMPTS[1]], PARAMS[1])[0]
    assert signature(seen[-1])[1:] == signature(expected)[1:]
