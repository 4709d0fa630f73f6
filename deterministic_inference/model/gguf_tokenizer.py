"""Build a `Tokenizer` from GGUF tokenizer metadata (`tokenizer.ggml.*`).

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE from the token list and merges) with the
pre-tokenizers named in PRE_TOKENIZERS, and `"llama"` (SentencePiece BPE from pieces, scores and token
types, see `spm_tokenizer`), with llama.cpp's defaults for keys a file leaves out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.spm_tokenizer import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    spm_backend,
)
from deterministic_inference.model.tokenizer import Tokenizer, end_of_turn_ids

TOKENIZER_MODELS = ("gpt2", "llama")

# Split patterns of the tokenizers families, applied before the byte-level mapping.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre() -> Any:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _split_pre(pattern: str) -> Callable[[], Any]:
    def build() -> Any:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "refact": _digits_then_gpt2_pre,
    "llama-bpe": _split_pre(_LLAMA3_SPLIT),
    "llama3": _split_pre(_LLAMA3_SPLIT),
    "qwen2": _split_pre(_QWEN2_SPLIT),
}


# Families whose HF tokenizers take a whole word from the vocab before applying merges (Llama 3).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3"})
# Families whose HF tokenizers NFC-normalise the text first (Qwen2).
_NFC = frozenset({"qwen2"})


def build_gguf_tokenizer(path: Path, meta: dict[str, Any]) -> Tokenizer:
    """A Tokenizer from the `tokenizer.*` metadata of the GGUF file at `path`."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.model is {kind!r}; supported: 'gpt2' (byte-level BPE) and 'llama' "
            "(SentencePiece). Load the model from its Hugging Face directory instead."
        )
    vocab_size = len(_required(path, meta, "tokenizer.ggml.tokens"))
    if kind == "llama":
        backend = _sentencepiece_backend(path, meta)
        defaults: dict[str, Any] = {"bos": 1, "eos": 2, "add_bos": True}  # llama.cpp's for SPM files
    else:
        backend = _vocab_backend(path, meta, _pre(path, meta))
        defaults = {"bos": None, "eos": None, "add_bos": False}
    template = meta.get("tokenizer.chat_template")
    bos = meta.get("tokenizer.ggml.bos_token_id", defaults["bos"])
    eos = meta.get("tokenizer.ggml.eos_token_id", defaults["eos"])
    eot = meta.get("tokenizer.ggml.eot_token_id")
    for name, value in (("bos", bos), ("eos", eos), ("eot", eot)):
        if value is not None and not 0 <= int(value) < vocab_size:
            raise ModelLoadError(f"{path}: tokenizer.ggml.{name}_token_id {value} is outside the vocab")
    eos_ids = {int(i) for i in (eos, eot) if i is not None}
    eos_ids |= end_of_turn_ids(backend, template)
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=sorted(eos_ids),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", defaults["add_bos"])),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        eos_token_id=None if eos is None else int(eos),
        chat_template=template,
    )


def _pre(path: Path, meta: dict[str, Any]) -> str:
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}). Load the model from its Hugging Face directory instead."
        )
    return pre


def _sentencepiece_backend(path: Path, meta: dict[str, Any]) -> tokenizers.Tokenizer:
    """The SentencePiece BPE of a "llama" vocabulary: pieces (an empty one renamed as llama.cpp does),
    scores (0 when absent, as in llama.cpp), token types, `add_space_prefix` (default true)."""
    tokens = _required(path, meta, "tokenizer.ggml.tokens")
    pieces = [piece or f"[EMPTY_{i}]" for i, piece in enumerate(tokens)]
    scores: Sequence[float] = meta.get("tokenizer.ggml.scores") or [0.0] * len(pieces)
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(pieces)
    for key, values in (("scores", scores), ("token_type", types)):
        if len(values) != len(pieces):
            raise ModelLoadError(
                f"{path}: tokenizer.ggml.{key} has {len(values)} entries, tokens {len(pieces)}"
            )
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
    name = str(meta.get("general.name", "")).lower()
    return spm_backend(
        pieces,
        scores,
        types,
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        unk_id=None if unk is None else int(unk),
        phi3_specials="phi-3" in name or "phi3" in name,
    )


def _required(path: Path, meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise ModelLoadError(f"{path}: GGUF metadata {key} is missing; the file has no usable tokenizer")
    return meta[key]


def _vocab_backend(path: Path, meta: dict[str, Any], pre: str) -> tokenizers.Tokenizer:
    """The byte-level BPE of the file's vocabulary and merges. Their ~100k Python strings live only in
    this call and are freed together on return, before the load allocates what outlives it (see
    `gguf_file.StringArray`)."""
    tokens: list[str] = list(_required(path, meta, "tokenizer.ggml.tokens"))
    merges = [_split_merge(path, m) for m in _required(path, meta, "tokenizer.ggml.merges")]
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries, tokens {len(tokens)}"
        )
    return _byte_level_bpe(tokens, merges, types, pre)


def _split_merge(path: Path, merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right:
        raise ModelLoadError(f"{path}: tokenizer.ggml.merges entry {merge!r} is not 'left right'")
    return left, right


def _byte_level_bpe(
    tokens: list[str], merges: list[tuple[str, str]], types: Sequence[int], pre: str
) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES)
    backend = tokenizers.Tokenizer(model)
    if pre in _NFC:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types)
        if kind == TOKEN_CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, kind in enumerate(types)
        if kind == TOKEN_USER_DEFINED
    ]
    backend.add_special_tokens(specials)
    backend.add_tokens(user)
    return backend
