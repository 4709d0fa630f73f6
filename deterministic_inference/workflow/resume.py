"""``detinf run --resume``: open the checkpoint of a run directory, or start one (see `checkpoint`).

Without ``--resume`` an existing checkpoint is reported and the run refused (nothing is deleted); with
it, the checkpoint must have been made for the same model files, manifest, lock, prompt dataset and
requests (and, once the engine is loaded, the same engine fingerprint), else the run is refused with
one line naming the first difference. ``--resume`` where no checkpoint exists starts from the beginning
(so a retry loop can always pass it). ``run_log.json`` gets a ``checkpoint`` section: the segments, and
for each resume when the interrupted run last wrote, when it resumed and how many requests were done.

Sharded runs (``--ray-address``) keep one checkpoint per shard in ``shard-<i>/`` inside the run's
checkpoint folder, written by the shard's worker: a shard run again (a retried attempt, or a resumed
run) continues from its own checkpoint. The folder must be reachable from the workers (a local Ray
instance, or a shared file system).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import checkpoint

if TYPE_CHECKING:
    from deterministic_inference.workflow.run import Prepared


def identity(prepared: Prepared) -> dict[str, Any]:
    """The header fields a checkpoint is made for (`checkpoint.IDENTITY`)."""
    lock = prepared.lock
    return {"model_files": lock["model"]["files"], "manifest_id": prepared.manifest.manifest_id,
            "lock_id": lock["lock_id"], "dataset_digest": lock["dataset"]["digest"],
            "requests_digest": prepared.requests_digest, "num_requests": len(prepared.requests)}


def shard_identity(run_identity: dict[str, Any], index: int, shards: int,
                   requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The header of shard `index` of `shards`: the run's, for the shard's slice of the requests."""
    from deterministic_inference.workflow.dataset import requests_digest

    return dict(run_identity, shard=f"{index + 1}/{shards}", requests_digest=requests_digest(requests),
                num_requests=len(requests))


def shard_folder(folder: Path, index: int) -> Path:
    """Where shard `index` keeps its checkpoint inside the run's checkpoint folder."""
    return folder / f"shard-{index}"


def open_checkpoint(target: Path, prepared: Prepared, resume: bool, out: TextIO) -> checkpoint.Checkpoint:
    """The checkpoint this run appends to: the existing one under `resume`, else a new one."""
    folder = checkpoint.checkpoint_dir(target)
    if not _may_continue(target, len(prepared.requests), resume, out):
        return checkpoint.create(folder, identity(prepared))
    stored = open_for(folder, identity(prepared))
    event = stored.resumes[-1]
    dropped = "; dropped a torn last record" if event["torn_record_dropped"] else ""
    print(f"resuming from {folder}: {event['requests_done']}/{event['requests_total']} requests "
          f"done{dropped}", file=out, flush=True)
    return stored


def check_sharded(target: Path, run_identity: dict[str, Any], resume: bool, out: TextIO) -> Path:
    """The run's checkpoint folder for a sharded run, after refusing one left without `resume` and one
    whose shard header is for other inputs (each shard is checked again by its worker)."""
    folder = checkpoint.checkpoint_dir(target)
    if _may_continue(target, int(run_identity["num_requests"]), resume, out):
        for records in sorted(folder.glob("shard-*/" + checkpoint.RECORDS_FILE)):
            header = checkpoint.read_records(records).records[:1]
            made_for = header[0] if header else {}
            per_shard = ("shard", "requests_digest")  # checked by the shard's worker, which knows its slice
            made_for = {key: value for key, value in made_for.items() if key not in per_shard}
            this_run = {key: value for key, value in run_identity.items() if key not in per_shard}
            checkpoint.check_identity(records.parent, made_for, this_run)
        print(f"resuming from {folder}: {_done(folder)}/{run_identity['num_requests']} requests done",
              file=out, flush=True)
    return folder


def _may_continue(target: Path, total: int, resume: bool, out: TextIO) -> bool:
    """True when a checkpoint exists and `resume` allows continuing it; refuses one without `resume`."""
    folder = checkpoint.checkpoint_dir(target)
    if not folder.exists():
        if resume:
            print(f"no checkpoint at {folder}; starting from the beginning", file=out, flush=True)
        return False
    if not resume:
        raise WorkflowError(f"{target}: an interrupted run left a checkpoint at {folder} "
                            f"({_done(folder)} of {total} requests done); pass --resume to continue it, "
                            f"or remove {folder} to start over")
    return True


def open_for(folder: Path, header: dict[str, Any]) -> checkpoint.Checkpoint:
    """Continue the checkpoint in `folder` (checked against `header`, a resume event appended), or
    create it when there is none."""
    if not (folder / checkpoint.RECORDS_FILE).is_file():
        return checkpoint.create(folder, header)
    stored, torn = checkpoint.open_existing(folder)
    try:
        checkpoint.check_identity(folder, stored.header, header)
        event = {"type": "resume", "resumed_at": checkpoint.now(),
                 "interrupted_after": stored.last_written_at,
                 "requests_done": checkpoint.count_requests(stored),
                 "requests_total": header["num_requests"], "torn_record_dropped": torn}
        stored.append(event)
    except BaseException:
        stored.close()
        raise
    stored.resumes.append(event)
    return stored


def _done(folder: Path) -> int | str:
    """Requests finished in a run's checkpoint folder (its shards' too), read without locking it."""
    done = 0
    shards = sorted(folder.glob("shard-*/" + checkpoint.RECORDS_FILE))
    for records in [folder / checkpoint.RECORDS_FILE, *shards]:
        if not records.is_file():
            continue
        try:
            loaded = checkpoint.read_records(records)
        except (OSError, WorkflowError) as error:
            return f"unreadable: {error}"
        done += sum(len(r["request_ids"]) for r in loaded.records if r.get("type") == "segment")
    return done


def checkpoint_log(stored: checkpoint.Checkpoint | None) -> dict[str, Any]:
    """run_log.json's ``checkpoint`` section (empty without a checkpoint)."""
    if stored is None:
        return {}
    resumes = [{key: value for key, value in event.items() if key != "type"} for event in stored.resumes]
    return {"checkpoint": {"segments": len(stored.segments), "interrupted": bool(resumes),
                           "resumes": resumes}}


def sharded_checkpoint_log(folder: Path) -> dict[str, Any]:
    """run_log.json's ``checkpoint`` section of a sharded run: each shard's segments and resumes."""
    shards = []
    for records in sorted(folder.glob("shard-*/" + checkpoint.RECORDS_FILE)):
        loaded = checkpoint.read_records(records).records
        resumes = [{k: v for k, v in r.items() if k != "type"} for r in loaded if r.get("type") == "resume"]
        shards.append({"shard": loaded[0].get("shard") if loaded else None, "resumes": resumes,
                       "segments": sum(1 for r in loaded if r.get("type") == "segment")})
    return {"checkpoint": {"interrupted": any(shard["resumes"] for shard in shards), "shards": shards}}


def discard(folder: Path, only_if_empty: bool) -> None:
    """Remove a run's checkpoint folder (after publishing; or after a failure, when nothing finished)."""
    if folder.exists() and (not only_if_empty or _done(folder) == 0):
        shutil.rmtree(folder, ignore_errors=True)
