"""The benchmarks' bf16 HF copy of a model file (bench/hf_copy.py): every weight is the file's, dequantised
and rounded once to bf16, bit for bit; our loader and transformers both read the directory, and ours
generates from it. A copy of another file differs (the comparison can fail)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.hf_copy import main, write_bf16_hf_dir
from bench.make_gguf import LlamaShape, write_llama_gguf
from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.loader import load_model
from deterministic_inference.ops.weights import dense
from tests.ops.helpers import bits

SMALL = LlamaShape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, context=512)


@pytest.fixture(scope="module")
def q4_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "small-q4_0.gguf", SMALL, "Q4_0", seed=3)


def test_the_copy_holds_the_files_weights_in_bf16(q4_file: Path, tmp_path: Path) -> None:
    source = load_model(str(q4_file))
    copy = load_model(str(write_bf16_hf_dir(source, tmp_path / "hf")))
    assert copy.spec.vocab_size == source.spec.vocab_size and copy.spec.num_layers == SMALL.layers
    assert sorted(copy.weights) == sorted(source.weights)
    for name, weight in source.weights.items():
        copied = copy.weights[name]
        assert isinstance(copied, torch.Tensor) and copied.dtype == torch.bfloat16, name
        assert torch.equal(bits(copied), bits(dense(weight, torch.bfloat16))), name


def test_negative_control_another_files_copy_differs(q4_file: Path, tmp_path: Path) -> None:
    other = write_llama_gguf(tmp_path / "other.gguf", SMALL, "Q4_0", seed=4)
    copy = load_model(str(write_bf16_hf_dir(load_model(str(other)), tmp_path / "hf")))
    name = "model.layers.0.mlp.down_proj.weight"
    expected = dense(load_model(str(q4_file)).weights[name], torch.bfloat16)
    copied = copy.weights[name]
    assert isinstance(copied, torch.Tensor) and not torch.equal(bits(copied), bits(expected))


def test_transformers_and_our_engine_run_the_copy(q4_file: Path, tmp_path: Path) -> None:
    import transformers

    hf_dir = write_bf16_hf_dir(load_model(str(q4_file)), tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16)
    down = model.model.layers[1].mlp.down_proj.weight.detach()
    ours = load_model(str(hf_dir)).weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(ours, torch.Tensor) and torch.equal(bits(down), bits(ours))
    engine = Engine(EngineConfig(selfcheck=False), loaded=load_model(str(hf_dir)))
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_the_command_refuses_a_directory_that_holds_a_model(q4_file: Path, tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    import sys

    argv = sys.argv
    sys.argv = ["hf_copy", "--model", str(q4_file), "--out", str(tmp_path / "hf")]
    try:
        with pytest.raises(SystemExit, match="--out: .* already holds a model"):
            main()
    finally:
        sys.argv = argv
