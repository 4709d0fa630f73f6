"""SentencePiece BPE vocabularies (pieces + scores + token types) as a `tokenizers.Tokenizer`.

The one builder behind GGUF files with `tokenizer.ggml.model == "llama"` (Llama 2, Mistral v0.1-v0.3,
Phi-3, Gemma) and HF directories that ship only a `tokenizer.model`. It reproduces llama.cpp's SPM
tokenizer (`llm_tokenizer_spm`):

- text is split on special / user-defined tokens first (as llama.cpp does with parse_special on);
- each remaining fragment gets one U+2581 prepended when add_space_prefix is set, spaces become U+2581;
- the fragment's characters are merged pairwise, always the adjacent pair whose concatenation is the
  vocabulary piece with the highest score first (leftmost on equal score), until no pair is a piece;
- characters that are not pieces become their UTF-8 bytes' `<0xXX>` tokens (byte fallback).

The merge loop is a BPE whose merge list is every split (left, right) of every piece into two pieces,
ranked by the piece's score: the order of merges is then the score order. Equal scores (several splits
of one piece, padding pieces) are ranked by piece id, then split position, where llama.cpp takes the
leftmost pair in the text: two overlapping pairs of equal score (e.g. [ab][a][ba] with pieces "aba") can
merge differently. No BPE merge list can express that tie-break (HF's converted tokenizer.json files
share the limit); the tests' thousands of random texts never met it. The decoder writes U+2581 as a
space, bytes as bytes, and strips the one space the prefix added.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.spm_model_file import MODEL_TYPE_BPE, read_sentencepiece_model

# llama.cpp / gguf token types
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"

# Tokens llama.cpp always treats as control tokens (end of turn / generation), whatever their type says.
CONTROL_LOOKING = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>"}
)
# Phi-3 files: llama.cpp strips whitespace after special tokens except these (see `spm_backend`).
_PHI3_NO_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})


def spm_merges(pieces: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces, in the order SentencePiece merges them.

    Invariant: a pair is merged before another exactly when its piece scores higher (ties: lower piece
    id, then earlier split), so the ids depend only on the vocabulary, never on the text around it."""
    vocab = piece_ids(pieces)
    ranked: list[tuple[float, int, int]] = []  # (-score, piece id, cut)
    for token_id, piece in enumerate(pieces):
        if len(piece) < 2 or vocab[piece] != token_id:
            continue  # a duplicate piece: only its first id is ever produced
        score = -float(scores[token_id])
        cuts = range(1, len(piece))
        ranked += [(score, token_id, cut) for cut in cuts if piece[:cut] in vocab and piece[cut:] in vocab]
    ranked.sort()
    return [(pieces[i][:cut], pieces[i][cut:]) for _, i, cut in ranked]


def piece_ids(pieces: Sequence[str]) -> dict[str, int]:
    """piece -> its first id."""
    vocab: dict[str, int] = {}
    for token_id, piece in enumerate(pieces):
        vocab.setdefault(piece, token_id)
    return vocab


def spm_backend(
    pieces: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    *,
    add_space_prefix: bool,
    unk_id: int | None,
    phi3_specials: bool = False,
) -> tokenizers.Tokenizer:
    """The SentencePiece BPE of `pieces` as a `tokenizers.Tokenizer`.

    `types` are llama.cpp token types: control and unknown tokens become special added tokens,
    user-defined tokens plain added tokens (both matched in raw text before the merges, like llama.cpp
    with parse_special). `phi3_specials`: whitespace after a special token is dropped (llama.cpp's
    rule for files named Phi-3)."""
    vocab = piece_ids(pieces)
    unk = pieces[unk_id] if unk_id is not None and 0 <= unk_id < len(pieces) else None
    model = models.BPE(
        vocab=vocab, merges=spm_merges(pieces, scores), unk_token=unk, fuse_unk=True, byte_fallback=True
    )
    backend = tokenizers.Tokenizer(model)
    steps = [normalizers.Prepend(SPACE_MARK)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE_MARK)])
    backend.pre_tokenizer = None
    strip = [decoders.Strip(content=" ", left=1, right=0)] if add_space_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    specials, user = _added_tokens(pieces, types, phi3_specials)
    backend.add_special_tokens(specials)
    backend.add_tokens(user)
    return backend


def _added_tokens(
    pieces: Sequence[str], types: Sequence[int], phi3_specials: bool
) -> tuple[list[AddedToken], list[AddedToken]]:
    vocab = piece_ids(pieces)
    specials: list[AddedToken] = []
    user: list[AddedToken] = []
    for token_id, (piece, kind) in enumerate(zip(pieces, types, strict=True)):
        special = kind in (TOKEN_CONTROL, TOKEN_UNKNOWN) or piece in CONTROL_LOOKING
        if (not special and kind != TOKEN_USER_DEFINED) or not piece or vocab[piece] != token_id:
            continue
        rstrip = phi3_specials and piece not in _PHI3_NO_RSTRIP
        token = AddedToken(piece, special=special, normalized=False, rstrip=rstrip)
        (specials if special else user).append(token)
    return specials, user


def sentencepiece_file_backend(
    path: Path, add_prefix_space: bool | None = None
) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """(backend, {"bos": id, "eos": id}) of the SentencePiece BPE model file `path` (an HF directory's
    `tokenizer.model`), tokenized as llama.cpp tokenizes the GGUF converted from it: the prefix space
    follows the model's add_dummy_prefix unless `add_prefix_space` (tokenizer_config.json) is set."""
    model = read_sentencepiece_model(path)
    if model.model_type != MODEL_TYPE_BPE:
        raise ModelLoadError(
            f"{path}: SentencePiece model type {model.model_type} is not supported (only BPE, type 2); "
            "provide a tokenizer.json instead"
        )
    prefix = model.add_dummy_prefix if add_prefix_space is None else bool(add_prefix_space)
    unk = model.unk_id if 0 <= model.unk_id < len(model.pieces) else None
    backend = spm_backend(model.pieces, model.scores, model.types, add_space_prefix=prefix, unk_id=unk)
    named = (("bos", model.bos_id), ("eos", model.eos_id))
    ids = {name: i for name, i in named if 0 <= i < len(model.pieces)}
    return backend, ids
