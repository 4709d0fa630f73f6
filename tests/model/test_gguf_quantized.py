"""GGUF weights kept as stored: quantized tensors are views on the file's map (never a float copy), their
dequantisation equals the `gguf` package's bit for bit, llama's q/k rows are read through a row order,
unsupported block formats are refused in one line (or dequantised under --quantization none), and the
--quantization modes turn into the formats the model computes in."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from deterministic_inference.config import EngineConfig
from deterministic_inference.engine.engine import Engine
from deterministic_inference.engine.sampling_params import SamplingParams
from deterministic_inference.engine.setup import build_model
from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.gguf_loader import unpermute_qk
from deterministic_inference.model.loader import load_model
from deterministic_inference.model.moe import GatedMLP
from deterministic_inference.model.quantization import apply_quantization
from deterministic_inference.ops.quant import QuantizedWeight
from deterministic_inference.ops.weights import RowOrdered, dense, stored_format
from tests.quant_models import Shape, q4_k_m_plan, uniform_plan, write_random_gguf
from tests.tiny_models import TinyModel


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _hf(gguf_name: str) -> str:
    from deterministic_inference.model.gguf_loader import hf_name

    return hf_name(gguf_name) or gguf_name


def raw_tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def test_mixed_file_keeps_every_format_as_stored(tiny_q4_k_m_gguf: Path) -> None:
    loaded = load_model(str(tiny_q4_k_m_gguf))
    formats = {name: stored_format(w) for name, w in loaded.weights.items()}
    assert formats["model.embed_tokens.weight"] == "q8_0" and formats["lm_head.weight"] == "q6_k"
    assert formats["model.layers.0.mlp.down_proj.weight"] == "q6_k"
    assert formats["model.layers.1.mlp.down_proj.weight"] == "q4_k"
    assert formats["model.layers.1.self_attn.o_proj.weight"] == "q5_k"
    assert formats["model.layers.0.input_layernorm.weight"] == "f32"
    # every quantized tensor's bytes sit at its file offset from one base address: views on one map
    offsets = {_hf(t.name): t.data_offset for t in gguf.GGUFReader(str(tiny_q4_k_m_gguf)).tensors}
    bases = set()
    for name, weight in loaded.weights.items():
        if isinstance(weight, (QuantizedWeight, RowOrdered)):
            blocks = weight.stored if isinstance(weight, RowOrdered) else weight
            bases.add(blocks.data.data_ptr() - offsets[name])
    assert len(bases) == 1


def test_dequantisation_equals_gguf_and_q_k_rows_are_reordered(tiny_q4_k_m_gguf: Path) -> None:
    """Every quantized tensor dequantises to gguf.quants.dequantize's bits; llama q/k come back in HF
    rotate-half order through their row order (the stored bytes are not moved)."""
    loaded = load_model(str(tiny_q4_k_m_gguf))
    raw = raw_tensors(tiny_q4_k_m_gguf)
    shape = Shape()
    for layer in range(shape.layers):
        for gguf_name, hf_name, heads in (
            ("attn_q", "self_attn.q_proj", shape.heads), ("attn_k", "self_attn.k_proj", shape.kv_heads),
            ("attn_v", "self_attn.v_proj", None), ("ffn_down", "mlp.down_proj", None),
        ):  # fmt: skip
            tensor = raw[f"blk.{layer}.{gguf_name}.weight"]
            values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
            expected = torch.from_numpy(values.copy())
            weight = loaded.weights[f"model.layers.{layer}.{hf_name}.weight"]
            if heads is not None:
                assert isinstance(weight, RowOrdered)
                expected = unpermute_qk(expected, heads)
            assert torch.equal(bits(dense(weight, torch.float32)), bits(expected)), gguf_name
            bf16 = dense(weight, torch.bfloat16)
            assert torch.equal(bf16.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))


def test_float_tensors_are_dense_views(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    """F32, F16 and BF16 tensors load as dense tensors of their own dtype (the model casts them)."""
    plan = uniform_plan("Q4_0", token_embd_weight="F16", output_weight="BF16", blk_0_ffn_up_weight="F32")
    path = write_random_gguf(tiny_llama_dir, tmp_path / "floats.gguf", plan=plan)
    loaded = load_model(str(path))
    embed, head = loaded.weights["model.embed_tokens.weight"], loaded.weights["lm_head.weight"]
    assert isinstance(embed, torch.Tensor) and embed.dtype == torch.float16
    assert isinstance(head, torch.Tensor) and head.dtype == torch.bfloat16
    raw = raw_tensors(path)["output.weight"]
    stored = torch.from_numpy(np.array(raw.data)).view(torch.int16).view(head.shape)
    assert torch.equal(head.view(torch.int16), stored)
    up = loaded.weights["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(up, torch.Tensor) and up.dtype == torch.float32
    assert stored_format(loaded.weights["model.layers.0.mlp.gate_proj.weight"]) == "q4_0"


def test_unsupported_block_format_is_one_line_unless_none(
    tiny_llama_dir: TinyModel, tmp_path: Path
) -> None:
    plan = uniform_plan("Q4_0", blk_1_ffn_gate_weight="Q2_K")
    path = write_random_gguf(tiny_llama_dir, tmp_path / "q2k.gguf", plan=plan)
    with pytest.raises(ModelLoadError) as info:
        load_model(str(path))
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "blk.1.ffn_gate.weight" in message and "Q2_K" in message and "--quantization none" in message
    loaded = load_model(str(path), "none")
    gate = loaded.weights["model.layers.1.mlp.gate_proj.weight"]
    assert isinstance(gate, torch.Tensor) and gate.dtype == torch.float32
    engine = Engine(EngineConfig(model=str(path), quantization="none", selfcheck=False), loaded=loaded)
    output = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 4


def test_quantization_modes_set_the_computed_formats(
    tiny_q4_k_m_gguf: Path, tiny_llama_dir: TinyModel
) -> None:
    """auto keeps the file's formats; none computes everything dense in --dtype; q8_0 quantizes float
    matrices (an HF directory here) byte for byte like gguf's quantizer and leaves vectors dense."""
    loaded = load_model(str(tiny_q4_k_m_gguf))
    config = EngineConfig(selfcheck=False)
    auto = build_model(loaded, config.replace(quantization="auto"), "float32", 512).weight_formats
    assert auto["model.layers.0.mlp.down_proj.weight"] == "q6_k" and auto["lm_head.weight"] == "q6_k"
    none = build_model(loaded, config.replace(quantization="none"), "bfloat16", 512).weight_formats
    assert set(none.values()) == {"bf16"}
    hf = load_model(str(tiny_llama_dir.path))
    q8 = apply_quantization(hf.weights, "q8_0", torch.float32)
    embed = q8["model.embed_tokens.weight"]
    assert isinstance(embed, QuantizedWeight) and embed.fmt.name == "Q8_0"
    hf_embed = hf.weights["model.embed_tokens.weight"]
    assert isinstance(hf_embed, torch.Tensor)  # an unquantized HF checkpoint: dense tensors only
    float_embed = hf_embed.numpy()
    expected = gguf.quants.quantize(float_embed, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(embed.data.numpy(), expected)
    assert isinstance(q8["model.norm.weight"], torch.Tensor)
    formats = build_model(hf, config.replace(quantization="q8_0"), "float32", 512).weight_formats
    assert formats["model.layers.1.self_attn.v_proj.weight"] == "q8_0"
    assert formats["model.norm.weight"] == "f32"


@pytest.mark.slow
def test_quantized_weights_never_exist_as_float_copies(tiny_llama_dir: TinyModel, tmp_path: Path) -> None:
    """A Q4_0 file of 2 x 2048-wide layers (~70 MB of blocks, ~500 MB as fp32): loading it and building
    the model adds about the blocks' size to the resident memory, not the float size."""
    shape = Shape(hidden=2048, inter=8192, heads=16, kv_heads=8, head_dim=128, layers=2)
    plan = uniform_plan("Q4_0")
    path = write_random_gguf(tiny_llama_dir, tmp_path / "big.Q4_0.gguf", plan=plan, shape=shape)
    size = path.stat().st_size
    before = _resident()
    loaded = load_model(str(path))
    model = build_model(loaded, EngineConfig(selfcheck=False), "bfloat16", 512)
    for layer in model.layers:  # touch every weight page through the kernels
        mlp = layer.mlp
        assert isinstance(mlp, GatedMLP)
        mlp.gate_up(torch.zeros(1, shape.hidden, dtype=torch.bfloat16))
        mlp.down(torch.zeros(1, shape.inter, dtype=torch.bfloat16))
    grown = _resident() - before
    assert grown < size + (40 << 20), (grown, size)


def _resident() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


def test_q4_k_m_plan_covers_the_k_formats() -> None:
    names = ("token_embd.weight", "output.weight", "attn_v.weight", "attn_output.weight", "attn_norm.weight")
    planned = {q4_k_m_plan(layer, name) for layer in (-1, 0, 1) for name in names}
    assert {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "F32"} <= planned
