"""`Engine.update_weights`: checked, atomic, fingerprinted, only between requests (tiny random Llama).

A refused update (missing tensor, wrong shape, integer tensor, requests in flight, a directory without
readable safetensors) changes nothing: the same request afterwards gives the same bits and the
fingerprint is unchanged. The same weights give the same fingerprint whether pushed in process or read
from a safetensors directory; a one-bit change in one tensor changes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.weight_update import EngineBusyError, read_weights_dir, weights_digest
from deterministic_inference.errors import InvalidRequestError
from deterministic_inference.rl import Policy
from tests.tiny_models import TinyModel

PARAMS = SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 8, 140, 201, 3, 66, 77, 88, 9, 10, 11]  # > 1 KV block of 16


@pytest.fixture()
def engine(tiny_llama_dir: TinyModel) -> Engine:
    return Engine(
        EngineConfig(model=str(tiny_llama_dir.path), quantization="none", num_kv_blocks=64, selfcheck=False)
    )


def signature(engine: Engine) -> tuple[list[int], list[float]]:
    output = engine.generate([PROMPT], PARAMS)[0].outputs[0]
    return list(output.token_ids), list(output.logprobs)


def weights_of(engine: Engine) -> dict[str, torch.Tensor]:
    return Policy.for_engine(engine).engine_weights()


def test_refused_updates_leave_the_old_weights_serving(engine: Engine) -> None:
    before, fingerprint = signature(engine), engine.system_fingerprint
    good = weights_of(engine)
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    wrong_shape = {**good, "model.norm.weight": torch.ones(3)}
    integers = {**good, "model.norm.weight": torch.ones(good["model.norm.weight"].shape, dtype=torch.int64)}
    for bad, needle in ((missing, "missing"), (wrong_shape, "shape"), (integers, "floating-point")):
        with pytest.raises(InvalidRequestError, match=needle):
            engine.update_weights(bad)
    engine.add_request(PROMPT, PARAMS, request_id="in-flight")
    with pytest.raises(EngineBusyError, match="in flight"):
        engine.update_weights(good)
    engine.abort("in-flight")
    assert engine.system_fingerprint == fingerprint
    assert signature(engine) == before


def test_directory_errors_name_the_field_and_no_path(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="model_path: no such directory") as missing:
        read_weights_dir(str(tmp_path / "absent"))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InvalidRequestError, match="no readable safetensors") as corrupt:
        read_weights_dir(str(tmp_path))
    for error in (missing.value, corrupt.value):
        assert str(tmp_path) not in str(error) and error.param == "model_path"


def test_same_weights_same_fingerprint_by_either_path(engine: Engine, tmp_path: Path) -> None:
    policy = Policy.for_engine(engine)
    with torch.no_grad():
        next(iter(policy.parameters())).mul_(1.5)  # any change
    in_process = engine.update_weights(policy.engine_weights())
    after = signature(engine)
    flushed_cache_blocks = engine.kv.num_cached_blocks
    policy.save_weights(tmp_path)
    from_disk = engine.update_weights(read_weights_dir(str(tmp_path)))
    assert from_disk == in_process
    assert engine.kv.num_cached_blocks == 0 < flushed_cache_blocks  # the update flushed the cache
    assert signature(engine) == after


def test_weights_digest_sees_every_bit() -> None:
    weights = {"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.ones(2, 3)}
    flipped = dict(weights, a=torch.tensor([0.0, 0.0, 0.0, -0.0], dtype=torch.bfloat16))
    renamed = {"c": weights["a"], "b": weights["b"]}
    digests = {weights_digest(w) for w in (weights, flipped, renamed)}
    assert len(digests) == 3
    assert weights_digest(weights) == weights_digest(dict(reversed(list(weights.items()))))
