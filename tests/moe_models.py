"""Tiny random mixture-of-experts models built locally (no downloads): HF directories written by
`transformers` (Qwen3-MoE, Mixtral, Qwen2-MoE with a shared expert) and GGUF files of them laid out like
llama.cpp's converter (3-D `ffn_*_exps` expert stacks, `ffn_gate_inp` router, F32 or quantized)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.tiny_models import (
    CHATML_TEMPLATE,
    TinyModel,
    build_tokenizer,
    permute_for_gguf,
    write_tokenizer_metadata,
)

# architecture -> (transformers config class, model class, MoE config fields)
_MOE = {
    "qwen3_moe": (
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, norm_topk_prob=False),
    ),
}  # fmt: skip


def build_moe_hf(directory: Path, architecture: str, seed: int = 0) -> TinyModel:
    """A tiny random MoE model of `architecture` (fp32, 2 layers, hidden 64) saved as an HF directory."""
    import transformers

    config_name, model_name, moe = _MOE[architecture]
    tokenizer = build_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True), hidden_size=64,
        intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=architecture == "qwen3_moe", eos_token_id=2, bos_token_id=None, **moe,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms (ones) and biases (zeros): make them non-trivial
                noise = torch.randn(param.shape, generator=generator)
                param.copy_((1.0 + 0.1 * noise) if "norm" in name else 0.05 * noise)
            elif name.endswith(("gate.weight", "router.weight")) and "shared" not in name:
                param.copy_(torch.randn(param.shape, generator=generator))  # routers that spread tokens
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
                  "chat_template": CHATML_TEMPLATE}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return TinyModel(directory, model, architecture)


def hf_tensors(reference: TinyModel) -> dict[str, np.ndarray]:
    """The reference's weights as fp32 arrays under model_spec.py's names (experts one by one)."""
    from deterministic_inference.model.moe_loading import hf_moe_weights

    out: dict[str, np.ndarray] = {}
    for name, tensor in reference.state_dict.items():
        for hf_name, value in hf_moe_weights(name, tensor.float()).items():
            out[hf_name] = value.numpy()
    return out


_GGUF_PREFIX = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}  # fmt: skip
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip


def write_moe_gguf(reference: TinyModel, path: Path, quant: str = "F32") -> Path:
    """The tiny MoE `reference` as a GGUF file: experts as 3-D stacks (quantized to `quant` when it is a
    block format the gguf package writes, e.g. Q8_0 / Q4_0; router and norms F32)."""
    import gguf

    arch = reference.architecture
    cfg, prefix = reference.model.config, _GGUF_PREFIX[arch]
    writer = gguf.GGUFWriter(str(path), prefix)
    _write_metadata(writer, cfg, prefix, arch)
    write_tokenizer_metadata(writer, reference.path, False, "gpt2", "smollm")
    tensors = hf_tensors(reference)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        if name in _GLOBAL:
            _add(writer, _GLOBAL[name], array, quant)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):
            _, _, expert, proj, _ = rest.split(".")
            experts.setdefault((int(layer), proj.removesuffix("_proj")), {})[int(expert)] = array
            continue
        if arch == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
            array = permute_for_gguf(array, heads)
        if rest == "mlp.shared_expert_gate.weight":
            array = array.reshape(-1)
        _add(writer, f"blk.{layer}.{_LAYER[rest]}", array, quant if "gate.weight" not in rest else "F32")
    for (block, proj), stack in sorted(experts.items()):
        _add(
            writer, f"blk.{block}.ffn_{proj}_exps.weight", np.stack([stack[e] for e in sorted(stack)]), quant
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: Any, cfg: Any, prefix: str, arch: str) -> None:
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_local_experts if arch == "mixtral" else cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch != "mixtral":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _add(writer: Any, name: str, array: np.ndarray, quant: str) -> None:
    import gguf

    array = np.ascontiguousarray(array.astype(np.float32))
    if quant == "F32" or array.ndim == 1:
        writer.add_tensor(name, array)
        return
    qtype = gguf.GGMLQuantizationType[quant]
    data = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
