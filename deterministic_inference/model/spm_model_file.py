"""Read a SentencePiece `tokenizer.model` (a protobuf `ModelProto`) without protobuf or sentencepiece.

Only what the tokenizer needs is read: the pieces (text, score, type), the trainer's model type and
special ids, and the normalizer's add_dummy_prefix. Field numbers are those of sentencepiece's
`sentencepiece_model.proto`; the piece types equal llama.cpp's token types (1 normal ... 6 byte).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

from deterministic_inference.errors import ModelLoadError

MODEL_TYPE_BPE = 2
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


@dataclass
class SentencePieceModel:
    """The parts of a SentencePiece model file the tokenizer is built from."""

    pieces: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    types: list[int] = field(default_factory=list)  # 1 normal, 2 unknown, 3 control, 4 user, 5 unused, 6 byte
    model_type: int = 1  # 1 unigram, 2 BPE, 3 word, 4 char (the proto's default is unigram)
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    add_dummy_prefix: bool = True


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one message: ints for varints and fixed, bytes otherwise."""
    out: list[tuple[int, int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == _VARINT:
            value, pos = _varint(data, pos)
        elif wire in (_FIXED32, _FIXED64):
            width = 4 if wire == _FIXED32 else 8
            value = int.from_bytes(data[pos : pos + width], "little")
            pos += width
        elif wire == _BYTES:
            size, pos = _varint(data, pos)
            value = data[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > len(data):
            raise ValueError("truncated field")
        out.append((number, wire, value))
    return out


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _piece(model: SentencePieceModel, data: bytes) -> None:
    text, score, kind = "", 0.0, 1
    for number, wire, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            text = value.decode("utf-8")
        elif number == 2 and wire == _FIXED32 and isinstance(value, int):
            score = struct.unpack("<f", value.to_bytes(4, "little"))[0]
        elif number == 3 and isinstance(value, int):
            kind = value
    model.pieces.append(text)
    model.scores.append(score)
    model.types.append(kind)


def _trainer(model: SentencePieceModel, data: bytes) -> None:
    for number, _, value in _fields(data):
        if isinstance(value, int) and number in (3, 40, 41, 42):
            if number == 3:
                model.model_type = value
            else:
                setattr(model, {40: "unk_id", 41: "bos_id", 42: "eos_id"}[number], _signed(value))


def read_sentencepiece_model(path: Path) -> SentencePieceModel:
    """The pieces and settings of the SentencePiece model file at `path`; ModelLoadError when it is not
    a readable model."""
    try:
        data = path.read_bytes()
        model = SentencePieceModel()
        for number, _, value in _fields(data):
            if number == 1 and isinstance(value, bytes):
                _piece(model, value)
            elif number == 2 and isinstance(value, bytes):
                _trainer(model, value)
            elif number == 3 and isinstance(value, bytes):
                for sub, _, flag in _fields(value):
                    if sub == 3 and isinstance(flag, int):
                        model.add_dummy_prefix = bool(flag)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable SentencePiece model: {exc}") from exc
    if not model.pieces:
        raise ModelLoadError(f"{path}: the SentencePiece model has no pieces")
    return model
