"""Bad inputs give ModelLoadError / UnsupportedArchitectureError naming the path and the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest

from deterministic_inference.errors import ModelLoadError, UnsupportedArchitectureError
from deterministic_inference.model.loader import load_model
from tests.tiny_models import TinyModel, write_gguf


def _copy(tiny: TinyModel, target: Path) -> Path:
    shutil.copytree(tiny.path, target)
    return target


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("model_type", ["gpt_neox", "mamba"])
def test_unknown_hf_architecture(model_type: str, tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(path, model_type=model_type, architectures=["SomethingForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match=model_type) as info:
        load_model(str(path))
    assert "llama, qwen2, qwen3" in str(info.value)


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'.*llama, qwen2, qwen3"):
        load_model(str(path))


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_model(str(tmp_path / "nope.gguf"))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json: file is missing"):
        load_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(path))


@pytest.mark.parametrize("fraction", [0.001, 0.05, 0.5, 0.99])
def test_truncated_gguf(fraction: float, tiny_llama_gguf: TinyModel, tmp_path: Path) -> None:
    data = tiny_llama_gguf.path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: max(4, int(len(data) * fraction))])
    with pytest.raises(ModelLoadError, match="truncated") as info:
        load_model(str(path))
    assert str(path) in str(info.value)


def test_bad_config_json(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    (path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        load_model(str(path))


def test_config_missing_a_field(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    del config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="hidden_size is missing"):
        load_model(str(path))


def test_missing_tokenizer(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file is missing"):
        load_model(str(path))


def test_corrupt_tokenizer(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    (path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: not a valid tokenizer\.json"):
        load_model(str(path))


def test_missing_weights(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(str(path))


def test_corrupt_safetensors(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_model(str(path))


def test_weights_not_matching_config(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(path, num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match="missing.*model.layers.2"):
        load_model(str(path))


def test_sliding_window_is_read_and_bad_layer_types_refused(
    tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    """Mistral's window is implemented (tests/model/test_architectures.py); one no sequence can cross is
    none; Qwen's only under use_sliding_window; layer_types must name every layer."""
    path = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(path, model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=128)
    assert load_model(str(path)).spec.sliding_window == 128
    _edit_config(path, sliding_window=4096)
    assert load_model(str(path)).spec.sliding_window == 0
    _edit_config(path, sliding_window=None)
    assert load_model(str(path)).spec.architecture == "llama"
    _edit_config(path, sliding_window=64, layer_types=["sliding_attention"])
    with pytest.raises(ModelLoadError, match="layer_types must list 2"):
        load_model(str(path))
    _edit_config(path, layer_types=["full_attention", "sliding_attention"])
    assert load_model(str(path)).spec.window_layers == (False, True)
    _edit_config(path, model_type="qwen2", architectures=["Qwen2ForCausalLM"], layer_types=None)
    assert load_model(str(path)).spec.sliding_window == 0  # use_sliding_window is off
    _edit_config(path, use_sliding_window=True, max_window_layers=1)
    assert load_model(str(path)).spec.window_layers == (False, True)


def test_unsupported_rope_scaling(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = _copy(tiny_llama_dir, tmp_path / "m")
    _edit_config(path, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    supported = r"'dynamic' is not supported \(supported: default, linear, llama3, yarn, longrope\)"
    with pytest.raises(ModelLoadError, match=supported):
        load_model(str(path))


def test_gguf_unknown_tokenizer_model_is_refused(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama_dir, tmp_path / "t5.gguf", tokenizer_model="t5").path
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model is 't5'.*'llama'.*Hugging Face directory"):
        load_model(str(path))


def test_gguf_unknown_pre_tokenizer_is_refused(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama_dir, tmp_path / "pre.gguf", pre="made-up").path
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre 'made-up' is not supported.*smollm"):
        load_model(str(path))
