"""HF directory loading: llama / qwen2 / qwen3 tiny models, sharded weights, config variants."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from deterministic_inference.model.loader import load_model
from deterministic_inference.model_spec import RopeScaling
from tests.tiny_models import TinyModel


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_weights_equal_the_transformers_state_dict(fixture: str, request: pytest.FixtureRequest) -> None:
    tiny: TinyModel = request.getfixturevalue(fixture)
    loaded = load_model(str(tiny.path))
    reference = tiny.state_dict
    assert loaded.source == "hf" and loaded.name == tiny.path.name
    assert set(loaded.weights) == set(reference)
    for name, tensor in reference.items():
        got = loaded.weights[name]
        assert isinstance(got, torch.Tensor), name  # unquantized checkpoint: dense tensors only
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert _same_bits(got, tensor), name


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_spec_fields_come_from_config(fixture: str, request: pytest.FixtureRequest) -> None:
    tiny: TinyModel = request.getfixturevalue(fixture)
    spec = load_model(str(tiny.path)).spec
    cfg = tiny.model.config
    assert spec.architecture == tiny.architecture
    assert spec.vocab_size == cfg.vocab_size and spec.hidden_size == cfg.hidden_size == 64
    assert spec.intermediate_size == 128 and spec.num_layers == 2
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.group_size) == (4, 2, 16, 2)
    assert spec.rms_norm_eps == 1e-5 and spec.rope_theta == 100000.0
    assert spec.max_position_embeddings == 512 and spec.rope_scaling is None
    assert spec.tie_word_embeddings == cfg.tie_word_embeddings
    assert spec.attention_bias == (tiny.architecture == "qwen2")
    assert spec.qk_norm == (tiny.architecture == "qwen3")
    assert spec.eos_token_ids == (2,)
    assert spec.bos_token_id == (0 if tiny.architecture == "llama" else None)


def test_artifacts_list_every_file_read(tiny_llama_dir: TinyModel) -> None:
    names = [p.name for p in load_model(str(tiny_llama_dir.path)).artifacts]
    assert names == sorted(names)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert name in names


def test_sharded_checkpoint(tiny_qwen2_dir: TinyModel, tmp_path: Path) -> None:
    target = tmp_path / "sharded"
    tiny_qwen2_dir.model.save_pretrained(str(target), max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen2_dir.path / name, target / name)
    shards = sorted(target.glob("*.safetensors"))
    assert len(shards) > 1 and (target / "model.safetensors.index.json").is_file()
    loaded = load_model(str(target))
    for name, tensor in tiny_qwen2_dir.state_dict.items():
        got = loaded.weights[name]
        assert isinstance(got, torch.Tensor), name  # unquantized checkpoint: dense tensors only
        assert _same_bits(got, tensor), name
    assert set(shards) <= set(loaded.artifacts)


def _copy_with_config(tiny: TinyModel, target: Path, **changes: object) -> Path:
    shutil.copytree(tiny.path, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_llama3_rope_scaling_and_legacy_rope_theta(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    path = _copy_with_config(
        tiny_llama_dir, tmp_path / "m", rope_parameters=None, rope_theta=500000.0, rope_scaling=scaling
    )
    spec = load_model(str(path)).spec
    assert spec.rope_theta == 500000.0
    assert spec.rope_scaling == RopeScaling("llama3", 8.0, 128, low_freq_factor=1.0, high_freq_factor=4.0)


def test_generation_config_eos_ids_are_added(tiny_qwen3_dir: TinyModel, tmp_path: Path) -> None:
    path = tmp_path / "m"
    shutil.copytree(tiny_qwen3_dir.path, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert load_model(str(path)).tokenizer.eos_token_ids == (0, 2)


def test_bfloat16_weights_load_as_stored(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    """A bf16 checkpoint stays bf16 in memory (the model casts to --dtype when it is built)."""
    path = tmp_path / "bf16"
    copy.deepcopy(tiny_llama_dir.model).to(torch.bfloat16).save_pretrained(str(path))  # the fixture is shared
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir.path / name, path / name)
    loaded = load_model(str(path))
    for name, tensor in tiny_llama_dir.state_dict.items():
        got = loaded.weights[name]
        assert isinstance(got, torch.Tensor), name  # unquantized checkpoint: dense tensors only
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, tensor.to(torch.bfloat16)), name
