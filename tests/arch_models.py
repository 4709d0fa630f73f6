"""Tiny random models of the architectures beyond Llama/Qwen (Mistral, Phi-3, Gemma 3, Gemma 2), built
locally for tests: an HF directory (transformers' config + safetensors) and the same weights as a GGUF
file with the tensor names and metadata keys llama.cpp's convert_hf_to_gguf.py writes for the architecture.

Tokenizer: the byte-level "gpt2" BPE of tests/tiny_models.py; each architecture's chat template is its
own (stored in the file), so a test can tell that the template comes from the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.tiny_models import TinyModel, build_tokenizer, permute_for_gguf, write_tokenizer_metadata

# Small enough that a test's prompts cross it, a 16-slot KV block and a prefill chunk
WINDOW = 24
# Per-architecture chat templates (what the file carries; shapes of the real ones)
TEMPLATES = {
    "mistral": "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{% endfor %}",
    "phi3": "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}",
    "gemma3": "{{ bos_token }}{% for m in messages %}"
    "{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] }}"
    "{{ '<end_of_turn>\n' }}{% endfor %}",
    "gemma2": "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] }}{% endfor %}",
}
# Gemma 2's soft caps, small so that the tiny model's scores and logits are visibly capped (real: 50, 30)
ATTN_SOFTCAP, FINAL_SOFTCAP = 0.05, 0.3


def _config(architecture: str, vocab_size: int, window: int | None) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_theta=10000.0, bos_token_id=0, eos_token_id=2, pad_token_id=0, sliding_window=window,
    )  # fmt: skip
    if architecture == "mistral":
        return transformers.MistralConfig(head_dim=16, tie_word_embeddings=False, **common)
    if architecture == "phi3":
        return transformers.Phi3Config(
            tie_word_embeddings=False, original_max_position_embeddings=512, resid_pdrop=0.0,
            embd_pdrop=0.0, attention_dropout=0.0, **common,
        )  # fmt: skip
    if architecture == "gemma3":
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}  # fmt: skip
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's fixed pattern
        common.update(num_hidden_layers=6, rope_parameters=rope, layer_types=layer_types)
        del common["rope_theta"]
        return transformers.Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
            **common,
        )  # fmt: skip
    if architecture == "gemma2":
        common.update(num_hidden_layers=4)  # layers 0, 2 windowed, 1, 3 global (llama.cpp's pattern)
        return transformers.Gemma2Config(
            head_dim=16, query_pre_attn_scalar=16, tie_word_embeddings=True,
            hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=ATTN_SOFTCAP,
            final_logit_softcapping=FINAL_SOFTCAP, **common,
        )  # fmt: skip
    raise ValueError(f"no tiny {architecture} builder")


def build_arch_hf(
    directory: Path,
    architecture: str,
    window: int | None = WINDOW,
    seed: int = 0,
    config_changes: dict[str, Any] | None = None,
) -> TinyModel:
    """A tiny random `architecture` ("mistral", "phi3") HF directory with sliding window `window` (None:
    none), its config's attributes changed by `config_changes` (e.g. rope_parameters) before the model
    is built; the returned TinyModel's `model` is the transformers reference (fp32, eval)."""
    import transformers

    tokenizer = build_tokenizer()
    config = _config(architecture, tokenizer.get_vocab_size(with_added_tokens=True), window)
    for key, value in (config_changes or {}).items():
        setattr(config, key, value)
    classes = {
        "mistral": transformers.MistralForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
    }
    torch.manual_seed(seed)
    model = classes[architecture](config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # Gemma's norms multiply by 1 + w: around 1 either way
                base = 0.0 if architecture.startswith("gemma") else 1.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True,
                  "chat_template": TEMPLATES[architecture]}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return TinyModel(directory, model, architecture)


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # llama.cpp maps phi3's fused gate_up to ffn_up
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# Gemma's norms (llama.cpp's gemma2/gemma3 names; ffn_norm is the pre-feedforward norm there)
_GEMMA_LAYER = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
# HF architecture -> GGUF general.architecture (convert_hf_to_gguf: Mistral is written as llama)
_GGUF_ARCH = {"mistral": "llama", "phi3": "phi3", "gemma3": "gemma3", "gemma2": "gemma2"}


def write_arch_gguf(
    reference: TinyModel, path: Path, quant: str = "F32", extra: Callable[[Any], object] | None = None
) -> Path:
    """`reference` as llama.cpp's converter writes it: Mistral as `llama` (q/k rows permuted), Phi-3 as
    `phi3` (fused attn_qkv and ffn_up, not permuted, its sliding window in phi3.attention.sliding_window);
    2-D weights F32 or a block format (e.g. Q8_0). `extra(writer)` adds more keys and tensors."""
    import gguf

    cfg, arch = reference.model.config, _GGUF_ARCH[reference.architecture]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{reference.architecture}")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = cfg.hidden_size // cfg.num_attention_heads if arch == "phi3" else cfg.head_dim
    writer.add_rope_dimension_count(head_dim)
    gemma = arch.startswith("gemma")
    if gemma:  # convert_hf_to_gguf writes the head dim for Gemma, not for Phi-3 / Llama
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if reference.architecture == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_sliding_window(cfg.sliding_window or 0)  # convert_hf_to_gguf writes it for phi3
    write_tokenizer_metadata(
        writer, reference.path, True, "gpt2", "smollm", TEMPLATES[reference.architecture]
    )
    for name, tensor in reference.state_dict.items():
        array = tensor.numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = permute_for_gguf(array, heads)
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0  # the converter stores Gemma's 1 + w
        target = _GLOBAL.get(name)
        if target is None:
            _, _, layer, rest = name.split(".", 3)
            names = {**_LAYER, **_GEMMA_LAYER} if gemma else _LAYER
            target = f"blk.{layer}.{names[rest]}"
        _add(writer, target, array, quant)
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: Any, name: str, array: np.ndarray, quant: str) -> None:
    import gguf

    array = np.ascontiguousarray(array)
    if quant == "F32" or array.ndim == 1:
        writer.add_tensor(name, array)
        return
    qtype = gguf.GGMLQuantizationType[quant]
    data = gguf.quants.quantize(array, qtype)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
