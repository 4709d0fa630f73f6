"""Mistral, Phi-3, Gemma 3 and Gemma 2 against transformers: tiny random models with a sliding window of
24 keys (crossed by every prompt here; Gemma 3: five windowed layers with a local rope base, then a
global one), loaded from their HF directory and from a GGUF file written with llama.cpp's tensor names
and keys (Mistral as `llama`, Phi-3 as `phi3` with fused attn_qkv / ffn_up, Gemma 3 / 2 as `gemma3` /
`gemma2` with 1 + w norms; Gemma 2 soft-caps scores and logits, its caps made small enough to matter).

Tolerance (fp32 model, both backends): |ours - HF| <= 3e-5 + 1e-5 |HF| per logit, the bound the Llama and
MoE numerics tests use: the same operations in another summation order differ by a few ulps per op.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.decoder import DecoderModel, Numerics
from deterministic_inference.model.loader import load_model
from tests.arch_models import TEMPLATES, WINDOW, build_arch_hf, write_arch_gguf
from tests.model.test_llama_numerics import prefill_logits
from tests.tiny_models import TinyModel

ARCHITECTURES = ["mistral", "phi3", "gemma3", "gemma2"]
RTOL, ATOL = 1e-5, 3e-5


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny_arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return build_arch_hf(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)


@pytest.fixture(scope="module")
def tiny_arch_gguf(tiny_arch: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_arch_gguf(
        tiny_arch, tmp_path_factory.mktemp("gguf") / f"tiny-{tiny_arch.architecture}.F32.gguf"
    )


def reference_logits(tiny: TinyModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return tiny.model(torch.tensor([token_ids])).logits[0].float()


def random_ids(vocab: int, count: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("batch_invariant", [True, False])
def test_logits_match_transformers(
    tiny_arch: TinyModel, tiny_arch_gguf: Path, source: str, batch_invariant: bool
) -> None:
    loaded = load_model(str(tiny_arch.path if source == "hf" else tiny_arch_gguf))
    expected = "llama" if tiny_arch.architecture == "mistral" else tiny_arch.architecture
    assert loaded.spec.architecture == expected and loaded.spec.sliding_window == WINDOW
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, batch_invariant, 8), 512)
    token_ids = random_ids(loaded.spec.vocab_size, 70, seed=1)  # 70 keys: the window slides 46 times
    torch.testing.assert_close(
        prefill_logits(model, token_ids), reference_logits(tiny_arch, token_ids), rtol=RTOL, atol=ATOL
    )


def test_gguf_spec_equals_hf_spec(tiny_arch: TinyModel, tiny_arch_gguf: Path) -> None:
    hf, gguf = load_model(str(tiny_arch.path)), load_model(str(tiny_arch_gguf))
    assert dataclasses.replace(gguf.spec, rope_theta=hf.spec.rope_theta) == hf.spec


def test_ignoring_the_window_is_detected(tiny_arch: TinyModel) -> None:
    """Negative control: the same weights without the window match HF on the first WINDOW positions only,
    so the comparison above does see the window."""
    loaded = load_model(str(tiny_arch.path))
    spec = dataclasses.replace(loaded.spec, sliding_window=0)
    model = DecoderModel(spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    token_ids = random_ids(loaded.spec.vocab_size, 70, seed=1)
    ours, reference = prefill_logits(model, token_ids), reference_logits(tiny_arch, token_ids)
    torch.testing.assert_close(ours[:WINDOW], reference[:WINDOW], rtol=RTOL, atol=ATOL)
    assert (ours[WINDOW:] - reference[WINDOW:]).abs().max() > 1e-3


def test_chat_template_comes_from_the_file(tiny_arch: TinyModel, tiny_arch_gguf: Path) -> None:
    for path in (tiny_arch.path, tiny_arch_gguf):
        assert load_model(str(path)).tokenizer.chat_template == TEMPLATES[tiny_arch.architecture]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_greedy_tokens_equal_transformers(tiny_arch: TinyModel, tiny_arch_gguf: Path, source: str) -> None:
    """Prompt and generation cross the window: HF's generate (sliding-window cache) gives the same tokens."""
    loaded = load_model(str(tiny_arch.path if source == "hf" else tiny_arch_gguf))
    engine = Engine(EngineConfig(dtype="float32", selfcheck=False), loaded=loaded)
    prompts = [random_ids(loaded.spec.vocab_size, 5, seed=2), random_ids(loaded.spec.vocab_size, 37, seed=3)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = tiny_arch.model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()


def test_quantized_phi3_keeps_fused_tensors_as_stored(tmp_path: Path) -> None:
    tiny = build_arch_hf(tmp_path / "phi3", "phi3")
    loaded = load_model(str(write_arch_gguf(tiny, tmp_path / "phi3.Q8_0.gguf", quant="Q8_0")))
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    formats = model.weight_formats
    assert formats["model.layers.0.self_attn.qkv_proj.weight"] == "q8_0"
    assert formats["model.layers.0.mlp.gate_up_proj.weight"] == "q8_0"
    token_ids = random_ids(loaded.spec.vocab_size, 40, seed=4)
    torch.testing.assert_close(
        prefill_logits(model, token_ids), reference_logits(tiny, token_ids), rtol=0.05, atol=0.05
    )


def _edit_config(directory: Path, **changes: object) -> None:
    import json

    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            {"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 7, "short_factor": [1.0] * 8}},
            "long_factor has 7 values, expected 8",
        ),
    ],
)
def test_unimplemented_phi3_variants_are_refused(
    tmp_path: Path, changes: dict[str, object], message: str
) -> None:
    tiny = build_arch_hf(tmp_path / "phi3", "phi3")
    _edit_config(tiny.path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(tiny.path))


def test_gemma3_spec_and_fingerprint_ops(tiny_arch: TinyModel) -> None:
    """Gemma 3's own fields are read, and the model names the ops it adds (the fingerprint lists them)."""
    loaded = load_model(str(tiny_arch.path))
    model = DecoderModel(loaded.spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    assert model.fused is None  # windowed / Gemma layers take the per-op path
    if tiny_arch.architecture == "gemma2":
        assert model.model_ops == ("gelu_tanh_mul", "gemma_block", "sliding_window_attention", "softcap")
        assert loaded.spec.window_layers == (True, False, True, False)
        return
    if tiny_arch.architecture != "gemma3":
        assert model.model_ops == ("sliding_window_attention",)
        return
    spec = loaded.spec
    assert (spec.rope_theta, spec.rope_local_theta, spec.query_pre_attn_scalar) == (1e6, 1e4, 16.0)
    assert spec.window_layers == (True,) * 5 + (False,)
    assert model.model_ops == ("gelu_tanh_mul", "gemma_block", "sliding_window_attention")
    numerics = EngineConfig().numerics("float32", model.weight_formats, model.model_ops)
    assert numerics["model_ops"] == list(model.model_ops)
    assert "model_ops" not in EngineConfig().numerics("float32", model.weight_formats)


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_ignoring_a_gemma2_soft_cap_is_detected(tmp_path: Path, cap: str) -> None:
    """Negative control: without either soft cap the logits leave the tolerance: the match sees both."""
    tiny = build_arch_hf(tmp_path / "gemma2", "gemma2")
    loaded = load_model(str(tiny.path))
    spec = dataclasses.replace(loaded.spec, **{cap: 0.0})  # type: ignore[arg-type]
    model = DecoderModel(spec, loaded.weights, Numerics(torch.float32, True, 8), 512)
    token_ids = random_ids(loaded.spec.vocab_size, 40, seed=5)
    assert (prefill_logits(model, token_ids) - reference_logits(tiny, token_ids)).abs().max() > 10 * ATOL
