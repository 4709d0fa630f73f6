"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE. Their layers are the shared pre-norm block (model/block.py) as is; what sets
them apart is data the block reads from the spec (q/k/v biases, q/k norms, experts, a sliding window)."""

from __future__ import annotations

from deterministic_inference.model.block import DecoderLayer
from deterministic_inference.model.family import Family

LLAMA = Family(
    name="llama",
    architectures=("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral"),
    layer=DecoderLayer,
)
