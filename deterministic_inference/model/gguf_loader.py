"""Load a GGUF file: hyper-parameters, the weights as stored under HF names, and the tokenizer.

The file is memory-mapped (copy-on-write, never written). F32/F16/BF16 tensors become dense torch views
of the map; block-quantized 2-D tensors of a supported format (`ops/quant.py`) become `QuantizedWeight`
views: no float copy of them is made here (`--quantization` decides later what is computed dense). A
block format the kernels do not read is dequantised to float32 with `gguf.quants.dequantize` under
`--quantization none`, and refused with one line naming the tensor otherwise.

llama.cpp's converter stores the q/k projections of `llama` models with each head's rows interleaved as
rotary pairs: dense ones are put back in HF rotate-half order (`unpermute_qk`, an exact gather), quantized
ones keep their bytes and get the row order (`RowOrdered`). qwen2/qwen3 files are stored unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deterministic_inference.errors import ModelLoadError, UnsupportedArchitectureError
from deterministic_inference.model.families import family_of
from deterministic_inference.model.gguf_file import GGUFFile, GGUFTensor, metadata_float, read_gguf
from deterministic_inference.model.gguf_tokenizer import build_gguf_tokenizer
from deterministic_inference.model.moe_loading import (
    GGUF_ARCHITECTURES,
    gguf_moe_fields,
    gguf_moe_name,
    split_experts,
)
from deterministic_inference.model.rope_config import GGUF_ROPE_TENSORS, gguf_rope_scaling, scaled_context
from deterministic_inference.model.tokenizer import Tokenizer
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.quant import QuantizedWeight, UnsupportedWeightFormat, block_format
from deterministic_inference.ops.weights import RowOrdered, StoredWeight

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
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3: q, k, v fused
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
Stored = StoredWeight | tuple[StoredWeight, ...]  # a tensor as read; a tuple: the experts of a 3-D stack
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
_QUANT_SUFFIX = re.compile(r"[.-](?:[IiQqFf]\d[\w]*|[Bb][Ff]16|[Ff]16|[Ff]32)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a llama.cpp tensor name ("{e}" standing for the expert of a 3-D expert
    stack), or None when it has no HF equivalent."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if not match:
        return None
    rest = _LAYER_NAMES.get(match.group(2)) or gguf_moe_name(match.group(2))
    return None if rest is None else f"model.layers.{match.group(1)}.{rest}"


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


def load_gguf(
    path: Path, quantization: str = "auto"
) -> tuple[ModelSpec, dict[str, StoredWeight], Tokenizer, str]:
    """(spec, stored weights with HF names, tokenizer, served name) from the GGUF file at `path`."""
    gguf_file = _read_file(path)
    meta = gguf_file.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)} "
            "(llama with experts: Mixtral)"
        )
    tensors = _read_tensors(path, gguf_file, quantization)
    tokenizer = build_gguf_tokenizer(path, meta)
    spec = _spec(path, meta, str(arch), tensors, tokenizer)
    weights = _hf_weights(path, spec, tensors, permuted_qk=GGUF_ARCHITECTURES[str(arch)][1])
    gguf_file.release_header()
    return spec, weights, tokenizer, served_name(path)


def _read_file(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except Exception as exc:  # malformed bytes surface as struct/numpy/unicode errors too
        raise ModelLoadError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from exc


def _read_tensors(path: Path, gguf_file: GGUFFile, quantization: str) -> dict[str, Stored]:
    """Every tensor as stored (numpy row-major shapes; a 3-D expert stack as its experts' 2-D views)."""
    out: dict[str, Stored] = {}
    for tensor in gguf_file.tensors:
        shape = tensor.shape
        kind = tensor.tensor_type.name
        try:
            out[tensor.name] = _stored_tensor(tensor, shape, quantization)
        except UnsupportedWeightFormat:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} has type {kind}, which the kernels do not read as stored; "
                "run with --quantization none to dequantise it"
            ) from None
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} ({kind}, shape {shape}) cannot be read "
                f"(corrupt or truncated file?): {exc}"
            ) from exc
    return out


def _stored_tensor(tensor: GGUFTensor, shape: tuple[int, ...], quantization: str) -> Stored:
    """A dense view (F32/F16/BF16), a QuantizedWeight view (supported 2-D block formats), or a float32
    dequantisation (1-D blocks; other block formats under --quantization none). A 3-D tensor (experts
    [E, rows, cols]) becomes a tuple of its experts' 2-D weights, each a view (no copy)."""
    if len(shape) == 3:
        experts = (GGUFTensor(tensor.name, tensor.tensor_type, shape[1:], data) for data in tensor.data)
        return tuple(_stored_tensor(expert, shape[1:], quantization) for expert in experts)  # type: ignore[misc]
    data = tensor.data
    kind = tensor.tensor_type.name
    if kind in ("F32", "F16"):
        return torch.from_numpy(data).reshape(shape)
    if kind == "BF16":
        return torch.from_numpy(data).view(torch.bfloat16).reshape(shape)
    if len(shape) == 2:
        try:
            fmt = block_format(kind)
        except UnsupportedWeightFormat:
            if quantization != "none":
                raise
        else:
            stored = torch.from_numpy(data).reshape(shape[0], -1)
            return QuantizedWeight(stored, fmt, (shape[0], shape[1]), file_mapped=True)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = np.asarray(dequantize(data, GGMLQuantizationType(int(tensor.tensor_type))), dtype=np.float32)
    values = values.reshape(shape)
    return torch.from_numpy(values.copy())


def _int(path: Path, meta: dict[str, Any], key: str, default: int | None = None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata {key} is missing")
    return int(value)


def _spec(
    path: Path, meta: dict[str, Any], arch: str, tensors: dict[str, Stored], tokenizer: Tokenizer
) -> ModelSpec:
    embedding = tensors.get("token_embd.weight")
    if embedding is None or isinstance(embedding, tuple):
        raise ModelLoadError(f"{path}: tensor token_embd.weight is missing (or not a 2-D table)")
    hidden = _int(path, meta, f"{arch}.embedding_length")
    heads = _int(path, meta, f"{arch}.attention.head_count")
    if heads <= 0 or (hidden % heads != 0 and f"{arch}.attention.key_length" not in meta):
        raise ModelLoadError(f"{path}: {arch}.attention.head_count {heads} does not divide {hidden}")
    architecture = GGUF_ARCHITECTURES[arch][0]
    head_dim = _int(path, meta, f"{arch}.attention.key_length", hidden // heads)
    rotary = _int(path, meta, f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelLoadError(
            f"{path}: {arch}.rope.dimension_count {rotary} != head dim {head_dim}: "
            "partial rotary is not supported"
        )
    scaling = gguf_rope_scaling(path, meta, arch, tensors, head_dim)
    context = scaled_context(_int(path, meta, f"{arch}.context_length"), scaling)
    window = _int(path, meta, f"{arch}.attention.sliding_window", 0)
    moe = gguf_moe_fields(path, meta, architecture, arch, tensors)
    layers = _int(path, meta, f"{arch}.block_count")
    family_fields = family_of(architecture).gguf_fields
    extra = family_fields(path, meta, arch, head_dim, layers) if family_fields is not None else {}
    if moe and architecture == "llama":
        architecture = "mixtral"
    return ModelSpec(
        architecture=architecture,
        vocab_size=int(embedding.shape[0]),
        hidden_size=hidden,
        intermediate_size=_int(path, meta, f"{arch}.feed_forward_length", moe.get("moe_intermediate_size")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(path, meta, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=metadata_float(meta, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=metadata_float(meta, f"{arch}.rope.freq_base", 10000.0),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        rope_scaling=scaling,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        sliding_window=window if 0 < window < context else 0,  # a window no sequence can cross is none
        **extra,
        **moe,
    )


def _unpermuted(tensor: StoredWeight, heads: int) -> StoredWeight:
    """llama.cpp's interleaved q/k rows in HF order: a gathered copy of a dense tensor, the row order
    for a quantized one (its bytes stay where they are)."""
    if isinstance(tensor, torch.Tensor):
        return unpermute_qk(tensor, heads).contiguous()
    order = unpermute_qk(torch.arange(tensor.shape[0]), heads).contiguous()  # [N]: HF row -> stored row
    if isinstance(tensor, RowOrdered):
        return RowOrdered(tensor.stored, tensor.order[order])
    return RowOrdered(tensor, order)


def _hf_weights(
    path: Path, spec: ModelSpec, tensors: dict[str, Stored], permuted_qk: bool
) -> dict[str, StoredWeight]:
    weights: dict[str, StoredWeight] = {}
    renamed = family_of(spec.architecture).gguf_layer_names  # the family's own names (Gemma, Phi-3)
    for name, tensor in tensors.items():
        if name in GGUF_ROPE_TENSORS:  # read into spec.rope_scaling
            continue
        layer = _LAYER_TENSOR.match(name)
        if layer and layer.group(2) in renamed:
            target: str | None = f"model.layers.{layer.group(1)}.{renamed[layer.group(2)]}"
        else:
            target = hf_name(name)
        if target is None:
            raise ModelLoadError(
                f"{path}: tensor {name} has no place in a {spec.architecture} model (unsupported variant?)"
            )
        if isinstance(tensor, tuple) or "{e}" in target or "shared_expert_gate" in target:
            try:
                weights.update(split_experts(tensor, target))
            except ValueError as exc:
                raise ModelLoadError(f"{path}: tensor {name}: {exc}") from None
            continue
        if permuted_qk and name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = spec.num_heads if ".attn_q." in name else spec.num_kv_heads
            if tensor.shape[0] != heads * spec.head_dim:
                raise ModelLoadError(
                    f"{path}: tensor {name} has {tensor.shape[0]} rows, expected {heads * spec.head_dim}"
                )
            weights[target] = _unpermuted(tensor, heads)
            continue
        weights[target] = tensor
    return weights
