"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window, Qwen2, Qwen3).

Qwen2 adds biases to the q/k/v projections; Qwen3 adds an RMSNorm over each head of q and k before the
rotary embedding. Everything else is the shared pre-norm block. All state arrives as arguments (the KV
caches and attention metadata), never through a global.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deterministic_inference.model.spec import ModelSpec
from deterministic_inference.ops.activation import silu_mul
from deterministic_inference.ops.attention import AttentionMetadata, paged_attention, write_kv
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.native import NativeKernels, native_kernels
from deterministic_inference.ops.norm import rms_norm
from deterministic_inference.ops.rope import RotaryTable

# layer_hook(layer_index, hidden): called with [T, hidden] after each block and (index L) after the final norm
LayerHook = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class Numerics:
    """How the ops compute: dtype, invariance switch and GEMM row tile."""

    dtype: torch.dtype
    batch_invariant: bool
    tile_rows: int


class DecoderLayer:
    """One pre-norm transformer block: attention then gated MLP, each with a residual add."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        index: int,
        numerics: Numerics,
        kernels: NativeKernels | None,
    ):
        prefix = f"model.layers.{index}."
        self.spec = spec
        self.numerics = numerics

        def weight(name: str) -> torch.Tensor:
            return weights[prefix + name].to(numerics.dtype)

        def linear(w: torch.Tensor, b: torch.Tensor | None = None) -> Linear:
            return Linear(
                w, b, tile_rows=numerics.tile_rows, batch_invariant=numerics.batch_invariant, kernels=kernels
            )

        names = ("q_proj", "k_proj", "v_proj")
        qkv_weight = torch.cat([weight(f"self_attn.{name}.weight") for name in names])
        qkv_bias = None
        if spec.attention_bias:
            qkv_bias = torch.cat([weight(f"self_attn.{name}.bias") for name in names])
        self.qkv = linear(qkv_weight, qkv_bias)  # [(H + 2*KVH) * D, hidden]
        self.o_proj = linear(weight("self_attn.o_proj.weight"))
        self.gate_up = linear(torch.cat([weight("mlp.gate_proj.weight"), weight("mlp.up_proj.weight")]))
        self.down = linear(weight("mlp.down_proj.weight"))
        self.input_norm = weight("input_layernorm.weight")
        self.post_attention_norm = weight("post_attention_layernorm.weight")
        self.q_norm = weight("self_attn.q_norm.weight") if spec.qk_norm else None
        self.k_norm = weight("self_attn.k_norm.weight") if spec.qk_norm else None

    def __call__(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the residual stream (updated in place on the native path)
        pending: torch.Tensor | None,  # [T, hidden]: the previous block's MLP output, not yet added
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
        kernels: NativeKernels | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (residual stream, this block's MLP output still to be added). The native kernels fuse that
        add into the next RMSNorm; the plain path adds it here and returns None."""
        if kernels is None:
            if pending is not None:
                hidden = hidden + pending
            return self._plain(hidden, positions, meta, kv_cache, rotary), None
        spec = self.spec
        tokens = hidden.shape[0]
        normed = kernels.add_rms_norm(hidden, pending, self.input_norm, spec.rms_norm_eps)
        qkv = self._qk_normed(self.qkv(normed))  # [T, (H + 2*KVH) * D]
        q = kernels.rotary_write_kv(
            qkv, positions, rotary.cos, rotary.sin, meta.write_blocks, meta.write_offsets,
            kv_cache[0], kv_cache[1], spec.num_heads,
        )  # [T, H, D] fp32  # fmt: skip
        attended = paged_attention(
            q, kv_cache[0], kv_cache[1], meta, scale=spec.head_dim**-0.5, kernels=kernels
        )
        delta = self.o_proj(attended.to(hidden.dtype).reshape(tokens, spec.num_heads * spec.head_dim))
        normed = kernels.add_rms_norm(hidden, delta, self.post_attention_norm, spec.rms_norm_eps)
        return hidden, self.down(kernels.silu_mul(self.gate_up(normed)))

    def _qk_normed(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3: RMSNorm over each head of q and k (torch ops, fp32 statistics); others unchanged."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        spec, tokens = self.spec, qkv.shape[0]
        q, k, v = self._split(qkv)
        q = rms_norm(q, self.q_norm, spec.rms_norm_eps).reshape(tokens, -1)
        k = rms_norm(k, self.k_norm, spec.rms_norm_eps).reshape(tokens, -1)
        return torch.cat((q, k, v.reshape(tokens, -1)), dim=1)

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2*KVH) * D] -> q [T, H, D], k [T, KVH, D], v [T, KVH, D] (views)."""
        spec, tokens = self.spec, qkv.shape[0]
        q_size = spec.num_heads * spec.head_dim
        kv_size = spec.num_kv_heads * spec.head_dim
        q = qkv[:, :q_size].reshape(tokens, spec.num_heads, spec.head_dim)
        k = qkv[:, q_size : q_size + kv_size].reshape(tokens, spec.num_kv_heads, spec.head_dim)
        v = qkv[:, q_size + kv_size :].reshape(tokens, spec.num_kv_heads, spec.head_dim)
        return q, k, v

    def _plain(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryTable,
    ) -> torch.Tensor:
        """The block with plain torch ops (batch_invariant=False)."""
        spec = self.spec
        tokens = hidden.shape[0]
        normed = rms_norm(hidden, self.input_norm, spec.rms_norm_eps)
        q, k, v = self._split(self._qk_normed(self.qkv(normed)))
        q = rotary.apply(q, positions)
        k = rotary.apply(k, positions)
        write_kv(kv_cache[0], kv_cache[1], k, v, meta)
        attended = paged_attention(q, kv_cache[0], kv_cache[1], meta, scale=spec.head_dim**-0.5, kernels=None)
        hidden = hidden + self.o_proj(attended.reshape(tokens, spec.num_heads * spec.head_dim))
        normed = rms_norm(hidden, self.post_attention_norm, spec.rms_norm_eps)
        gate_up = self.gate_up(normed)  # [T, 2 * inter]
        inter = spec.intermediate_size
        activated = silu_mul(gate_up[:, :inter], gate_up[:, inter:], batch_invariant=False)
        return hidden + self.down(activated)


class DecoderModel:
    """Embedding, decoder layers, final norm and the fp32 logits head of a Llama-family model."""

    def __init__(
        self, spec: ModelSpec, weights: dict[str, torch.Tensor], numerics: Numerics, max_positions: int
    ):
        self.spec = spec
        self.numerics = numerics
        # The compiled kernels in invariant mode (raises NativeBuildError without a compiler).
        self.kernels = native_kernels() if numerics.batch_invariant else None
        self.embed = weights["model.embed_tokens.weight"].to(numerics.dtype)  # [vocab, hidden]
        self.layers = [DecoderLayer(spec, weights, i, numerics, self.kernels) for i in range(spec.num_layers)]
        self.final_norm = weights["model.norm.weight"].to(numerics.dtype)
        head = weights["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
        # Logits in fp32 whatever the model dtype: fp32 sums of the model-dtype weight and hidden state.
        self.lm_head = Linear(
            head.to(numerics.dtype), None, tile_rows=numerics.tile_rows,
            batch_invariant=numerics.batch_invariant, kernels=self.kernels, out_dtype=torch.float32,
        )  # fmt: skip
        self.rotary = RotaryTable(spec.head_dim, spec.rope_theta, max_positions, spec.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] in the model dtype."""
        hidden = self.embed[input_ids]  # [T, hidden] (a fresh tensor: the native path updates it in place)
        pending: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            hidden, pending = layer(
                hidden, pending, positions, meta, kv_caches[index], self.rotary, self.kernels
            )
            if layer_hook is not None:
                if pending is not None:  # materialise the residual (the same rounded add as the kernel's)
                    hidden, pending = hidden + pending, None
                layer_hook(index, hidden)
        eps = self.spec.rms_norm_eps
        if self.kernels is not None:
            hidden = self.kernels.add_rms_norm(hidden, pending, self.final_norm, eps)
        else:
            hidden = rms_norm(hidden, self.final_norm, eps)
        if layer_hook is not None:
            layer_hook(len(self.layers), hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> fp32 logits [R, vocab]; row-invariant (see Linear: fp32 sums of the
        bf16 products in the native GEMM, else a padded fp32 GEMM)."""
        return self.lm_head(hidden)
