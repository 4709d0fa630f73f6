"""Tiny random models built locally (no downloads) for tests: HF directories and GGUF files.

Every builder is deterministic (fixed torch seed, tokenizer trained on a fixed corpus) and returns a
`TinyModel`: the path to load plus the `transformers` model as a numeric reference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a tiny tokenizer for deterministic tests.",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0123456789 and symbols: {}[]()<>=+-*/ are here too.",
    "Bitwise reproducible inference on the CPU, every time, in every batch.",
    "Grüße aus Köln: ça va? Ünïcödé tëxt wörks.",
]


@dataclass(frozen=True)
class TinyModel:
    """A tiny model on disk and its transformers reference (fp32, eval mode)."""

    path: Path  # HF directory or GGUF file to pass to load_model
    model: Any  # transformers *ForCausalLM
    architecture: str  # "llama", "qwen2", "qwen3"

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The reference weights under HF names (tied lm_head removed)."""
        sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        return sd


def build_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` with SPECIAL_TOKENS at ids 0-2 (digits split singly,
    like SmolLM2, so the GGUF pre-tokenizer 'smollm' reproduces it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return tok


def _config(
    architecture: str,
    vocab_size: int,
    tie: bool,
    max_positions: int = 512,
    heads: tuple[int, int, int] = (4, 2, 16),
) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=heads[2],
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=tie,
        bos_token_id=0 if architecture == "llama" else None,
        eos_token_id=2,
    )
    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    return classes[architecture](**common)


def _model(architecture: str, config: Any, seed: int) -> Any:
    import transformers

    classes = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }
    torch.manual_seed(seed)
    model = classes[architecture](config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norms (ones) and biases (zeros): make them non-trivial
                noise = torch.randn(param.shape, generator=generator)
                param.copy_((1.0 + 0.1 * noise) if "norm" in name else 0.05 * noise)
    return model


def build_hf_model(
    directory: Path,
    architecture: str = "llama",
    tie: bool | None = None,
    seed: int = 0,
    heads: tuple[int, int, int] = (4, 2, 16),  # (query heads, KV heads, head_dim)
) -> TinyModel:
    """Write a tiny random HF model (safetensors + tokenizer.json + tokenizer_config.json) to
    `directory`. llama: tied embeddings, BOS added; qwen2: untied, no BOS; qwen3: tied, no BOS."""
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    tie = architecture != "qwen2" if tie is None else tie
    model = _model(architecture, _config(architecture, vocab, tie, heads=heads), seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    tok_config = {
        "bos_token": "<|endoftext|>" if architecture == "llama" else None,
        "eos_token": "<|im_end|>",
        "add_bos_token": architecture == "llama",
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return TinyModel(directory, model, architecture)


def build_wide_vocab_model(directory: Path, vocab_size: int = 50048, max_positions: int = 8192) -> Path:
    """A tiny llama whose vocabulary is `vocab_size` (the BPE tokenizer plus added tokens ``<tN>``) and
    whose context is `max_positions`: for clients that send random token ids up to 50000 (SGLang's
    determinism script) and prompts of thousands of tokens. Returns the HF directory."""
    tokenizer = build_tokenizer()
    base = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_tokens([f"<t{i}>" for i in range(vocab_size - base)])
    model = _model("llama", _config("llama", vocab_size, True, max_positions), seed=3)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    tok_config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": True,
                  "chat_template": CHATML_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return directory


def permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF rotate-half q/k rows -> interleaved pairs, the layout llama.cpp stores for `llama`."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def _merges(tokenizer_json: dict[str, Any]) -> list[str]:
    merges = tokenizer_json["model"]["merges"]
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in merges]


def write_gguf(
    reference: TinyModel,
    path: Path,
    quant: str = "F32",
    add_bos: bool = True,
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
) -> TinyModel:
    """Write the tiny llama `reference` as a GGUF file like llama.cpp's converter would: q/k rows
    permuted, tokenizer metadata ('gpt2' BPE, pre 'smollm'), tensors F32 or Q8_0 (2-D weights only)."""
    import gguf

    if reference.architecture != "llama":
        raise ValueError("write_gguf writes llama models only")
    cfg = reference.model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    write_tokenizer_metadata(writer, reference.path, add_bos, tokenizer_model, pre)
    for name, tensor in reference.state_dict.items():
        array = tensor.numpy().astype(np.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            array = permute_for_gguf(array, heads)
        if quant == "Q8_0" and array.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, reference.model, "llama")


def write_tokenizer_metadata(  # noqa: PLR0913
    writer: Any,
    hf_dir: Path,
    add_bos: bool,
    tokenizer_model: str,
    pre: str,
    chat_template: str = CHATML_TEMPLATE,
) -> int:
    """The tokenizer of the HF directory as GGUF metadata (BPE 'gpt2' style) with `chat_template`;
    returns the token count."""
    tok_json = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok_json["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(_merges(tok_json))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(chat_template)
    return len(tokens)


def transformers_llama(loaded: Any) -> Any:
    """A transformers `LlamaForCausalLM` (fp32, eval) holding a `LoadedModel`'s Llama weights: the
    numeric reference for tests and the HF baseline of the benchmarks. eos handling is off."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers_llama_config(loaded.spec)).eval()
    from deterministic_inference.ops.weights import dense

    model.load_state_dict({name: dense(w, torch.float32) for name, w in loaded.weights.items()}, strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def transformers_llama_config(spec: Any) -> Any:
    """The transformers `LlamaConfig` of a Llama `ModelSpec` (used by `transformers_llama` and by the
    benchmarks' bf16 HF copies of a model)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
