"""SamplingParams validation (one error per field, naming it) and choice seeds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deterministic_inference.engine.sampling_params import SamplingParams, derive_choice_seed
from deterministic_inference.errors import InvalidRequestError

BAD_VALUES = [
    ("n", 0),
    ("n", 1.5),
    ("max_tokens", 0),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.0),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("seed", -1),
    ("seed", 2**63),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("logprobs", -1),
    ("logprobs", 21),
    ("prompt_logprobs", 21),
    ("stop", ("",)),
    ("stop_token_ids", (-1,)),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_invalid_value_names_its_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert info.value.param == field
    assert field in str(info.value)


def test_defaults_and_edges_are_valid() -> None:
    params = SamplingParams()
    assert not params.greedy
    assert SamplingParams(temperature=0).greedy
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, logprobs=0, prompt_logprobs=20, seed=2**63 - 1)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5)


def test_lists_are_frozen_to_tuples_and_hashable() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3])  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(3,)))


def test_choice_seed_single_choice_is_the_request_seed() -> None:
    assert SamplingParams(seed=7).choice_seed(default_seed=0, choice_index=0) == 7
    assert SamplingParams().choice_seed(default_seed=123, choice_index=0) == 123


def test_choice_seeds_for_n_are_derived_distinct_and_pinned() -> None:
    params = SamplingParams(n=4, seed=7)
    seeds = [params.choice_seed(0, i) for i in range(4)]
    assert len(set(seeds)) == 4
    assert all(0 <= s < 2**63 for s in seeds)
    assert seeds == [derive_choice_seed(7, i) for i in range(4)]
    # The default seed is used when the request gives none.
    assert SamplingParams(n=4).choice_seed(7, 2) == seeds[2]
    # Pinned so a change of the derivation is a conscious, visible change.
    assert seeds[0] == 7580453152461513500
    with pytest.raises(InvalidRequestError):
        params.choice_seed(0, 4)


def test_choice_seed_is_stable_across_hash_seeds() -> None:
    code = (
        "from deterministic_inference.engine.sampling_params import derive_choice_seed;"
        "print([derive_choice_seed(7, i) for i in range(4)])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": hash_seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for hash_seed in ("0", "12345")
    }
    assert outputs == {str([derive_choice_seed(7, i) for i in range(4)]) + "\n"}
