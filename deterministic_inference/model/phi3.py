"""The Phi-3 family: the shared pre-norm block (model/block.py) over q/k/v and gate/up stored fused
(qkv_proj, gate_up_proj), each read as stored into one linear, as the block reads its separate tensors
(model_spec.py lists the layouts); llama.cpp names the fused gate/up tensor ffn_up."""

from __future__ import annotations

from types import MappingProxyType

from deterministic_inference.model.block import DecoderLayer, Shapes
from deterministic_inference.model.family import Family
from deterministic_inference.model_spec import ModelSpec


class Phi3Layer(DecoderLayer):
    """The shared block over Phi-3's fused tensors (the MLP finds gate_up_proj itself, model/moe.py)."""

    qkv_weight_names = ("self_attn.qkv_proj.weight",)  # [(H + 2*KVH) * D, hidden]: q, k, v rows

    @classmethod
    def qkv_shapes(cls, spec: ModelSpec, prefix: str) -> Shapes:
        """One fused q/k/v tensor."""
        rows = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        return {prefix + "self_attn.qkv_proj.weight": (rows, spec.hidden_size)}

    @classmethod
    def mlp_shapes(cls, spec: ModelSpec, prefix: str) -> Shapes:
        """One fused gate/up tensor (gate rows, then up rows), then down."""
        inter, hidden = spec.intermediate_size, spec.hidden_size
        return {
            prefix + "mlp.gate_up_proj.weight": (2 * inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }


PHI3 = Family(
    name="phi3",
    architectures=("phi3",),
    layer=Phi3Layer,
    gguf_layer_names=MappingProxyType({"ffn_up.weight": "mlp.gate_up_proj.weight"}),
)
