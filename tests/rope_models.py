"""Tiny random models with rope scaling, for tests: an HF directory (transformers config with its
`rope_parameters`) and the same weights as a GGUF file carrying the scaling the way llama.cpp's converter
writes it (Llama 3.1: the per-frequency divisors `rope_freqs.weight`; YaRN and linear:
`{arch}.rope.scaling.*`; Phi-3: `rope_factors_long/short.weight` and its attention factor).

Every scaled config has original_max_position_embeddings ORIGINAL = 64 within a 512-position context, so
a prompt of PROMPT_LEN tokens runs well past the point where the scaling changes the rotation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.arch_models import build_arch_hf, write_arch_gguf
from tests.tiny_models import (
    TinyModel,
    _config,
    _model,
    build_tokenizer,
    permute_for_gguf,
    write_tokenizer_metadata,
)

ORIGINAL = 64  # original_max_position_embeddings of every scaled tiny model
PROMPT_LEN = 150  # tokens: more than twice ORIGINAL
THETA = 100000.0  # tiny_models' rope base
HEAD_DIM = 16
LONG_FACTOR = tuple(1.0 + 0.75 * j for j in range(HEAD_DIM // 2))  # Phi-3 style: grows with the wavelength
SHORT_FACTOR = tuple(1.0 + 0.05 * j for j in range(HEAD_DIM // 2))

# variant -> (architecture, rope_parameters beyond rope_theta)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}),
    "yarn": ("qwen2", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "longrope": ("phi3", {"rope_type": "longrope", "short_factor": list(SHORT_FACTOR),
                          "long_factor": list(LONG_FACTOR), "original_max_position_embeddings": ORIGINAL}),
    "gemma3-linear": ("gemma3", {"rope_type": "linear", "factor": 8.0}),
}  # fmt: skip


def build_scaled_hf(directory: Path, variant: str, seed: int = 0) -> TinyModel:
    """The tiny model of `variant` (VARIANTS) as an HF directory; `model` is its transformers reference."""
    architecture, rope = VARIANTS[variant]
    if architecture == "phi3":
        rope = {"rope_theta": 10000.0, "partial_rotary_factor": 1.0, **rope}
        changes = {"rope_parameters": rope, "original_max_position_embeddings": ORIGINAL}
        return build_arch_hf(directory, "phi3", window=None, seed=seed, config_changes=changes)
    if architecture == "gemma3":
        layers = {"full_attention": {"rope_theta": 1_000_000.0, **rope},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}  # fmt: skip
        return build_arch_hf(directory, "gemma3", seed=seed, config_changes={"rope_parameters": layers})
    tokenizer = build_tokenizer()
    config = _config(architecture, tokenizer.get_vocab_size(with_added_tokens=True), architecture == "llama")
    config.rope_parameters = {"rope_theta": THETA, **rope}
    model = _model(architecture, config, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "add_bos_token": false}')
    return TinyModel(directory, model, architecture)


def llama3_rope_freqs(rope: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """[head_dim / 2] fp32: the divisors llama.cpp's converter stores as rope_freqs.weight for a llama3
    rope_scaling (1 for short wavelengths, factor for long ones, 1 / blend between)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for j in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * j / head_dim)
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_rope_extra(variant: str, arch: str) -> Callable[[Any], None]:
    """What the converter adds for `variant`'s scaling to a GGUF writer of architecture `arch`."""
    _, rope = VARIANTS[variant]

    def extra(writer: Any) -> None:
        kind = rope["rope_type"]
        if kind == "llama3":
            writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, THETA, HEAD_DIM))
        elif kind in ("linear", "yarn"):
            writer.add_string(f"{arch}.rope.scaling.type", kind)
            writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
            if kind == "yarn":
                writer.add_uint32(f"{arch}.rope.scaling.original_context_length", ORIGINAL)
        else:  # longrope (phi3 also writes original_context_length: arch_models does)
            factor = 512 / ORIGINAL
            writer.add_float32(
                f"{arch}.rope.scaling.attn_factor", math.sqrt(1 + math.log(factor) / math.log(ORIGINAL))
            )
            writer.add_tensor("rope_factors_long.weight", np.array(LONG_FACTOR, dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(SHORT_FACTOR, dtype=np.float32))

    return extra


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def write_scaled_gguf(
    reference: TinyModel, variant: str, path: Path, extra: Callable[[Any], object] | None = None
) -> Path:
    """`reference` (from build_scaled_hf) as an F32 GGUF file with its scaling in llama.cpp's form (or
    what `extra(writer)` writes instead)."""
    import gguf

    architecture = reference.architecture
    extra = extra or gguf_rope_extra(variant, architecture)
    if architecture in ("phi3", "gemma3"):
        return write_arch_gguf(reference, path, extra=extra)
    cfg = reference.model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(THETA)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    write_tokenizer_metadata(writer, reference.path, False, "gpt2", "smollm")
    for name, tensor in reference.state_dict.items():
        array = tensor.numpy().astype(np.float32)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = permute_for_gguf(array, heads)
        target = _GLOBAL.get(name) or "blk.{}.{}".format(name.split(".")[2], _NAMES[name.split(".", 3)[3]])
        writer.add_tensor(target, np.ascontiguousarray(array))
    extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_logits(tiny: TinyModel, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [T, vocab] fp32 for one sequence."""
    with torch.no_grad():
        return tiny.model(torch.tensor([token_ids])).logits[0].float()
