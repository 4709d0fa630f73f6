"""Tiny random GGUF files in block-quantized formats, mixed per tensor like llama.cpp's Q4_K_M recipe.

The `gguf` package quantizes only the 32-value formats, so the blocks here are random bytes with the
fp16 scale fields set to small random numbers (weights of magnitude ~0.05): a valid file of every
format, with no reference model behind it. Shapes are K-quant sized (rows of 256 values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.tiny_models import TinyModel, write_tokenizer_metadata

# format -> (byte offsets of the fp16 scale fields, base magnitude of each field)
SCALE_FIELDS: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_0": ((0, 2.0**-7),),
    "Q4_1": ((0, 2.0**-8), (2, 2.0**-4)),
    "Q5_0": ((0, 2.0**-8),),
    "Q5_1": ((0, 2.0**-9), (2, 2.0**-4)),
    "Q8_0": ((0, 2.0**-11),),
    "Q4_K": ((0, 2.0**-14), (2, 2.0**-12)),
    "Q5_K": ((0, 2.0**-15), (2, 2.0**-12)),
    "Q6_K": ((208, 2.0**-16),),
    "Q2_K": ((80, 2.0**-12), (82, 2.0**-12)),  # a format the kernels do not read
}


@dataclass(frozen=True)
class Shape:
    """Llama hyper-parameters of a random file (rows of K-quant size: multiples of 256)."""

    hidden: int = 256
    inter: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    layers: int = 2


# tensor class -> format, per layer (Q4_K_M-like: Q6_K for attn_v / ffn_down in layer 0 only, so the
# two layers mix formats differently), plus the globals
FormatPlan = Callable[[int, str], str]


def q4_k_m_plan(layer: int, tensor: str) -> str:
    """Q4_K for most matrices; Q6_K for attn_v and ffn_down of layer 0 and the output head; a Q5_K
    attn_output in layer 1; a Q8_0 embedding (as in the default model's file); F32 norms."""
    if tensor.endswith("norm.weight"):
        return "F32"
    globals_ = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K"}
    if tensor in globals_:
        return globals_[tensor]
    if layer == 0 and tensor in ("attn_v.weight", "ffn_down.weight"):
        return "Q6_K"
    if layer == 1 and tensor == "attn_output.weight":
        return "Q5_K"
    return "Q4_K"


def uniform_plan(fmt: str, **overrides: str) -> FormatPlan:
    """Every matrix in `fmt` (tensors named in `overrides` in theirs: dots as underscores, e.g.
    token_embd_weight="F16", blk_1_ffn_gate_weight="Q2_K"), norms F32."""

    def plan(layer: int, tensor: str) -> str:
        for key in (f"blk_{layer}_{tensor}", tensor):
            if key.replace(".", "_") in overrides:
                return overrides[key.replace(".", "_")]
        return "F32" if tensor.endswith("norm.weight") else fmt

    return plan


def random_blocks(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8 of random `fmt` blocks with small finite fp16 scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt]
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = cols // block_values
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    for offset, base in SCALE_FIELDS[fmt]:
        magnitude = base * rng.uniform(0.5, 1.0, (rows, blocks)) * rng.choice([-1.0, 1.0], (rows, blocks))
        data[:, :, offset : offset + 2] = magnitude.astype(np.float16).view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * block_bytes)


def write_random_gguf(
    tokenizer_source: TinyModel,
    path: Path,
    plan: FormatPlan = q4_k_m_plan,
    seed: int = 0,
    tie: bool = False,
    shape: Shape = Shape(),
) -> Path:
    """A llama GGUF (default: 2 layers, hidden 256, 4 heads of 64, 2 KV heads, FFN 512) of random
    weights in the formats `plan` gives, with the tiny tokenizer of `tokenizer_source` (an HF directory)."""
    import gguf

    hidden, inter, heads, kv_heads = shape.hidden, shape.inter, shape.heads, shape.kv_heads
    head_dim = shape.head_dim

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-mixed")
    for add, value in (
        (writer.add_block_count, shape.layers), (writer.add_context_length, 512),
        (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, inter),
        (writer.add_head_count, heads), (writer.add_head_count_kv, kv_heads),
        (writer.add_rope_dimension_count, head_dim), (writer.add_key_length, head_dim),
    ):  # fmt: skip
        add(value)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = write_tokenizer_metadata(writer, tokenizer_source.path, True, "gpt2", "smollm")
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tie:
        shapes["output.weight"] = (vocab, hidden)
    layer_shapes = {
        "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
        "attn_q.weight": (heads * head_dim, hidden), "attn_k.weight": (kv_heads * head_dim, hidden),
        "attn_v.weight": (kv_heads * head_dim, hidden), "attn_output.weight": (hidden, heads * head_dim),
        "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
        "ffn_down.weight": (hidden, inter),
    }  # fmt: skip
    for name, dims in shapes.items():
        _add(writer, name, dims, plan(-1, name), rng)
    for layer in range(shape.layers):
        for name, dims in layer_shapes.items():
            _add(writer, f"blk.{layer}.{name}", dims, plan(layer, name), rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: object, name: str, shape: tuple[int, ...], fmt: str, rng: np.random.Generator) -> None:
    import gguf

    if fmt in ("F32", "F16", "BF16"):
        noise = rng.standard_normal(shape)
        values = (1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise).astype(np.float32)
        if fmt == "BF16":  # the top half of each fp32 (truncation; any bf16 bits will do here)
            raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*shape[:-1], -1)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)  # type: ignore[attr-defined]
            return
        writer.add_tensor(name, values.astype(np.float16 if fmt == "F16" else np.float32))  # type: ignore[attr-defined]
        return
    data = random_blocks(fmt, shape[0], shape[1], rng)
    qtype = gguf.GGMLQuantizationType[fmt]
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)  # type: ignore[attr-defined]
