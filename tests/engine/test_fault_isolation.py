"""A request that fails inside an engine step (its sampling, its detokenization) fails alone: it ends
with an error and its KV blocks are freed, and every other request in the batch gets exactly the bits
it gets in a run without the failing request (token ids, float32 logprob bits, top logprobs, text).

The faults are injected with `FaultInjection` (a constructor argument; see engine/faults.py). The
negative control runs the same comparison with batch_invariant=False and must find a difference, so the
comparison can detect a change at all.
"""

from __future__ import annotations

import logging
import random
import struct
from typing import Any

import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.faults import FaultInjection
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import LoadedModel, load_model
from tests.tiny_models import TinyModel

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True, logprobs=2)
STOPPED = SamplingParams(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True, stop=("e",))


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: TinyModel) -> LoadedModel:
    return load_model(str(tiny_llama_dir.path))


def bits(value: float | None) -> int | None:
    return None if value is None else int(struct.unpack("<I", struct.pack("<f", value))[0])


def signature(output: RequestOutput) -> tuple[Any, ...]:
    return tuple(
        (
            tuple(c.token_ids),
            tuple(bits(v) for v in c.logprobs),
            tuple(tuple((t, bits(v)) for t, v in step) for step in c.top_logprobs),
            c.text,
            c.finish_reason,
            c.stop_reason,
        )
        for c in output.outputs
    )


def workload(vocab: int, marker: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Twelve prompts (none holds the marker) with greedy, seeded and stop-string params."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, marker) for _ in range(rng.randint(2, 40))] for _ in range(12)]
    params = [(GREEDY, SEEDED, STOPPED)[i % 3] for i in range(12)]
    return prompts, params


def run(
    loaded: LoadedModel,
    prompts: list[list[int]],
    params: list[SamplingParams],
    faults: FaultInjection | None = None,
    batch_invariant: bool = True,
    budget: int = 512,
) -> tuple[list[RequestOutput], Engine]:
    config = EngineConfig(
        dtype="float32",
        batch_invariant=batch_invariant,
        max_num_batched_tokens=budget,
        enable_prefix_caching=False,
        num_kv_blocks=256,
        selfcheck=False,
    )
    engine = Engine(config, loaded=loaded, faults=faults)
    return engine.generate(prompts, params), engine


CASES = [
    # (fault kind, where the failing request goes, its params, scheduler budget)
    ("sample", 0, GREEDY, 512),
    ("sample", 6, SEEDED, 16),
    ("sample", 12, SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3), 512),
    ("detokenize", 0, SEEDED, 512),
    ("detokenize", 5, GREEDY, 7),
    ("detokenize", 12, SamplingParams(max_tokens=6, temperature=0.0, n=2, logprobs=1), 64),
]


def faults_for(kind: str, marker: int) -> FaultInjection:
    if kind == "sample":
        return FaultInjection(fail_sample_token=marker)
    return FaultInjection(fail_detokenize_token=marker)


def compare(
    loaded: LoadedModel, kind: str, position: int, failing: SamplingParams, budget: int, batch_invariant: bool
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], RequestOutput, Engine]:
    """(others without the failing request, others with it, the failing request's output, engine)."""
    marker = loaded.spec.vocab_size - 1
    prompts, params = workload(loaded.spec.vocab_size, marker)
    alone, _ = run(loaded, prompts, params, batch_invariant=batch_invariant, budget=budget)
    bad_prompt = [7, 8, 9, marker, 10, 11]
    mixed_prompts = prompts[:position] + [bad_prompt] + prompts[position:]
    mixed_params = params[:position] + [failing] + params[position:]
    outputs, engine = run(
        loaded, mixed_prompts, mixed_params, faults_for(kind, marker), batch_invariant, budget
    )
    failed = outputs.pop(position)
    return [signature(o) for o in alone], [signature(o) for o in outputs], failed, engine


@pytest.mark.parametrize(("kind", "position", "failing", "budget"), CASES)
def test_a_failing_request_fails_alone_and_changes_no_other_bit(
    tiny_loaded: LoadedModel,
    kind: str,
    position: int,
    failing: SamplingParams,
    budget: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="detinf.engine"):
        alone, mixed, failed, engine = compare(tiny_loaded, kind, position, failing, budget, True)
    assert mixed == alone
    assert failed.finished and failed.error is not None
    assert "Traceback" not in failed.error and ".py" not in failed.error
    stage = "sampling" if kind == "sample" else "detokenizing"
    assert stage in failed.error
    reasons = sorted(c.finish_reason or "" for c in failed.outputs)
    assert reasons[-1] == "error" and set(reasons) <= {"error", "abort"}  # siblings aborted
    assert all(not c.token_ids for c in failed.outputs)  # the failing token is never delivered
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished
    assert any(record.exc_info for record in caplog.records)  # the traceback went to the log


def test_negative_control_plain_ops_show_the_failing_request(tiny_loaded: LoadedModel) -> None:
    """With invariant ops off, the failing request's presence in the batch changes other requests'
    bits in at least one case: the comparison above would see a change."""
    differing = []
    for kind, position, failing, budget in CASES:
        alone, mixed, _, _ = compare(tiny_loaded, kind, position, failing, budget, batch_invariant=False)
        if mixed != alone:
            differing.append((kind, position))
    assert differing, "plain ops gave identical bits everywhere: the isolation test cannot fail"


def test_engine_keeps_serving_after_request_failures(tiny_loaded: LoadedModel) -> None:
    marker = tiny_loaded.spec.vocab_size - 1
    faults = FaultInjection(fail_sample_token=marker, fail_detokenize_token=marker - 1)
    config = EngineConfig(dtype="float32", selfcheck=False, num_kv_blocks=64)
    engine = Engine(config, loaded=tiny_loaded, faults=faults)
    first = engine.generate([[5, marker], [6, marker - 1], [5, 6, 7]], GREEDY)
    assert [o.error is not None for o in first] == [True, True, False]
    again = engine.generate([[5, 6, 7]], GREEDY)[0]
    assert signature(again) == signature(first[2])
    assert engine.kv.num_used_blocks == 0
