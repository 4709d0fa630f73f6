"""Checkpoints of an embedded-engine run: finished segments kept durably beside the target, so that
``detinf run --resume`` continues a killed run and publishes the uninterrupted run's bits.

Where: ``<parent>/.detinf-ckpt-<target name>/`` beside the run directory. It holds ``records.log`` and,
when full activation tensors are captured, one ``segment-<k>.safetensors`` per segment.

``records.log`` is append-only, one record per line: ``<sha256 hex of payload> <payload>\\n`` where the
payload is the canonical JSON (`canonical.canonical_json`) of one record. Record 0 is the header (kind,
manifest_id, lock_id, dataset and requests digests, the locked model files); then an ``engine`` record
with the engine fingerprint, one ``segment`` record per finished submission group (sequences with
logprobs, engine-trace steps numbered from 0, activation digests, the tensor file's digest) and one
``resume`` record per resume. Every append is fsync'd before the run goes on; a new file and its folder
are fsync'd too. Reading stops at the first line without its newline or, on the last line only, with a
checksum that does not match: that is a record torn by a kill, dropped and truncated away, never
trusted. A bad record anywhere else means the file was damaged: the checkpoint is refused.

Why a resumed run is bitwise the uninterrupted one: a segment's outputs are a pure function of its
requests (the determinism contract), its engine trace and activations are made on an engine whose
prefix cache was flushed before the segment (so they do not depend on earlier segments), and the
segments are fixed by the request list and manifest alone. A finished segment read back gives the same
numbers: canonical JSON round-trips every float exactly.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.canonical import (
    canonical_bytes,
    digest_bytes,
    digest_json,
    loads_strict,
    sha256_hex,
)
from deterministic_inference.workflow.rundir import sync_dir, write_synced

CHECKPOINT_PREFIX = ".detinf-ckpt-"
RECORDS_FILE = "records.log"
KIND = "detinf.checkpoint"
# Test hook, not a user setting: "N:POINT[:ONCE_FILE]" makes the process SIGKILL itself while appending
# segment record N (1-based, counted over the whole file) at POINT: mid_record, before_fsync or
# after_fsync. With ONCE_FILE, only a process that creates that file fires (so one kill in all).
TEST_KILL_HOOK = "DETINF_TEST_HOOK_CHECKPOINT_KILL"
KILL_POINTS = ("mid_record", "before_fsync", "after_fsync")


def checkpoint_dir(target: Path) -> Path:
    """The checkpoint folder of a run directory."""
    return target.parent / f"{CHECKPOINT_PREFIX}{target.name}"


@dataclass
class Loaded:
    """What a records file held: its valid records, and whether a torn last record was dropped."""

    records: list[dict[str, Any]]
    valid_bytes: int  # length of the prefix of complete, checksummed records
    torn: bool


def encode_record(record: dict[str, Any]) -> bytes:
    """One line of records.log: checksum, a space, the canonical JSON payload, a newline."""
    payload = canonical_bytes(record)
    return sha256_hex(payload).encode() + b" " + payload + b"\n"


def read_records(path: Path) -> Loaded:
    """Parse records.log, dropping a torn last record and refusing damage anywhere else."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail: bytes after the last newline (a torn record) or b""
    records: list[dict[str, Any]] = []
    valid = 0
    for number, line in enumerate(complete):
        record = _decode(line)
        if record is None:
            if number == len(complete) - 1 and not tail:
                return Loaded(records, valid, torn=True)
            raise WorkflowError(f"checkpoint {path}: record {number + 1} is corrupt (checksum mismatch); "
                                f"remove {path.parent} to start the run over")
        records.append(record)
        valid += len(line) + 1
    return Loaded(records, valid, torn=bool(tail))


def _decode(line: bytes) -> dict[str, Any] | None:
    checksum, _, payload = line.partition(b" ")
    if sha256_hex(payload).encode() != checksum:
        return None
    try:
        record = loads_strict(payload.decode("utf-8"), "checkpoint record")
    except (UnicodeDecodeError, WorkflowError):
        return None
    return record if isinstance(record, dict) else None


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Checkpoint:
    """An open checkpoint: the segments finished so far and the appender for new ones."""

    path: Path  # the checkpoint folder
    header: dict[str, Any]
    segments: dict[int, dict[str, Any]] = field(default_factory=dict)  # segment index -> record
    engine: dict[str, Any] | None = None  # the engine record, once written
    resumes: list[dict[str, Any]] = field(default_factory=list)
    created: bool = False  # made by this process (removed again when it fails before any segment)
    last_written_at: str | None = None  # time of the newest record (about when the run was interrupted)
    _descriptor: int = -1

    @property
    def records_path(self) -> Path:
        """The records file."""
        return self.path / RECORDS_FILE

    def append(self, record: dict[str, Any]) -> None:
        """Append one record durably (written and fsync'd before returning)."""
        line = encode_record(record)
        point = _kill_point(record, len(self.segments) + 1)
        if point == "mid_record":
            os.write(self._descriptor, line[: len(line) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        os.write(self._descriptor, line)
        if point == "before_fsync":
            os.kill(os.getpid(), signal.SIGKILL)
        os.fsync(self._descriptor)
        if point == "after_fsync":
            os.kill(os.getpid(), signal.SIGKILL)

    def add_segment(self, record: dict[str, Any], tensors: bytes | None) -> None:
        """Keep a finished segment: its tensor file first (fsync'd), then its record naming the file."""
        record = dict(record, type="segment", written_at=now(), tensors=None)
        if tensors is not None:
            name = f"segment-{record['index']}.safetensors"
            _write_synced(self.path / name, tensors)
            record["tensors"] = {"file": name, "digest": digest_bytes(tensors)}
        self.append(record)
        self.segments[record["index"]] = record

    def segment_tensors(self, index: int) -> bytes | None:
        """The tensor bytes of a finished segment, checked against its record's digest."""
        entry = self.segments[index].get("tensors")
        if entry is None:
            return None
        file_path = self.path / entry["file"]
        data = file_path.read_bytes() if file_path.is_file() else b""
        if digest_bytes(data) != entry["digest"]:
            raise WorkflowError(f"checkpoint {file_path}: missing or its digest differs from the record; "
                                f"remove {self.path} to start the run over")
        return data

    def bind_engine(self, engine_fingerprint: dict[str, Any], system_fingerprint: str) -> None:
        """Record the engine's fingerprint, or refuse one that differs from the checkpoint's."""
        if self.engine is None:
            self.engine = {"type": "engine", "fingerprint": engine_fingerprint,
                           "system_fingerprint": system_fingerprint}
            self.append(self.engine)
            return
        if canonical_bytes(self.engine["fingerprint"]) != canonical_bytes(engine_fingerprint):
            raise WorkflowError(f"--resume: the checkpoint at {self.path} was made with engine fingerprint "
                                f"{self.engine['system_fingerprint']}, this engine has {system_fingerprint}; "
                                f"resume with the same model, numerics and software, or remove {self.path} "
                                "to start over")

    def close(self) -> None:
        """Release the file (and its lock)."""
        if self._descriptor >= 0:
            os.close(self._descriptor)
            self._descriptor = -1

    def remove(self) -> None:
        """Delete the checkpoint (after the run directory was published)."""
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _kill_point(record: dict[str, Any], segment_number: int) -> str | None:
    """The test hook's kill point for this record, if it names it."""
    hook = os.environ.get(TEST_KILL_HOOK)
    if not hook or record.get("type") != "segment":
        return None
    number, _, rest = hook.partition(":")
    point, _, once_file = rest.partition(":")
    if point not in KILL_POINTS or not number.isdigit():
        raise WorkflowError(f"{TEST_KILL_HOOK}={hook}: expected N:POINT[:ONCE_FILE] with POINT one of "
                            f"{KILL_POINTS}")
    if int(number) != segment_number:
        return None
    if once_file:
        try:
            os.close(os.open(once_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
    return point


def _write_synced(path: Path, data: bytes) -> None:
    """A new file written and fsync'd, then its folder, so the file's entry survives a kill too."""
    write_synced(path, data)
    sync_dir(path.parent)


def _lock_file(path: Path) -> int:
    descriptor = os.open(path, os.O_RDWR | os.O_APPEND)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise WorkflowError(f"checkpoint {path.parent}: another detinf run is writing it; wait for that run "
                            "to end") from None
    return descriptor


def create(folder: Path, header: dict[str, Any]) -> Checkpoint:
    """A new, empty checkpoint in `folder` holding only its header (durably)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.mkdir(exist_ok=True)
    _write_synced(folder / RECORDS_FILE, encode_record(dict(header, kind=KIND, type="header",
                                                            created_at=now())))
    sync_dir(folder.parent)
    return Checkpoint(folder, header, created=True, _descriptor=_lock_file(folder / RECORDS_FILE))


def open_existing(folder: Path) -> tuple[Checkpoint, bool]:
    """The checkpoint in `folder`, locked, its torn last record truncated away; and whether one was."""
    records_path = folder / RECORDS_FILE
    if not records_path.is_file():
        raise WorkflowError(f"checkpoint {folder}: has no {RECORDS_FILE}; remove {folder} to start over")
    descriptor = _lock_file(records_path)
    try:
        loaded = read_records(records_path)
        if not loaded.records or loaded.records[0].get("kind") != KIND:
            raise WorkflowError(f"checkpoint {records_path}: no valid header; remove {folder} to start over")
        if loaded.torn:
            os.ftruncate(descriptor, loaded.valid_bytes)
            os.fsync(descriptor)
    except BaseException:
        os.close(descriptor)
        raise
    checkpoint = Checkpoint(folder, loaded.records[0], _descriptor=descriptor)
    for record in loaded.records:
        stamp = record.get("written_at") or record.get("resumed_at") or record.get("created_at")
        checkpoint.last_written_at = stamp if isinstance(stamp, str) else checkpoint.last_written_at
        if record.get("type") == "segment":
            checkpoint.segments[int(record["index"])] = record
        elif record.get("type") == "engine":
            checkpoint.engine = record
        elif record.get("type") == "resume":
            checkpoint.resumes.append(record)
    return checkpoint, loaded.torn


def count_requests(checkpoint: Checkpoint) -> int:
    """Requests finished in a checkpoint."""
    return sum(len(record["request_ids"]) for record in checkpoint.segments.values())


# Header fields a resume must match, in the order they are checked (the first that differs is named).
IDENTITY = (("model_files", "model files"), ("manifest_id", "manifest"), ("lock_id", "lock"),
            ("dataset_digest", "prompt dataset"), ("shard", "shard"), ("requests_digest", "requests"))


def check_identity(folder: Path, made_for: dict[str, Any], header: dict[str, Any]) -> None:
    """Refuse, naming the first difference, a checkpoint (header `made_for`) made for other inputs than
    this run's (`header`)."""
    for key, label in IDENTITY:
        made_with, now = made_for.get(key), header.get(key)
        if canonical_bytes(made_with) == canonical_bytes(now):
            continue
        if key == "model_files":
            made_with, now = digest_json(made_with), digest_json(now)
        raise WorkflowError(f"--resume: the checkpoint at {folder} was made with {label} "
                            f"{made_with}, this run has {now}; restore the {label} it was made with, "
                            f"or remove {folder} to start over")

