"""``detinf run --resume``: open the checkpoint of a run directory, or start one (see `checkpoint`).

Without ``--resume`` an existing checkpoint is reported and the run refused (nothing is deleted); with
it, the checkpoint must have been made for the same model files, manifest, lock, prompt dataset and
requests (and, once the engine is loaded, the same engine fingerprint), else the run is refused with
one line naming the first difference. ``--resume`` where no checkpoint exists starts from the beginning
(so a retry loop can always pass it). ``run_log.json`` gets a ``checkpoint`` section: the segments, and
for each resume when the interrupted run last wrote, when it resumed and how many requests were done.
"""

from __future__ import annotations

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


def open_checkpoint(target: Path, prepared: Prepared, resume: bool, out: TextIO) -> checkpoint.Checkpoint:
    """The checkpoint this run appends to: the existing one under `resume`, else a new one."""
    folder = checkpoint.checkpoint_dir(target)
    total = len(prepared.requests)
    if not folder.exists():
        if resume:
            print(f"no checkpoint at {folder}; starting from the beginning", file=out, flush=True)
        return checkpoint.create(target, identity(prepared))
    if not resume:
        raise WorkflowError(f"{target}: an interrupted run left a checkpoint at {folder} "
                            f"({_done_text(target, total)}); pass --resume to continue it, or remove "
                            f"{folder} to start over")
    stored, torn = checkpoint.open_existing(target)
    try:
        checkpoint.check_identity(stored, identity(prepared))
        done = checkpoint.count_requests(stored)
        event = {"type": "resume", "resumed_at": checkpoint.now(),
                 "interrupted_after": stored.last_written_at, "requests_done": done,
                 "requests_total": total, "torn_record_dropped": torn}
        stored.append(event)
    except BaseException:
        stored.close()
        raise
    stored.resumes.append(event)
    dropped = "; dropped a torn last record" if torn else ""
    print(f"resuming from {folder}: {done}/{total} requests done{dropped}", file=out, flush=True)
    return stored


def _done_text(target: Path, total: int) -> str:
    """How far the checkpoint got, read without locking or changing it."""
    try:
        records = checkpoint.read_records(checkpoint.checkpoint_dir(target) / checkpoint.RECORDS_FILE).records
    except (OSError, WorkflowError) as error:
        return f"unreadable: {error}"
    done = sum(len(record["request_ids"]) for record in records if record.get("type") == "segment")
    return f"{done} of {total} requests done"


def checkpoint_log(stored: checkpoint.Checkpoint | None) -> dict[str, Any]:
    """run_log.json's ``checkpoint`` section (empty without a checkpoint)."""
    if stored is None:
        return {}
    resumes = [{key: value for key, value in event.items() if key != "type"} for event in stored.resumes]
    return {"checkpoint": {"segments": len(stored.segments), "interrupted": bool(resumes),
                           "resumes": resumes}}
