"""The Gemma 2 and Gemma 3 (text) block, and what its loaders need to know about Gemma files.

Wiring, per layer (HF Gemma3DecoderLayer / Gemma2DecoderLayer; every norm an RMSNorm with fp32 statistics):

    h   = x + post_attention_norm(attention(input_norm(x)))      Gemma 3: q/k RMS-normed per head
    out = h + post_feedforward_norm(down(gelu_tanh(gate(n)) * up(n)))    n = pre_feedforward_norm(h)

- the embedding is scaled by sqrt(hidden) (`GEMMA.scaled_embedding`, applied by model/decoder.py);
- attention scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5);
- Gemma 3: windowed ("sliding_attention") layers rotate with rope_local_base_freq, the others rope_theta;
- Gemma 2: attention scores soft-capped (tanh(s / c) * c) before the softmax, and the final logits too.

Norm weights: HF stores w and computes x * (1 + w); llama.cpp's converter stores 1 + w. Both loaders give
the block 1 + w, computed in fp32 from the HF file (`plus_one_norms`), as stored from a GGUF file.

Every op is one of the backend's row-invariant ops (RMSNorm, the GEMMs, attention over the layer's
window, the GELU-tanh kernel), so the block's rows are invariant as the Llama block's are. The fused
decoder does not run this block (`fusable`): the per-op path does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.block import DecoderLayer, Shapes
from deterministic_inference.model.family import Family
from deterministic_inference.model.rope_config import hf_rope_scaling
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.backend import KVCache, OpsBackend
from deterministic_inference.ops.rope import RotaryTable
from deterministic_inference.ops.weights import StoredWeight, dense, dtype_format

GEMMA3_GLOBAL_EVERY = 6  # llama.cpp's gemma3 pattern: layers 5, 11, 17, ... attend globally
# GGUF block tensor -> HF name, where a Gemma file differs from the Llama mapping (gguf_loader)
GGUF_GEMMA_LAYER = MappingProxyType(
    {
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    }
)
_FEEDFORWARD_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


class GemmaLayer(DecoderLayer):
    """One Gemma 2 / Gemma 3 block (see the module docstring)."""

    fusable = False

    def __init__(self, spec: ModelSpec, weights: Mapping[str, StoredWeight], index: int, ops: OpsBackend):
        super().__init__(spec, weights, index, ops)
        prefix, dtype = f"model.layers.{index}.", ops.numerics.dtype
        self.pre_feedforward_norm, self.post_feedforward_norm = (
            dense(weights[prefix + n], dtype) for n in _FEEDFORWARD_NORMS
        )
        self.weight_formats.update((prefix + name, dtype_format(dtype)) for name in _FEEDFORWARD_NORMS)
        self.scale = (spec.query_pre_attn_scalar or spec.head_dim) ** -0.5

    @classmethod
    def layer_shapes(cls, spec: ModelSpec, index: int) -> Shapes:
        """The Llama block's tensors and the norms around the MLP."""
        shapes = super().layer_shapes(spec, index)
        shapes.update((f"model.layers.{index}.{name}", (spec.hidden_size,)) for name in _FEEDFORWARD_NORMS)
        return shapes

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the residual stream
        pending: torch.Tensor | None,  # [T, hidden]: the previous block's output, not yet added
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rotary: RotaryTable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, this block's normed MLP output still to be added)."""
        ops, spec, eps = self.ops, self.spec, self.spec.rms_norm_eps
        normed, hidden = ops.add_rms_norm(hidden, pending, self.input_norm, eps)
        qkv = self._qk_normed(self.qkv(normed))  # [T, (H + 2*KVH) * D]
        q = ops.rotary_write_kv(qkv, positions, rotary, meta, kv_cache, spec.num_heads)  # [T, H, D]
        cap = spec.attn_logit_softcapping
        attended = self.o_proj(ops.attention(q, kv_cache, meta, self.scale, self.window, cap))  # [T, hidden]
        delta = ops.rms_norm(attended, self.post_attention_norm, eps)
        normed, hidden = ops.add_rms_norm(hidden, delta, self.pre_feedforward_norm, eps)
        return hidden, ops.rms_norm(self.mlp(normed), self.post_feedforward_norm, eps)


def plus_one_norms(weights: dict[str, StoredWeight]) -> None:
    """HF Gemma norm weights w -> 1 + w in fp32 (in place), the factor HF's Gemma RMSNorm multiplies by."""
    for name, weight in weights.items():
        if name.endswith("norm.weight") and isinstance(weight, torch.Tensor):
            weights[name] = weight.float() + 1.0


def hf_gemma_fields(config_path: Path, config: dict[str, Any], arch: str) -> dict[str, Any]:
    """The Gemma spec fields of an HF text config (Gemma3ForCausalLM / gemma3_text, Gemma2ForCausalLM),
    with the rope scaling of the full-attention layers (Gemma 3 4B+: linear, factor 8)."""
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(
            f"{config_path}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)"
        )
    params = config.get("rope_parameters") or {}
    if arch == "gemma3" and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # one dict (a legacy rope_scaling scales Gemma 3's global layers only, as transformers reads it)
        full, local = config.get("rope_scaling") or params, {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(
            f"{config_path}: rope_parameters (sliding_attention) rope_type {local.get('rope_type')!r} is not "
            "supported (the windowed layers rotate unscaled: default only)"
        )
    theta = float(
        full.get("rope_theta", config.get("rope_theta", 1_000_000.0 if arch == "gemma3" else 10_000.0))
    )
    # a legacy Gemma 3 config.json (the Hub's) gives the local base as rope_local_base_freq
    local_theta = float(local.get("rope_theta", config.get("rope_local_base_freq", 10_000.0)))
    return {
        "hidden_activation": "gelu_tanh",
        "rope_theta": theta,
        "rope_scaling": hf_rope_scaling(config_path, config, full, int(config.get("head_dim") or 256)),
        "rope_local_theta": local_theta if arch == "gemma3" else 0.0,
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar") or config.get("head_dim") or 256),
        "attn_logit_softcapping": float(config.get("attn_logit_softcapping") or 0.0),
        "final_logit_softcapping": float(config.get("final_logit_softcapping") or 0.0),
    }


def gemma_window_layers(arch: str, layers: int) -> tuple[bool, ...]:
    """llama.cpp's fixed patterns (the layer_types HF writes for them): Gemma 3 every 6th layer global,
    Gemma 2 every 2nd."""
    every = GEMMA3_GLOBAL_EVERY if arch == "gemma3" else 2
    return tuple((i + 1) % every != 0 for i in range(layers))


def gguf_gemma_fields(
    path: Path, meta: dict[str, Any], arch: str, head_dim: int, layers: int
) -> dict[str, Any]:
    """The Gemma spec fields of a GGUF file, as llama.cpp reads it: windowed layers by its fixed pattern
    (Gemma 3: local rope base 10000, never scaled; {arch}.rope.scaling.* scales the global layers and is
    read by gguf_loader as for every architecture), soft-capping from gemma2.*_logit_softcapping, the
    attention scale 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 27B models: 62 layers Gemma 3,
    46 Gemma 2)."""
    scalar = float(head_dim)
    if layers == (62 if arch == "gemma3" else 46):
        scalar = float(meta[f"{arch}.embedding_length"]) / float(meta[f"{arch}.attention.head_count"])
    return {
        "hidden_activation": "gelu_tanh",
        "rope_local_theta": 10_000.0 if arch == "gemma3" else 0.0,
        "query_pre_attn_scalar": scalar,
        "window_layers": gemma_window_layers(arch, layers),
        # float32 values as their shortest decimals (0.3, not 0.30000001): the HF spec's numbers
        "attn_logit_softcapping": float(str(np.float32(meta.get(f"{arch}.attn_logit_softcapping", 0.0)))),
        "final_logit_softcapping": float(str(np.float32(meta.get(f"{arch}.final_logit_softcapping", 0.0)))),
    }


GEMMA = Family(
    name="gemma",
    architectures=("gemma3", "gemma2"),
    layer=GemmaLayer,
    scaled_embedding=True,
    block_ops=("gemma_block",),
    gguf_layer_names=GGUF_GEMMA_LAYER,
    hf_fields=hf_gemma_fields,
    gguf_fields=gguf_gemma_fields,
    window_layers=gemma_window_layers,
    convert_hf_weights=plus_one_norms,
)
