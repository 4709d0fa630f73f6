"""Bad input to the engine: a clear InvalidRequestError naming the field; the engine keeps serving."""

from __future__ import annotations

from typing import Any

import pytest

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import ConfigError, InvalidRequestError
from deterministic_inference.model.loader import load_model
from tests.tiny_models import TinyModel


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: TinyModel) -> Engine:
    config = EngineConfig(dtype="float32", max_model_len=64, selfcheck=False)
    return Engine(config, loaded=load_model(str(tiny_llama_dir.path)))


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        (list(range(3, 80)), SamplingParams(max_tokens=4), "prompt"),
        (list(range(3, 40)), SamplingParams(max_tokens=40), "max_tokens"),
        ([], SamplingParams(max_tokens=4), "prompt"),
        ([5, 10_000], SamplingParams(max_tokens=4), "prompt"),
        ([5, -1], SamplingParams(max_tokens=4), "prompt"),
    ],
    ids=["prompt-longer-than-context", "prompt-plus-max-tokens", "empty", "id-outside-vocab", "negative-id"],
)
def test_bad_request_is_refused_and_engine_keeps_serving(
    engine: Engine, prompt: list[int], params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(prompt, params)
    assert error.value.param == param
    assert not engine.has_unfinished
    output = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert len(output.outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("max_tokens", -5), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5)],
)
def test_bad_sampling_params_name_the_field(field: str, value: float) -> None:
    bad_fields: dict[str, Any] = {field: value}  # Any: the field is chosen at run time
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**bad_fields)
    assert error.value.param == field
    assert field in str(error.value)


@pytest.mark.parametrize(
    ("field", "value"), [("dtype", "float16"), ("max_num_seqs", 0), ("kv_block_size", -1)]
)
def test_bad_engine_config_names_the_field(field: str, value: object) -> None:
    bad_fields: dict[str, Any] = {field: value}  # Any: the field and a deliberately bad value of any type
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**bad_fields)


def test_stop_strings_cut_text_and_n_choices_use_derived_seeds(engine: Engine) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3, ignore_eos=True)
    output = engine.generate([[5, 6, 7]], params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    for choice in output.outputs:
        single = SamplingParams(
            max_tokens=8, temperature=1.0, seed=params.choice_seed(0, choice.index), ignore_eos=True
        )
        alone = engine.generate([[5, 6, 7]], single)[0].outputs[0]
        assert alone.token_ids == choice.token_ids
    text = output.outputs[0].text
    if len(text) > 2:
        stop = text[1:3]
        cut = engine.generate(
            [[5, 6, 7]],
            SamplingParams(
                max_tokens=8, temperature=1.0, seed=params.choice_seed(0, 0), stop=(stop,), ignore_eos=True
            ),
        )[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == text[: text.index(stop)]


def test_stream_yields_growing_outputs_ending_with_generate_result(engine: Engine) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[5, 6, 7]], params)[0].outputs[0]
    seen = list(engine.stream([5, 6, 7], params))
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert seen[-1].outputs[0].token_ids == expected.token_ids
    assert seen[-1].outputs[0].text == expected.text
