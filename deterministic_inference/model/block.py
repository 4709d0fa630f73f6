"""The shared decoder block: pre-norm attention then an MLP (gated, or a mixture of experts: model/moe.py),
each with a residual add, as Llama 2/3, SmolLM2, Mistral, Qwen2/3 and their MoE variants wire it.

A family whose block differs subclasses `DecoderLayer` in its own module (model/phi3.py: fused tensors;
model/gemma.py: sandwich norms) and names the subclass in its `Family` (model/family.py). The tensors a
block reads are listed by the same class (`layer_shapes`), so the loaders check exactly what it reads.

Data-driven variants of the shared block: Qwen2's q/k/v biases (`attention_bias`), Qwen3's per-head q/k
RMSNorm before the rotary embedding (`qk_norm`), a mixture of experts in place of the gated MLP
(`num_experts`), a sliding window (`sliding_window`). All state arrives as arguments (the KV caches and
attention metadata), never through a global.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from deterministic_inference.model.moe import GatedMLP, MoEBlock
from deterministic_inference.model.moe_loading import moe_shapes
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.backend import KVCache, OpsBackend, split_heads
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.rope import RotaryTable
from deterministic_inference.ops.weights import StoredWeight, dense, dtype_format

Shapes = dict[str, tuple[int, ...]]  # tensor name -> shape


class DecoderLayer:
    """One pre-norm transformer block: attention then gated MLP, each with a residual add, written
    against the ops backend (`ops/backend.py`), so it is the same code in every mode."""

    fusable = True  # the fused decoder (ops/fused.py FusableLayer) runs this exact sequence of kernels
    # the q/k/v projection's tensors under model.layers.{i}., read as one linear in this order
    qkv_weight_names: tuple[str, ...] = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")

    def __init__(self, spec: ModelSpec, weights: Mapping[str, StoredWeight], index: int, ops: OpsBackend):
        prefix = f"model.layers.{index}."
        self.spec = spec
        self.ops = ops
        dtype = ops.numerics.dtype

        vectors: list[str] = []  # names of the 1-D weights read, all kept in the model dtype

        def vector(name: str) -> torch.Tensor:
            vectors.append(prefix + name)
            return dense(weights[prefix + name], dtype)

        def matrices(*names: str) -> list[StoredWeight]:
            return [weights[prefix + name] for name in names]

        qkv = self.qkv_weight_names
        self.window = spec.layer_window(index)  # keys of its sliding window (0: none)
        self.local = spec.is_local_layer(index)  # a windowed-kind layer (Gemma: the local rope base)
        qkv_bias = None
        if spec.attention_bias:
            qkv_bias = torch.cat([vector(f"self_attn.{n}_proj.bias") for n in "qkv"])
        self.qkv = ops.linear(matrices(*qkv), qkv_bias)  # [(H + 2*KVH) * D, hidden]
        self.o_proj = ops.linear(matrices("self_attn.o_proj.weight"))  # [hidden, H * D]
        # [T, hidden] -> [T, hidden]: the gated MLP, or a mixture of experts (model/moe.py)
        mlp = prefix + "mlp."
        self.mlp: GatedMLP | MoEBlock
        if spec.is_moe:
            self.mlp = MoEBlock(spec, weights, mlp, ops)
        else:
            self.mlp = GatedMLP(ops, weights, mlp, spec.hidden_activation == "gelu_tanh")
        self.input_norm = vector("input_layernorm.weight")
        self.post_attention_norm = vector("post_attention_layernorm.weight")
        self.q_norm = vector("self_attn.q_norm.weight") if spec.qk_norm else None
        self.k_norm = vector("self_attn.k_norm.weight") if spec.qk_norm else None
        # tensor name -> the format it is computed in (the fingerprint's numerics)
        names = (*qkv, "self_attn.o_proj.weight")
        formats = (*self.qkv.formats, *self.o_proj.formats)
        self.weight_formats = {prefix + name: fmt for name, fmt in zip(names, formats, strict=True)}
        self.weight_formats.update(self.mlp.weight_formats())
        self.weight_formats.update((name, dtype_format(dtype)) for name in vectors)

    @classmethod
    def layer_shapes(cls, spec: ModelSpec, index: int) -> Shapes:
        """Every tensor this block reads for layer `index`, with its shape (the loaders' check)."""
        p, hidden = f"model.layers.{index}.", spec.hidden_size
        q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        shapes: Shapes = {p + f"{name}_layernorm.weight": (hidden,) for name in ("input", "post_attention")}
        shapes.update(cls.qkv_shapes(spec, p))
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q_rows)
        shapes.update(moe_shapes(spec, index) if spec.is_moe else cls.mlp_shapes(spec, p))
        if spec.attention_bias:
            bias_rows = zip("qkv", (q_rows, kv_rows, kv_rows), strict=True)
            shapes.update({p + f"self_attn.{n}_proj.bias": (rows,) for n, rows in bias_rows})
        if spec.qk_norm:
            shapes.update({p + f"self_attn.{n}_norm.weight": (spec.head_dim,) for n in "qk"})
        return shapes

    @classmethod
    def qkv_shapes(cls, spec: ModelSpec, prefix: str) -> Shapes:
        """The q/k/v projection's tensors: separate q, k and v."""
        q_rows, kv_rows = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        rows = (q_rows, kv_rows, kv_rows)
        names = zip(cls.qkv_weight_names, rows, strict=True)
        return {prefix + name: (count, spec.hidden_size) for name, count in names}

    @classmethod
    def mlp_shapes(cls, spec: ModelSpec, prefix: str) -> Shapes:
        """The dense gated MLP's tensors: separate gate and up, then down."""
        inter, hidden = spec.intermediate_size, spec.hidden_size
        return {
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }

    def dense_mlp(self) -> GatedMLP | None:
        """The gated MLP, None for a mixture of experts (what the fused path asks, ops/fused.py)."""
        return self.mlp if isinstance(self.mlp, GatedMLP) else None

    def probe_linears(self) -> list[tuple[str, Linear]]:
        """(role, linear) of every linear of the block (see DecoderModel.probe_linears)."""
        return [("qkv", self.qkv), ("o_proj", self.o_proj), *self.mlp.probe_linears()]

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the residual stream (the native backend updates it in place)
        pending: torch.Tensor | None,  # [T, hidden]: the previous block's MLP output, not yet added
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: KVCache,
        rotary: RotaryTable,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (residual stream, this block's MLP output still to be added): the add is fused into the
        next RMSNorm (`add_rms_norm`)."""
        ops, spec = self.ops, self.spec
        normed, hidden = ops.add_rms_norm(hidden, pending, self.input_norm, spec.rms_norm_eps)
        qkv = self._qk_normed(self.qkv(normed))  # [T, (H + 2*KVH) * D]
        q = ops.rotary_write_kv(qkv, positions, rotary, meta, kv_cache, spec.num_heads)  # [T, H, D]
        delta = self.o_proj(ops.attention(q, kv_cache, meta, spec.head_dim**-0.5, self.window))  # [T, hidden]
        normed, hidden = ops.add_rms_norm(hidden, delta, self.post_attention_norm, spec.rms_norm_eps)
        return hidden, self.mlp(normed)

    def _qk_normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3: RMSNorm over each head of q and k (fp32 statistics); others unchanged."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        spec, tokens = self.spec, qkv.shape[0]
        q, k, v = split_heads(qkv, tokens, (spec.num_heads, spec.num_kv_heads, spec.head_dim))
        q = self.ops.rms_norm(q, self.q_norm, spec.rms_norm_eps).reshape(tokens, -1)
        k = self.ops.rms_norm(k, self.k_norm, spec.rms_norm_eps).reshape(tokens, -1)
        return torch.cat((q, k, v.reshape(tokens, -1)), dim=1)
