"""GGUF loading: exact dequantisation, q/k un-permutation, spec, tokenizer; the real default model."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from deterministic_inference.model.gguf_loader import permute_qk, served_name, unpermute_qk
from deterministic_inference.model.loader import LoadedModel, load_model
from deterministic_inference.ops.quant import QuantizedWeight
from deterministic_inference.ops.weights import dense, stored_format
from tests.tiny_models import TinyModel, build_hf_model, write_gguf

TEXTS = [
    "Hello, world! 12345",
    "def add(a, b):\n    return a + b  # sum\n",
    "Grüße aus Köln — ça va? 你好，世界 🙂 こんにちは Привет",
    "  leading spaces and trailing  ",
]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_f32_gguf_loads_to_exactly_the_hf_tensors(tiny_llama_gguf: TinyModel) -> None:
    loaded = load_model(str(tiny_llama_gguf.path))
    reference = tiny_llama_gguf.state_dict
    assert loaded.source == "gguf"
    assert set(loaded.weights) == set(reference)
    for name, tensor in reference.items():
        got = loaded.weights[name]
        assert isinstance(got, torch.Tensor), name  # unquantized checkpoint: dense tensors only
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert _same_bits(got, tensor), name


def test_q_and_k_are_stored_permuted_in_the_file(tiny_llama_gguf: TinyModel) -> None:
    """Negative control: the raw file rows differ from HF layout, so the un-permutation is doing work."""
    reader = gguf.GGUFReader(str(tiny_llama_gguf.path))
    raw = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    reference = tiny_llama_gguf.state_dict
    assert not torch.equal(raw["blk.0.attn_q.weight"], reference["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(raw["blk.0.attn_k.weight"], reference["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(raw["blk.0.attn_v.weight"], reference["model.layers.0.self_attn.v_proj.weight"])


def test_unpermute_inverts_permute() -> None:
    weight = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(6 * 8, 5)  # 6 heads of dim 8
    permuted = permute_qk(weight, 6)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_qk(permuted, 6), weight)
    # within head 0, HF rows (0, 4) — a rotate-half pair — become adjacent rows (0, 1)
    assert torch.equal(permuted[0], weight[0]) and torch.equal(permuted[1], weight[4])


def test_spec_and_tokenizer_match_the_hf_directory(
    tiny_llama_gguf: TinyModel, tiny_llama_dir: TinyModel
) -> None:
    from_gguf = load_model(str(tiny_llama_gguf.path))
    from_hf = load_model(str(tiny_llama_dir.path))
    assert from_gguf.spec == from_hf.spec
    assert from_gguf.spec.tie_word_embeddings and "lm_head.weight" not in from_gguf.weights
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = from_gguf.tokenizer.encode(text)
        assert ids == from_hf.tokenizer.encode(text)
        assert ids[0] == 0  # BOS: the file says add_bos_token
        assert from_gguf.tokenizer.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
        assert from_gguf.tokenizer.decode(ids, skip_special_tokens=False) == "<|endoftext|>" + text
    assert from_gguf.tokenizer.eos_token_ids == (2,)
    assert from_gguf.tokenizer.chat_template == from_hf.tokenizer.chat_template
    assert from_gguf.artifacts == (tiny_llama_gguf.path,)
    assert from_gguf.name == "tiny-llama"


def test_q8_0_weights_are_the_exact_dequantisation(tiny_llama_gguf_q8: TinyModel) -> None:
    loaded = load_model(str(tiny_llama_gguf_q8.path))
    reader = gguf.GGUFReader(str(tiny_llama_gguf_q8.path))
    raw = {t.name: t for t in reader.tensors}
    embed = raw["token_embd.weight"]
    assert embed.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = torch.from_numpy(gguf.quants.dequantize(np.array(embed.data), embed.tensor_type).copy())
    stored = loaded.weights["model.embed_tokens.weight"]
    assert isinstance(stored, QuantizedWeight) and stored.fmt.name == "Q8_0"  # kept as stored
    assert _same_bits(dense(stored, torch.float32), expected)
    for name, tensor in tiny_llama_gguf_q8.state_dict.items():
        error = (dense(loaded.weights[name], torch.float32) - tensor).abs().max().item()
        assert error <= (0.0 if tensor.dim() == 1 else 0.01 * tensor.abs().max().item()), name


def test_untied_gguf_keeps_lm_head(tmp_path: Path) -> None:
    reference = build_hf_model(tmp_path / "hf", "llama", tie=False, seed=3)
    model = write_gguf(reference, tmp_path / "untied.gguf", add_bos=False)
    loaded = load_model(str(model.path))
    assert not loaded.spec.tie_word_embeddings
    lm_head = loaded.weights["lm_head.weight"]
    assert isinstance(lm_head, torch.Tensor)  # an F32 GGUF: dense tensors only
    assert _same_bits(lm_head, reference.state_dict["lm_head.weight"])
    assert loaded.tokenizer.encode("hi")[0] != 0  # no BOS when the file says so


def test_served_name_strips_the_quantisation_tag() -> None:
    assert served_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert served_name(Path("Llama-3.2-1B-Instruct-Q8_0.gguf")) == "Llama-3.2-1B-Instruct"
    assert served_name(Path("model-f16.gguf")) == "model"
    assert served_name(Path("Qwen2.5-0.5B.gguf")) == "Qwen2.5-0.5B"


# --- the real embedded model -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model(None)


@pytest.mark.slow
def test_default_model_spec(smollm2: LoadedModel) -> None:
    spec = smollm2.spec
    assert (spec.architecture, spec.hidden_size, spec.num_layers) == ("llama", 576, 30)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.vocab_size, spec.intermediate_size, spec.max_position_embeddings) == (49152, 1536, 8192)
    assert spec.tie_word_embeddings and spec.rope_theta == 100000.0 and spec.rms_norm_eps == 1e-5
    assert smollm2.name == "SmolLM2-135M-Instruct" and smollm2.source == "gguf"
    assert smollm2.artifacts[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "lm_head.weight" not in smollm2.weights
    formats = {name: stored_format(weight) for name, weight in smollm2.weights.items()}
    assert formats["model.embed_tokens.weight"] == "q8_0" and formats["model.norm.weight"] == "f32"
    names = ("self_attn.q_proj.weight", "mlp.down_proj.weight")
    assert {formats[f"model.layers.3.{name}"] for name in names} == {"q4_1"}
    for name, weight in smollm2.weights.items():
        assert bool(torch.isfinite(dense(weight, torch.float32)).all()), name


@pytest.mark.slow
def test_default_model_tokenizer(smollm2: LoadedModel) -> None:
    tok = smollm2.tokenizer
    assert tok.vocab_size == 49152 and tok.bos_token_id == 1
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert im_end == [2] and 2 in tok.eos_token_ids
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.encode("<|endoftext|>", add_special_tokens=False) == [0]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] != 1  # SmolLM2 adds no BOS
        assert tok.decode(ids) == text
    assert tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]  # digits are split singly
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids.count(1) == 3 and ids.count(2) == 2


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_other_pre_tokenizers_round_trip(pre: str, tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    loaded = load_model(str(write_gguf(tiny_llama_dir, tmp_path / f"{pre}.gguf", pre=pre).path))
    for text in TEXTS:
        assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text
