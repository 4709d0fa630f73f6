"""Rope scaling end to end, per variant (tests/rope_models.py): Llama 3.1 style (HF llama3 / GGUF
rope_freqs.weight), YaRN (Qwen2), linear (Llama; Gemma 3's global layers), LongRoPE (Phi-3), each loaded
from its HF directory and from a GGUF file with the scaling in llama.cpp's form, against transformers:
logits of a 150-token prompt (positions past original_max_position_embeddings 64) close in fp32, greedy
tokens equal; the unscaled rotation leaves the tolerance (negative control). Also the one-line refusals
and the fingerprint naming the variant.

Tolerance: the architecture tests' (|ours - HF| <= 3e-5 + 1e-5 |HF|).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.loader import load_model
from deterministic_inference.model_spec import ROPE_SCALING_TYPES, RopeScaling
from tests.model.test_llama_numerics import prefill_logits
from tests.rope_models import (
    ORIGINAL,
    PROMPT_LEN,
    VARIANTS,
    build_scaled_hf,
    gguf_rope_extra,
    reference_logits,
    write_scaled_gguf,
)
from tests.tiny_models import TinyModel

RTOL, ATOL = 1e-5, 3e-5


@pytest.fixture(scope="module", params=list(VARIANTS))
def scaled(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, TinyModel, Path]:
    variant = request.param
    directory = tmp_path_factory.mktemp(f"rope-{variant}")
    tiny = build_scaled_hf(directory / "hf", variant)
    return variant, tiny, write_scaled_gguf(tiny, variant, directory / f"{variant}.F32.gguf")


@pytest.fixture(scope="module")
def linear_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scaled_hf(tmp_path_factory.mktemp("rope-linear"), "linear").path


def prompt(vocab: int, count: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    return torch.randint(3, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_logits_match_transformers(
    scaled: tuple[str, TinyModel, Path], source: str, batch_invariant: bool
) -> None:
    variant, tiny, gguf_path = scaled
    loaded = load_model(str(tiny.path if source == "hf" else gguf_path))
    scaling = loaded.spec.rope_scaling
    assert scaling is not None and scaling.rope_type == VARIANTS[variant][1]["rope_type"]
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, batch_invariant, 8), 512)
    token_ids = prompt(loaded.spec.vocab_size)
    torch.testing.assert_close(
        prefill_logits(model, token_ids), reference_logits(tiny, token_ids), rtol=RTOL, atol=ATOL
    )


def test_unscaled_rotation_is_detected(scaled: tuple[str, TinyModel, Path]) -> None:
    """Negative control: the same weights with plain RoPE leave the tolerance, from either file."""
    _, tiny, gguf_path = scaled
    for path in (tiny.path, gguf_path):
        loaded = load_model(str(path))
        spec = dataclasses.replace(loaded.spec, rope_scaling=None)
        model = DecoderModel(spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
        token_ids = prompt(spec.vocab_size)
        assert (prefill_logits(model, token_ids) - reference_logits(tiny, token_ids)).abs().max() > 10 * ATOL


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_equal_transformers(scaled: tuple[str, TinyModel, Path], source: str) -> None:
    _, tiny, gguf_path = scaled
    loaded = load_model(str(tiny.path if source == "hf" else gguf_path))
    engine = Engine(EngineConfig(dtype="float32", selfcheck=False), loaded=loaded)
    token_ids = prompt(loaded.spec.vocab_size, 100, seed=3)
    output = engine.generate([token_ids], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    tiny.model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = tiny.model.generate(
            torch.tensor([token_ids]), max_new_tokens=24, do_sample=False, pad_token_id=0
        )
    assert output.outputs[0].token_ids == expected[0, len(token_ids) :].tolist()


def test_longrope_short_context_uses_short_factors(tmp_path: Path) -> None:
    """Built for a context of ORIGINAL positions, a LongRoPE model rotates with the short factors: HF's
    choice for every sequence that fits the original context (and the fingerprint says which)."""
    tiny = build_scaled_hf(tmp_path / "phi3", "longrope")
    loaded = load_model(str(tiny.path))
    short = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, True, 8), ORIGINAL)
    long = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    assert "rope_longrope_short" in short.model_ops and "rope_longrope_long" in long.model_ops
    token_ids = prompt(loaded.spec.vocab_size, ORIGINAL, seed=4)
    reference = reference_logits(tiny, token_ids)
    torch.testing.assert_close(prefill_logits(short, token_ids), reference, rtol=RTOL, atol=ATOL)
    assert (prefill_logits(long, token_ids) - reference).abs().max() > 10 * ATOL


def test_fingerprint_names_the_scaling(tmp_path: Path) -> None:
    """A scaled model's fingerprint names its rope variant and differs from the same weights unscaled."""
    tiny = build_scaled_hf(tmp_path / "yarn", "yarn")
    plain = tmp_path / "plain"
    shutil.copytree(tiny.path, plain)
    config = json.loads((plain / "config.json").read_text())
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
    (plain / "config.json").write_text(json.dumps(config))
    config_ = EngineConfig(dtype="float32", selfcheck=False)
    scaled_engine, plain_engine = (
        Engine(config_, loaded=load_model(str(tiny.path))),
        Engine(config_, loaded=load_model(str(plain))),
    )
    assert scaled_engine.fingerprint["numerics"]["model_ops"] == ["rope_yarn"]
    assert "model_ops" not in plain_engine.fingerprint["numerics"]
    assert scaled_engine.system_fingerprint != plain_engine.system_fingerprint


@pytest.mark.parametrize("variant", ["llama3", "yarn", "linear"])
def test_legacy_rope_scaling_key_reads_as_rope_parameters(variant: str, tmp_path: Path) -> None:
    """Older config.json files (Qwen2.5, Llama 3.1) hold the same dict as `rope_scaling` with `type`."""
    tiny = build_scaled_hf(tmp_path / "hf", variant)
    path = tmp_path / "legacy"
    shutil.copytree(tiny.path, path)
    config = json.loads((path / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    rope["type"] = rope.pop("rope_type")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    assert load_model(str(path)).spec == load_model(str(tiny.path)).spec


@pytest.mark.parametrize("variant", ["yarn", "linear", "gemma3-linear"])
def test_gguf_spec_equals_hf_spec(variant: str, tmp_path: Path) -> None:
    """YaRN and linear files state the HF parameters themselves (llama3 from GGUF is its divisors,
    LongRoPE its fp32 factor tensors: the logits tests cover those)."""
    tiny = build_scaled_hf(tmp_path / "hf", variant)
    gguf_path = write_scaled_gguf(tiny, variant, tmp_path / "scaled.gguf")
    assert load_model(str(gguf_path)).spec.rope_scaling == load_model(str(tiny.path)).spec.rope_scaling


def _edit(directory: Path, source: Path, **changes: object) -> Path:
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic' is not supported \(supported: default, linear"),
        ({"rope_type": "linear"}, "linear rope scaling is incomplete or invalid"),
        ({"rope_type": "llama3", "factor": 8.0}, "llama3 rope scaling is incomplete or invalid"),
        ({"rope_type": "yarn", "factor": -2.0}, "yarn rope scaling factors must be > 0"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8},
            "short_factor has 3",
        ),
    ],
)
def test_hf_refusals(linear_dir: Path, tmp_path: Path, rope: dict[str, object], message: str) -> None:
    path = _edit(tmp_path / "bad", linear_dir, rope_parameters={"rope_theta": 100000.0, **rope})
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path))


def test_gemma3_scaled_local_layers_are_refused(tmp_path: Path) -> None:
    tiny = build_scaled_hf(tmp_path / "g", "gemma3-linear")
    config = json.loads((tiny.path / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    (tiny.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"sliding_attention\) rope_type 'linear' is not supported"):
        load_model(str(tiny.path))


def test_gguf_refusals(tmp_path: Path) -> None:
    """Types and key values llama.cpp's files may carry that change the rotation otherwise: one line each."""
    tiny = build_scaled_hf(tmp_path / "hf", "yarn")
    yarn_keys = gguf_rope_extra("yarn", "qwen2")
    cases: dict[str, tuple[Callable[[Any], object], str]] = {
        "longrope-keys": (
            lambda writer: writer.add_string("qwen2.rope.scaling.type", "longrope"),
            "'longrope' .* is not supported",
        ),
        "log-multiplier": (
            lambda writer: (
                yarn_keys(writer),
                writer.add_float32("qwen2.rope.scaling.yarn_log_multiplier", 0.1),
            ),
            "yarn_log_multiplier 0.1 is not supported",
        ),
        "freqs-and-type": (
            lambda writer: (
                yarn_keys(writer),
                writer.add_tensor("rope_freqs.weight", np.ones(8, np.float32)),
            ),
            "rope_freqs.weight together with qwen2.rope.scaling.type 'yarn' is not supported",
        ),
        "freqs-zero": (
            lambda writer: writer.add_tensor("rope_freqs.weight", np.zeros(8, np.float32)),
            "rope_freqs.weight holds a factor that is not finite and > 0",
        ),
        "freqs-shape": (
            lambda writer: writer.add_tensor("rope_freqs.weight", np.ones(5, np.float32)),
            r"rope_freqs.weight must be a float vector of 8 \(head_dim / 2\), got \(5,\)",
        ),
    }
    for name, (extra, message) in cases.items():
        path = write_scaled_gguf(tiny, "yarn", tmp_path / f"{name}.gguf", extra=extra)
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(path))


def test_gemma3_legacy_config_scales_the_global_layers_only(tmp_path: Path) -> None:
    """The Hub's Gemma 3 4B+ config.json: rope_scaling (linear 8) with rope_theta and rope_local_base_freq
    at the top level, read as transformers reads it (the global layers scaled, the local base kept)."""
    tiny = build_scaled_hf(tmp_path / "g", "gemma3-linear")
    config = json.loads((tiny.path / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1e6, rope_local_base_freq=1e4
    )
    legacy = _edit(tmp_path / "legacy", tiny.path)
    (legacy / "config.json").write_text(json.dumps(config))
    spec = load_model(str(legacy)).spec
    assert spec == load_model(str(tiny.path)).spec
    assert (spec.rope_theta, spec.rope_local_theta, spec.rope_scaling) == (
        1e6,
        1e4,
        RopeScaling("linear", 8.0),
    )


def test_the_architecture_page_lists_every_scaling_type() -> None:
    page = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    for kind in ROPE_SCALING_TYPES:
        assert f"| `{kind}`" in page, kind


def test_yarn_extends_the_servable_context(tmp_path: Path) -> None:
    """Qwen2.5's files keep max_position_embeddings at the pre-training context (32768) and reach 131072
    through YaRN factor 4: the spec's context is original * factor, so --max-model-len can use it."""
    tiny = build_scaled_hf(tmp_path / "hf", "yarn")  # factor 8, original ORIGINAL
    path = _edit(tmp_path / "short", tiny.path, max_position_embeddings=ORIGINAL)
    assert load_model(str(path)).spec.max_position_embeddings == 8 * ORIGINAL
    plain = _edit(tmp_path / "plain", tiny.path, max_position_embeddings=ORIGINAL, rope_parameters=None)
    assert load_model(str(plain)).spec.max_position_embeddings == ORIGINAL
