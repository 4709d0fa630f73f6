"""Load a GGUF file: hyper-parameters, float32 weights under HF names, and the tokenizer.

Every tensor is dequantised to float32 with `gguf.quants.dequantize` (a pure numpy function of the
stored blocks, so the weights are the same bits on every machine). llama.cpp's converter stores the
q/k projections of `llama` models with each head's rows interleaved as rotary pairs; `unpermute_qk`
undoes that so the weights are in HF rotate-half layout. qwen2/qwen3 files are stored unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deterministic_inference.errors import ModelLoadError, UnsupportedArchitectureError
from deterministic_inference.model.gguf_tokenizer import build_gguf_tokenizer
from deterministic_inference.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from deterministic_inference.model.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
_QUANT_SUFFIX = re.compile(r"[.-](?:[IiQqFf]\d[\w]*|[Bb][Ff]16|[Ff]16|[Ff]32)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a llama.cpp tensor name, or None when it has no HF equivalent."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp interleaved-pair order (what the GGUF converter stores).

    weight: [num_heads * head_dim, ...]; within a head, row r of the first half and row r of the
    second half become rows 2r and 2r + 1."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of `permute_qk`: llama.cpp interleaved pairs -> HF rotate-half rows (exact, a gather)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def served_name(path: Path) -> str:
    """Default model name for a GGUF file: its file name without extension and quantisation tag."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def is_gguf_file(path: Path) -> bool:
    """True when the file starts with the GGUF magic bytes."""
    try:
        with path.open("rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def load_gguf(path: Path) -> tuple[ModelSpec, dict[str, torch.Tensor], Tokenizer, str]:
    """(spec, float32 weights with HF names, tokenizer, served name) from the GGUF file at `path`."""
    reader = _open_reader(path)
    meta = _metadata(path, reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = _read_tensors(path, reader)
    tokenizer = build_gguf_tokenizer(path, meta)
    spec = _spec(path, meta, str(arch), tensors, tokenizer)
    weights = _hf_weights(path, spec, tensors)
    return spec, weights, tokenizer, served_name(path)


def _open_reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the gguf package raises bare ValueError/IndexError/... on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def _metadata(path: Path, reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as exc:
            raise ModelLoadError(f"{path}: GGUF metadata {key} is unreadable: {exc}") from exc
    return meta


def _read_tensors(path: Path, reader: Any) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to float32, with numpy (row-major) shape = reversed GGUF dims."""
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        try:
            values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
            array = np.asarray(values, dtype=np.float32).reshape(shape)
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} ({tensor.tensor_type.name}, shape {shape}) cannot be read "
                f"(corrupt or truncated file?): {exc}"
            ) from exc
        out[tensor.name] = torch.from_numpy(array.copy()).contiguous()
    return out


def _float(meta: dict[str, Any], key: str, default: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99999974e-06),
    so a GGUF spec equals the HF one; float32 arithmetic sees the same bits either way."""
    return float(str(np.float32(meta.get(key, default))))


def _int(path: Path, meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata {key} is missing")
    return int(value)


def _spec(
    path: Path, meta: dict[str, Any], arch: str, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> ModelSpec:
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(
            f"{path}: rope frequency factors (rope_freqs.weight, Llama 3.1 style scaling) are not supported "
            "from GGUF; load the model from its Hugging Face directory instead"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported")
    hidden = _int(path, meta, f"{arch}.embedding_length")
    heads = _int(path, meta, f"{arch}.attention.head_count")
    if heads <= 0 or (hidden % heads != 0 and f"{arch}.attention.key_length" not in meta):
        raise ModelLoadError(f"{path}: {arch}.attention.head_count {heads} does not divide {hidden}")
    return ModelSpec(
        architecture=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[0]),
        hidden_size=hidden,
        intermediate_size=_int(path, meta, f"{arch}.feed_forward_length"),
        num_layers=_int(path, meta, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=_int(path, meta, f"{arch}.attention.head_count_kv", heads),
        head_dim=_int(path, meta, f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_float(meta, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=_int(path, meta, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )


def _hf_weights(path: Path, spec: ModelSpec, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        target = hf_name(name)
        if target is None:
            raise ModelLoadError(
                f"{path}: tensor {name} has no place in a {spec.architecture} model (unsupported variant?)"
            )
        if spec.architecture == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = spec.num_heads if ".attn_q." in name else spec.num_kv_heads
            if tensor.shape[0] != heads * spec.head_dim:
                raise ModelLoadError(
                    f"{path}: tensor {name} has {tensor.shape[0]} rows, expected {heads * spec.head_dim}"
                )
            tensor = unpermute_qk(tensor, heads).contiguous()
        weights[target] = tensor
    return weights
