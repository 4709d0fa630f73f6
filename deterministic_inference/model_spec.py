"""Architecture hyper-parameters shared by every loader, every architecture implementation and the ops.

A leaf module: it imports nothing of this package, so `ops/` (the rotary tables, the self-check's probes)
and `model/` (loaders, architectures) both build on it without `ops/` ever importing `model/`
(tests/test_layering.py checks both rules).

A loader turns a GGUF file or an HF directory into a `ModelSpec` plus a dict of tensors named with
Hugging Face (Llama-style) parameter names, so the architectures never see file formats:

    model.embed_tokens.weight                      [vocab, hidden]
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   q: [heads*head_dim, hidden],
                                    k/v: [kv_heads*head_dim, hidden], o: [hidden, heads*head_dim]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias   (qwen2 only)
    model.layers.{i}.self_attn.{q,k}_norm.weight   [head_dim] (qwen3 only)
    model.layers.{i}.post_attention_layernorm.weight   [hidden]
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    gate/up: [inter, hidden], down: [hidden, inter]
  phi3 keeps its fused projections as stored (one GEMM each, as the split ones are computed anyway):
    model.layers.{i}.self_attn.qkv_proj.weight     [(heads + 2*kv_heads)*head_dim, hidden]: q, k, v rows
    model.layers.{i}.mlp.gate_up_proj.weight       [2*inter, hidden]: gate rows, then up rows
  mixture-of-experts layers (qwen3_moe, qwen2_moe, mixtral) have instead of the dense MLP:
    model.layers.{i}.mlp.gate.weight               [experts, hidden]: the router
    model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight   like the dense MLP's, moe_inter wide
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight  (qwen2_moe) shared_inter wide
    model.layers.{i}.mlp.shared_expert_gate.weight [1, hidden] (qwen2_moe)
    model.norm.weight                              [hidden]
    lm_head.weight                                 [vocab, hidden] (absent when tie_word_embeddings)

Q/K weights are in HF layout: rotary embedding applied as rotate-half (NeoX style) pairs (i, i + d/2).
"""

from __future__ import annotations

from dataclasses import dataclass

# rope_scaling types the rotary tables implement (ops/rope_scaling.py); anything else is refused at load
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How a model rescales its rotary frequencies (None on the spec means plain RoPE). Which fields a
    type reads (ops/rope_scaling.py computes them as transformers does):

    - linear: factor (every frequency / factor, i.e. positions / factor);
    - llama3: factor, low/high_freq_factor, original_max_position_embeddings; or, from a GGUF file,
      freq_factors: llama.cpp's per-frequency divisors (rope_freqs.weight) that replace the formula;
    - yarn: factor, original_max_position_embeddings, beta_fast/slow, truncate, and the cos/sin
      multiplier attention_factor (None: derived from factor, mscale and mscale_all_dim);
    - longrope: short_factor / long_factor (per-frequency divisors of theta^(2j/D)) and attention_factor
      (None: derived from factor and original_max_position_embeddings); which set applies is chosen
      once per model from its context length (ops/rope_scaling.longrope_uses_long_factors).
    """

    rope_type: str  # one of ROPE_SCALING_TYPES
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    freq_factors: tuple[float, ...] = ()  # llama3 from GGUF: inv_freq[j] / freq_factors[j] (fp32 values)
    beta_fast: float = 32.0  # yarn: rotations where the ramp starts (extrapolated frequencies)
    beta_slow: float = 1.0  # yarn: rotations where it ends (interpolated frequencies)
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions
    mscale: float = 0.0  # yarn: attention factor numerator scale (0: unused)
    mscale_all_dim: float = 0.0  # yarn: its denominator scale (0: unused)
    attention_factor: float | None = None  # yarn / longrope: cos and sin multiplied by it (None: derived)
    short_factor: tuple[float, ...] = ()  # longrope, [head_dim / 2]
    long_factor: tuple[float, ...] = ()  # longrope, [head_dim / 2]


@dataclass(frozen=True)
class ModelSpec:
    """Hyper-parameters of a decoder-only transformer (how its blocks are wired: model/families.py)."""

    architecture: str  # a key of the registry of model/families.py (SUPPORTED_ARCHITECTURES)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (qwen3)
    hidden_activation: str = "silu"  # the gated MLP's: "silu", or "gelu_tanh" (GeGLU: Gemma)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (every layer's MLP; 0 experts = a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # weights = softmax over the k chosen (else their full-softmax probabilities)
    shared_expert_intermediate_size: int = 0  # a sigmoid-gated shared expert's width (0: none)
    # Sliding-window attention: a windowed layer's token at position p sees keys p - sliding_window + 1..p
    sliding_window: int = 0  # 0: none (every layer sees every earlier key)
    window_layers: tuple[bool, ...] = ()  # per layer, whether it is windowed; () = every layer
    # Gemma (model/gemma.py)
    rope_local_theta: float = 0.0  # rope base of the windowed layers (0: rope_theta)
    query_pre_attn_scalar: float = 0.0  # attention scale = this ** -0.5 (0: head_dim)
    attn_logit_softcapping: float = 0.0  # scores -> tanh(s / c) * c before the softmax (0: none)
    final_logit_softcapping: float = 0.0  # logits -> tanh(l / c) * c (0: none)

    def layer_window(self, index: int) -> int:
        """The sliding window of layer `index` in keys (0: the layer sees every earlier key)."""
        return self.sliding_window if self.is_local_layer(index) else 0

    @property
    def all_layers_window(self) -> int:
        """The sliding window when EVERY layer has one (Mistral, Phi-3), else 0: a layer that sees every
        earlier key (Gemma's global layers) needs every KV block to the sequence's end."""
        windows = {self.layer_window(index) for index in range(self.num_layers)}
        return self.sliding_window if windows == {self.sliding_window} else 0

    def is_local_layer(self, index: int) -> bool:
        """Whether layer `index` is one of the windowed ("sliding_attention") kind, which Gemma also
        rotates with its local rope base; () window_layers: every layer when there is a window."""
        return self.window_layers[index] if self.window_layers else self.sliding_window > 0

    @property
    def is_moe(self) -> bool:
        """True when the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads
