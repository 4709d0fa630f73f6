"""Mixture-of-experts models against transformers (tiny random Qwen3-MoE, Mixtral, Qwen2-MoE with a shared
expert; fp32): logits close in both backends, from the HF directory and from a GGUF file of the same
weights (3-D expert stacks), and greedy tokens equal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.loader import load_model
from deterministic_inference.ops.quant import QuantizedWeight
from tests.model.test_llama_numerics import prefill_logits
from tests.moe_models import write_moe_gguf
from tests.tiny_models import TinyModel

FIXTURES = ["tiny_qwen3_moe_dir", "tiny_mixtral_dir", "tiny_qwen2_moe_dir"]


def reference_logits(tiny: TinyModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("fixture", FIXTURES)
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_logits_match_transformers(
    fixture: str, batch_invariant: bool, request: pytest.FixtureRequest
) -> None:
    tiny: TinyModel = request.getfixturevalue(fixture)
    loaded = load_model(str(tiny.path))
    assert loaded.spec.architecture == tiny.architecture and loaded.spec.is_moe
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, batch_invariant, 8), 512)
    token_ids = torch.randint(3, loaded.spec.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
    ours = prefill_logits(model, token_ids.tolist())
    torch.testing.assert_close(ours, reference_logits(tiny, token_ids.tolist()), rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_gguf_f32_file_matches_transformers(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The same weights written as a GGUF file (3-D ffn_*_exps stacks, ffn_gate_inp, Mixtral as llama with
    permuted q/k): the spec equals the HF one and the logits stay close."""
    tiny: TinyModel = request.getfixturevalue(fixture)
    gguf_path = write_moe_gguf(tiny, tmp_path / f"{tiny.architecture}.F32.gguf")
    hf, loaded = load_model(str(tiny.path)), load_model(str(gguf_path))
    ignored = {"bos_token_id", "eos_token_ids"}
    assert {k: v for k, v in vars(loaded.spec).items() if k not in ignored} == {
        k: v for k, v in vars(hf.spec).items() if k not in ignored
    }
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    token_ids = torch.randint(
        3, loaded.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    torch.testing.assert_close(
        prefill_logits(model, token_ids), reference_logits(tiny, token_ids), rtol=1e-5, atol=3e-5
    )


def test_quantized_experts_stay_views_on_the_file(tiny_qwen3_moe_dir: TinyModel, tmp_path: Path) -> None:
    """Q8_0 experts: each expert's weight is a QuantizedWeight whose bytes lie inside the 3-D stack of the
    memory map (no copy), and the logits stay near the fp32 reference."""
    path = write_moe_gguf(tiny_qwen3_moe_dir, tmp_path / "moe.Q8_0.gguf", quant="Q8_0")
    loaded = load_model(str(path))
    first = loaded.weights["model.layers.0.mlp.experts.0.gate_proj.weight"]
    second = loaded.weights["model.layers.0.mlp.experts.1.gate_proj.weight"]
    assert isinstance(first, QuantizedWeight) and isinstance(second, QuantizedWeight)
    # consecutive in the 3-D stack as stored: views on the map, not copies
    assert second.data.data_ptr() - first.data.data_ptr() == first.data.numel()
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    assert {fmt for name, fmt in model.weight_formats.items() if ".experts." in name} == {"q8_0"}
    token_ids = list(range(3, 43))
    torch.testing.assert_close(
        prefill_logits(model, token_ids),
        reference_logits(tiny_qwen3_moe_dir, token_ids),
        rtol=0.05,
        atol=0.05,
    )


@pytest.mark.parametrize("fixture", FIXTURES)
def test_greedy_tokens_equal_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    tiny: TinyModel = request.getfixturevalue(fixture)
    loaded = load_model(str(tiny.path))
    engine = Engine(EngineConfig(dtype="float32", selfcheck=False), loaded=loaded)
    prompts = [[5, 17, 42, 99, 7], list(range(3, 40))]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    tiny.model.generation_config.eos_token_id = None
    tiny.model.generation_config.pad_token_id = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()
