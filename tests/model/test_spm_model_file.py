"""The protobuf-free reader of SentencePiece `tokenizer.model` files against sentencepiece's own parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from deterministic_inference.errors import ModelLoadError
from deterministic_inference.model.spm_model_file import read_sentencepiece_model
from tests.spm_models import train_spm


@pytest.mark.parametrize("prefix", [True, False])
def test_reads_what_sentencepiece_reads(tmp_path: Path, prefix: bool) -> None:
    from sentencepiece import sentencepiece_model_pb2

    path = train_spm(tmp_path, add_dummy_prefix=prefix)
    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
    proto.ParseFromString(path.read_bytes())
    model = read_sentencepiece_model(path)
    assert model.pieces == [p.piece for p in proto.pieces]
    assert model.scores == [p.score for p in proto.pieces]  # float32 values, exactly
    assert model.types == [p.type for p in proto.pieces]
    assert set(model.types) == {1, 2, 3, 4, 6}
    spec = proto.trainer_spec
    assert (model.model_type, model.unk_id, model.bos_id, model.eos_id) == (
        spec.model_type, spec.unk_id, spec.bos_id, spec.eos_id
    )  # fmt: skip
    assert model.add_dummy_prefix is prefix is proto.normalizer_spec.add_dummy_prefix


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    for name, data in (("truncated", b"\x0a\x80"), ("empty", b""), ("bad-wire", b"\x0f")):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ModelLoadError, match=f"{name}: "):
            read_sentencepiece_model(path)
    with pytest.raises(ModelLoadError, match="not a readable SentencePiece model"):
        read_sentencepiece_model(tmp_path / "missing.model")
