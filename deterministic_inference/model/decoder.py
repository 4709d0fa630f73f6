"""The decoder model every architecture shares: embedding, the family's decoder layers, final norm and the
fp32 logits head. Which block class each layer is, and whether the embedding is scaled, the model asks
the architecture's family (model/families.py); the blocks say how they are wired (model/block.py and
the family modules). All state arrives as arguments (the KV caches and attention metadata), never
through a global.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from deterministic_inference.model.block import DecoderLayer
from deterministic_inference.model.families import family_of
from deterministic_inference.model.moe import MoEBlock
from deterministic_inference.model_spec import ModelSpec
from deterministic_inference.ops.attention import AttentionMetadata
from deterministic_inference.ops.backend import KVCache, Numerics, OpsBackend, select_backend
from deterministic_inference.ops.fused import FusedDecoder
from deterministic_inference.ops.linear import Linear
from deterministic_inference.ops.probes import BlockProbe, dtype_name
from deterministic_inference.ops.repack import give_back_superseded
from deterministic_inference.ops.rope_scaling import rope_variant
from deterministic_inference.ops.weights import StoredWeight, dense, dtype_format

# layer_hook(layer_index, hidden): called with [T, hidden] after each block and (index L) after the final norm
LayerHook = Callable[[int, torch.Tensor], None]

__all__ = ["DecoderModel", "LayerHook", "Numerics"]


class DecoderModel:
    """Embedding, decoder layers (the architecture family's block class), final norm and the fp32 logits
    head.

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
        family = family_of(spec.architecture)
        # Gemma scales the embedding by sqrt(hidden), the scale rounded to the model dtype as HF does
        scaled = family.scaled_embedding
        self.embed_scale = torch.tensor(spec.hidden_size**0.5).to(numerics.dtype) if scaled else None
        self.layers: list[DecoderLayer] = []
        for index in range(spec.num_layers):
            self.layers.append(family.layer(spec, weights, index, self.ops))
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
    them, the self-check probes each): sliding-window attention, GELU-tanh, soft-capping, the family's
    own block (e.g. "gemma_block"),
    and the rotary scaling (e.g. "rope_yarn"; LongRoPE's factor set, chosen by the context
    `max_positions`, is named too: it is not in the files the model digest hashes)."""
    ops = set()
    rope = rope_variant(spec.rope_scaling, max_positions)
    if rope is not None:
        ops.add(rope)
    if any(spec.layer_window(i) for i in range(spec.num_layers)):
        ops.add("sliding_window_attention")
    if spec.hidden_activation == "gelu_tanh":
        ops.add("gelu_tanh_mul")
    ops.update(family_of(spec.architecture).block_ops)
    if spec.final_logit_softcapping or spec.attn_logit_softcapping:
        ops.add("softcap")
    return tuple(sorted(ops))
