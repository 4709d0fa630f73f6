"""Engine invariance on the real default model (SmolLM2-135M-Instruct Q4_1, bf16 where native)."""

from __future__ import annotations

import random
import struct

import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.outputs import RequestOutput
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=2024, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None)


def signature(output: RequestOutput) -> tuple[tuple[int, ...], tuple[int, ...]]:
    choice = output.outputs[0]
    return tuple(choice.token_ids), tuple(
        struct.unpack("<I", struct.pack("<f", v))[0] for v in choice.logprobs
    )


def batch_result(
    loaded: LoadedModel, target: str, params: SamplingParams, others: int, budget: int, invariant: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    config = EngineConfig(
        batch_invariant=invariant, max_num_batched_tokens=budget, enable_prefix_caching=False, selfcheck=False
    )
    engine = Engine(config, loaded=loaded)
    rng = random.Random(others)
    words = "the of river code model light quick brown fox jumps over lazy dog stream token".split()
    fillers = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 40))) for _ in range(others)]
    prompts = fillers[: others // 2] + [target] + fillers[others // 2 :]
    params_list = [SamplingParams(max_tokens=8, temperature=0.7, seed=1, ignore_eos=True)] * len(prompts)
    params_list[others // 2] = params
    return signature(engine.generate(prompts, params_list)[others // 2])


TARGET = "Write a short poem about the sea and the wind."


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_smollm2_alone_equals_in_batch(smollm2: LoadedModel, params: SamplingParams) -> None:
    alone = batch_result(smollm2, TARGET, params, others=0, budget=512, invariant=True)
    assert batch_result(smollm2, TARGET, params, others=8, budget=16, invariant=True) == alone
    assert batch_result(smollm2, TARGET, params, others=3, budget=64, invariant=True) == alone


def test_smollm2_negative_control(smollm2: LoadedModel) -> None:
    alone = batch_result(smollm2, TARGET, GREEDY, others=0, budget=512, invariant=False)
    batched = [
        batch_result(smollm2, TARGET, GREEDY, others=n, budget=b, invariant=False)
        for n, b in ((8, 16), (3, 64))
    ]
    assert any(result != alone for result in batched)
