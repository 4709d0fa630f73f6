"""The checkpoint file format: checksummed records, a torn last record dropped, damage refused, the
engine fingerprint bound once."""

from __future__ import annotations

from pathlib import Path

import pytest

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import checkpoint

HEADER = {"manifest_id": "sha256:" + "a" * 64}


def _with_segments(tmp_path: Path, count: int) -> Path:
    target = tmp_path / "run"
    stored = checkpoint.create(checkpoint.checkpoint_dir(target), HEADER)
    for index in range(count):
        stored.add_segment({"index": index, "request_ids": [f"r{index}"], "value": 0.1 + index}, None)
    stored.close()
    return checkpoint.checkpoint_dir(target) / checkpoint.RECORDS_FILE


def test_records_round_trip_floats_exactly(tmp_path: Path) -> None:
    records = _with_segments(tmp_path, 2)
    loaded = checkpoint.read_records(records)
    assert not loaded.torn and loaded.valid_bytes == len(records.read_bytes())
    assert [record.get("value") for record in loaded.records] == [None, 0.1, 1.1]


@pytest.mark.parametrize("cut", [1, 40, -2])
def test_a_torn_last_record_is_dropped_and_truncated(tmp_path: Path, cut: int) -> None:
    records = _with_segments(tmp_path, 2)
    whole = records.read_bytes()
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    records.write_bytes(whole[: last_start + cut] if cut > 0 else whole[:cut])
    stored, torn = checkpoint.open_existing(checkpoint.checkpoint_dir(tmp_path / "run"))
    stored.close()
    assert torn and sorted(stored.segments) == [0]
    assert records.read_bytes() == whole[:last_start]


def test_a_bad_last_line_with_its_newline_is_dropped_but_damage_before_it_is_refused(tmp_path: Path) -> None:
    records = _with_segments(tmp_path, 2)
    lines = records.read_bytes().split(b"\n")
    lines[-2] = lines[-2].replace(b"1.1", b"1.2")
    records.write_bytes(b"\n".join(lines))
    loaded = checkpoint.read_records(records)
    assert loaded.torn and len(loaded.records) == 2
    lines[1] = lines[1].replace(b"0.1", b"0.2")
    records.write_bytes(b"\n".join(lines))
    with pytest.raises(WorkflowError, match="record 2 is corrupt"):
        checkpoint.read_records(records)


def test_engine_fingerprint_is_bound_and_a_different_one_refused(tmp_path: Path) -> None:
    target = tmp_path / "run"
    stored = checkpoint.create(checkpoint.checkpoint_dir(target), HEADER)
    stored.bind_engine({"model": "sha256:1"}, "fp-1")
    stored.close()
    reopened, _ = checkpoint.open_existing(checkpoint.checkpoint_dir(target))
    reopened.bind_engine({"model": "sha256:1"}, "fp-1")
    with pytest.raises(WorkflowError, match="was made with engine fingerprint fp-1, this engine has fp-2"):
        reopened.bind_engine({"model": "sha256:2"}, "fp-2")
    reopened.close()


def test_a_second_writer_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "run"
    first = checkpoint.create(checkpoint.checkpoint_dir(target), HEADER)
    with pytest.raises(WorkflowError, match="another detinf run is writing it"):
        checkpoint.open_existing(checkpoint.checkpoint_dir(target))
    first.close()
    second, _ = checkpoint.open_existing(checkpoint.checkpoint_dir(target))
    second.close()
