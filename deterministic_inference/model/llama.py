"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Phi-3, Qwen2, Qwen3) and its
mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE: the MLP is a `MoEBlock`, model/moe.py).

Qwen2 adds biases to the q/k/v projections; Qwen3 adds an RMSNorm over each head of q and k before the
rotary embedding; Phi-3 stores q/k/v and gate/up fused (read as stored: the same GEMMs); Mistral and
Phi-3 may attend over a sliding window. Everything else is the shared pre-norm block. All state arrives
as arguments (the KV caches and attention metadata), never through a global.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from deterministic_inference.model.moe import GatedMLP, MoEBlock
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.backend import KVCache, Numerics, OpsBackend, select_backend, split_heads
from deterministic_inference.ops.fused import FusedDecoder
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.probes import BlockProbe, dtype_name
from deterministic_inference.ops.repack import give_back_superseded
from deterministic_inference.ops.rope import RotaryTable
from deterministic_inference.ops.rope_scaling import rope_variant
from deterministic_inference.ops.weights import StoredWeight, dense, dtype_format

# layer_hook(layer_index, hidden): called with [T, hidden] after each block and (index L) after the final norm
LayerHook = Callable[[int, torch.Tensor], None]

__all__ = ["DecoderLayer", "DecoderModel", "LayerHook", "Numerics"]


class DecoderLayer:
    """One pre-norm transformer block: attention then gated MLP, each with a residual add, written
    against the ops backend (`ops/backend.py`), so it is the same code in every mode."""

    fusable = True  # the fused decoder (ops/fused.py FusableLayer) runs this exact sequence of kernels

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

        qkv: tuple[str, ...] = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
        if spec.fused_projections:
            qkv = ("self_attn.qkv_proj.weight",)
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
        self.mlp = (
            MoEBlock(spec, weights, mlp, ops) if spec.is_moe else GatedMLP(ops, weights, mlp, spec.is_gemma)
        )
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


class DecoderModel:
    """Embedding, decoder layers, final norm and the fp32 logits head of a Llama-family model.

    The ops backend is chosen here, once, from `numerics` (`select_backend`); `ops` passes one built on
    that choice instead (the RL policy's autograd wrapper around the same kernels, `rl/backend.py`)."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, StoredWeight],
        numerics: Numerics,
        max_positions: int,
        ops: OpsBackend | None = None,
    ):
        self.spec = spec
        self.numerics = numerics
        # The compiled kernels in invariant mode (raises NativeBuildError without a compiler).
        self.ops = ops if ops is not None else select_backend(numerics)
        self.embed = self.ops.embedding(weights["model.embed_tokens.weight"])  # [vocab, hidden]
        # Gemma scales the embedding by sqrt(hidden), the scale rounded to the model dtype as HF does
        self.embed_scale = torch.tensor(spec.hidden_size**0.5).to(numerics.dtype) if spec.is_gemma else None
        layer_class = DecoderLayer
        if spec.is_gemma:
            from deterministic_inference.model.gemma import GemmaLayer  # builds on this module

            layer_class = GemmaLayer
        self.layers: list[DecoderLayer] = []
        for index in range(spec.num_layers):
            self.layers.append(layer_class(spec, weights, index, self.ops))
            # pages of repacked tensors that reading the next ones mapped back (large folios): given back
            # per layer, so they do not pile up until the model is built (ops/repack.py)
            give_back_superseded(weights.values())
        # every layer of a step in one C call when the layers allow it (the same bits: ops/fused.py)
        self.fused = FusedDecoder.build(getattr(self.ops, "kernels", None), self.layers)
        self.final_norm = dense(weights["model.norm.weight"], numerics.dtype)
        head = weights["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
        # Logits in fp32 whatever the model dtype: fp32 sums of the model-dtype weight and hidden state.
        self.lm_head = self.ops.logits_head(head)
        self.rotary = self.ops.rotary_table(spec.head_dim, spec.rope_theta, max_positions, spec.rope_scaling)
        # Gemma 3's windowed layers rotate with their own base (rope_local_base_freq), never scaled (HF:
        # rope_scaling / a scaled rope_parameters type applies to the full-attention layers only)
        self.local_rotary = self.rotary
        if spec.rope_local_theta and (spec.rope_local_theta != spec.rope_theta or spec.rope_scaling):
            self.local_rotary = self.ops.rotary_table(
                spec.head_dim, spec.rope_local_theta, max_positions, None
            )
        # tensor name -> the format the model computes it in (the fingerprint's numerics); the head has
        # its own entry when tied (the embedding table read by the logits GEMM)
        formats = {"model.embed_tokens.weight": self.embed.format, "lm_head.weight": self.lm_head.formats[0]}
        formats["model.norm.weight"] = dtype_format(numerics.dtype)
        for layer in self.layers:
            formats.update(layer.weight_formats)
        self.weight_formats = dict(sorted(formats.items()))
        self.model_ops = model_ops(spec, max_positions)

    def probe_linears(self) -> list[tuple[str, Linear]]:
        """(role, linear) for the first linear of each role and weight-format mix (what the start-up
        self-check probes: every format the model computes in, at its real shape)."""
        found: dict[tuple[str, tuple[str, ...]], Linear] = {}
        for layer in self.layers:
            for role, linear in layer.probe_linears():
                found.setdefault((role, linear.formats), linear)
        found[("lm_head", self.lm_head.formats)] = self.lm_head
        return [(role, linear) for (role, _), linear in found.items()]

    def probe_blocks(self) -> list[BlockProbe]:
        """Whole blocks the self-check probes as row functions: the first mixture-of-experts MLP (router,
        routing, expert GEMMs and the ordered sum with the model's own weights); none for dense models."""
        spec = self.spec
        for layer in self.layers:
            if isinstance(layer.mlp, MoEBlock):
                linears = layer.mlp.probe_linears()
                formats = "+".join(sorted({fmt for _, linear in linears for fmt in linear.formats}))
                shape = (
                    f"[M, {spec.hidden_size}] {spec.num_experts} experts top-{spec.num_experts_per_tok} "
                    f"{dtype_name(self.numerics.dtype)} weights {formats.lower()}"
                )
                return [BlockProbe("moe", shape, layer.mlp, spec.hidden_size)]
        return []

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        layer_hook: LayerHook | None = None,
        fused: bool = True,
    ) -> torch.Tensor:
        """-> final-normed hidden states [T, hidden] in the model dtype. `fused=False` forces the per-op
        path (the fused one gives the same bits; tests compare them); a layer hook always takes it."""
        hidden = self.embed(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            hidden = (
                hidden * self.embed_scale
            )  # one correctly rounded multiply per element: any CPU, same bits
        self.rotary.cover(positions)
        self.local_rotary.cover(positions)
        pending: torch.Tensor | None = None
        if fused and layer_hook is None and self.fused is not None:
            hidden, pending = self.fused(hidden, positions, meta, kv_caches, self.rotary)
            hidden, _ = self.ops.add_rms_norm(hidden, pending, self.final_norm, self.spec.rms_norm_eps)
            return hidden
        for index, layer in enumerate(self.layers):
            rotary = self.local_rotary if layer.local else self.rotary
            hidden, pending = layer(hidden, pending, positions, meta, kv_caches[index], rotary)
            if layer_hook is not None:
                # materialise the residual (the same rounded add as the fused kernel's)
                hidden, pending = hidden + pending, None
                layer_hook(index, hidden)
        hidden, _ = self.ops.add_rms_norm(hidden, pending, self.final_norm, self.spec.rms_norm_eps)
        if layer_hook is not None:
            layer_hook(len(self.layers), hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> fp32 logits [R, vocab]; row-invariant in invariant mode (see Linear), then
        Gemma 2's soft-capping where the model has it (elementwise)."""
        logits = self.lm_head(hidden)
        cap = self.spec.final_logit_softcapping
        return self.ops.softcap(logits, cap) if cap else logits


def model_ops(spec: ModelSpec, max_positions: int) -> tuple[str, ...]:
    """The ops a model computes beyond the Llama block's (sorted names; the fingerprint's numerics list
    them, the self-check probes each): sliding-window attention, GELU-tanh, soft-capping, Gemma's block,
    and the rotary scaling (e.g. "rope_yarn"; LongRoPE's factor set, chosen by the context
    `max_positions`, is named too: it is not in the files the model digest hashes)."""
    ops = set()
    rope = rope_variant(spec.rope_scaling, max_positions)
    if rope is not None:
        ops.add(rope)
    if any(spec.layer_window(i) for i in range(spec.num_layers)):
        ops.add("sliding_window_attention")
    if spec.is_gemma:
        ops |= {"gelu_tanh_mul", "gemma_block"}
    if spec.final_logit_softcapping or spec.attn_logit_softcapping:
        ops.add("softcap")
    return tuple(sorted(ops))
