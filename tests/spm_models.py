"""Tiny SentencePiece vocabularies trained locally, written as GGUF metadata and as HF directories.

The references for the SentencePiece tokenizer: `sentencepiece` itself (the trained model), transformers'
Llama/Gemma tokenizers built from the same `tokenizer.model`, and llama.cpp's GGUF conventions (pieces,
scores and types written as convert_hf_to_gguf.py writes them).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from tests.tiny_models import TinyModel, permute_for_gguf

CONTROL_SYMBOLS = ("<start_of_turn>", "<end_of_turn>")
USER_SYMBOLS = ("<tool>",)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
_WORDS = (
    "the quick brown fox jumps over lazy dog hello world tokenizer sentence piece merges score byte "
    "fallback deterministic inference batch invariant stream token model llama gemma mistral phi"
).split()
_EXTRA = ["你好世界", "中文字符", "日本語", "😀", "🙂", "👍🏽", "Grüße", "ça", "naïve", "Ελληνικά", "ключ"]


def _word(rng: random.Random) -> str:
    syllables = ("ka", "lo", "mi", "ne", "tru", "st", "qu", "ing", "er", "on", "ab", "ze", "ph", "y")
    return "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))


def corpus(seed: int = 0, lines: int = 400) -> list[str]:
    """A generated training corpus: words, digits, punctuation, runs of spaces, tabs, CJK, emoji."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.6 else _word(rng) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), rng.choice(_EXTRA))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        sep = rng.choice([" ", " ", " ", "  ", "\t", ", "])
        out.append(sep.join(words) + rng.choice([".", "!", "?", ":", ""]))
    return out


def train_spm(directory: Path, add_dummy_prefix: bool = True, vocab_size: int = 600) -> Path:
    """Train a SentencePiece BPE model (byte fallback, identity normalization, control and
    user-defined symbols) on `corpus()`; returns the path of the written `tokenizer.model`."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.995,  # the rarest characters stay out: byte fallback covers them
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        control_symbols=list(CONTROL_SYMBOLS),
        user_defined_symbols=list(USER_SYMBOLS),
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.model"
    path.write_bytes(model.getvalue())
    return path


def gguf_vocab(model_path: Path) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, token types) as llama.cpp's convert_hf_to_gguf.py writes a SentencePiece
    vocabulary (its `_create_vocab_sentencepiece`: types from the processor's Is* predicates, user-defined
    pieces written as USER_DEFINED like tokenizer_config's non-special added tokens)."""
    import sentencepiece as spm

    proc = spm.SentencePieceProcessor(model_file=str(model_path))
    pieces, scores, types = [], [], []
    for i in range(proc.vocab_size()):
        pieces.append(proc.id_to_piece(i))
        scores.append(proc.get_score(i))
        kind = 1
        if proc.is_unknown(i):
            kind = 2
        elif proc.is_control(i):
            kind = 3
        elif proc.is_unused(i):
            kind = 5
        elif proc.is_byte(i):
            kind = 6
        elif pieces[-1] in USER_SYMBOLS:
            kind = 4
        types.append(kind)
    return pieces, scores, types


def write_spm_metadata(
    writer: Any,
    model_path: Path,
    *,
    add_space_prefix: bool | None = True,
    add_bos: bool | None = True,
    add_eos: bool | None = False,
    pre: str | None = "default",
    template: str | None = GEMMA_TEMPLATE,
    type_overrides: dict[str, int] | None = None,
) -> int:
    """The SentencePiece vocabulary at `model_path` as GGUF `tokenizer.ggml.*` metadata ("llama" model);
    a None flag leaves its key out (llama.cpp's default applies); `type_overrides`: piece -> token type.
    Returns the token count."""
    pieces, scores, types = gguf_vocab(model_path)
    for piece, kind in (type_overrides or {}).items():
        types[pieces.index(piece)] = kind
    writer.add_tokenizer_model("llama")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for value, add in ((add_space_prefix, writer.add_add_space_prefix), (add_bos, writer.add_add_bos_token),
                       (add_eos, writer.add_add_eos_token)):
        if value is not None:
            add(value)
    if template is not None:
        writer.add_chat_template(template)
    return len(pieces)


def write_spm_gguf(
    path: Path, model_path: Path, name: str = "tiny-spm", seed: int = 5, **flags: Any
) -> TinyModel:
    """A tiny random llama GGUF (F32) whose vocabulary is the SentencePiece model at `model_path`."""
    import gguf

    from tests.tiny_models import _config, _gguf_name, _model

    vocab_size = len(gguf_vocab(model_path)[0])
    reference = _model("llama", _config("llama", vocab_size, True), seed)
    cfg = reference.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    write_spm_metadata(writer, model_path, **flags)
    for tensor_name, tensor in reference.state_dict().items():
        if tensor_name == "lm_head.weight":
            continue  # tied
        array = tensor.detach().numpy().astype(np.float32)
        if tensor_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in tensor_name else cfg.num_key_value_heads
            array = permute_for_gguf(array, heads)
        writer.add_tensor(_gguf_name(tensor_name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, reference, "llama")


def write_spm_hf_dir(directory: Path, model_path: Path, seed: int = 5, **tok_config: Any) -> TinyModel:
    """A tiny random llama HF directory whose only tokenizer file is the SentencePiece `tokenizer.model`
    (copied in), with `tokenizer_config.json` holding `tok_config` (bos/eos texts, flags, template)."""
    from tests.tiny_models import _config, _model

    vocab_size = len(gguf_vocab(model_path)[0])
    model = _model("llama", _config("llama", vocab_size, True), seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    (directory / "tokenizer.model").write_bytes(model_path.read_bytes())
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", **tok_config}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return TinyModel(directory, model, "llama")
