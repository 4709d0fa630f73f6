"""Locks: the digests of everything a manifest's run reads, plus the runtime closure.

``detinf lock`` hashes every model file (refusing ``sha256:unset`` and any digest that differs from the
manifest), pins the dataset digest and records the runtime closure. The lock carries the id of the
manifest it was made for and its own ``lock_id`` (the digest of the lock without that field), so an edit
to a lock is detected. The file is written deterministically: locking the same manifest twice on the same
closure gives the same bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import artifacts, closure
from deterministic_inference.workflow.canonical import loads_strict
from deterministic_inference.workflow.canonical import lock_id as compute_lock_id
from deterministic_inference.workflow.dataset import load_dataset
from deterministic_inference.workflow.manifest import Manifest, unset_digests
from deterministic_inference.workflow.migrate import SEED_LOCK_KIND

LOCK_KIND = "detinf.lock"
LOCK_SCHEMA_VERSION = 1


def create_lock(manifest: Manifest) -> dict[str, Any]:
    """Hash the manifest's artifacts and resolve its closure into a lock (with lock_id)."""
    unset = unset_digests(manifest.data)
    if unset:
        raise WorkflowError(
            f"{manifest.path}: {unset[0]}: digest is 'sha256:unset'; fix: run `detinf digest-bootstrap "
            f"--config {manifest.path}` first"
        )
    data = manifest.data
    location = artifacts.locate_model(data["model"]["source"], manifest.base_dir)
    files = []
    for index, entry in enumerate(data["model"]["files"]):
        root = location.root
        if root is None:
            raise WorkflowError(
                f"{manifest.path}: $.model.files[{index}]: a remote model has no local files; "
                "fix: remove model.files"
            )
        path = root / entry["path"]
        actual = artifacts.hash_file(path, entry["path"])
        if actual != entry["digest"]:
            raise WorkflowError(
                f"{manifest.path}: $.model.files[{index}].digest: {path} has digest {actual}, "
                f"the manifest says {entry['digest']}; fix: restore the file or update the digest"
            )
        files.append({"path": entry["path"], "role": entry.get("role", "other"), "size": path.stat().st_size,
                      "digest": actual})
    dataset = load_dataset(data["inference"]["dataset"]["source"], manifest.base_dir)
    if dataset.digest != data["inference"]["dataset"]["digest"]:
        raise WorkflowError(
            f"{manifest.path}: $.inference.dataset.digest: {dataset.path} has digest {dataset.digest}, "
            f"the manifest says {data['inference']['dataset']['digest']}; "
            "fix: restore the file or update the digest"
        )
    runtime = closure.runtime_closure(data)
    lock: dict[str, Any] = {
        "schema_version": LOCK_SCHEMA_VERSION,
        "kind": LOCK_KIND,
        "generated_by": "detinf lock",
        "lock_algorithm": "sha256",
        "manifest_id": manifest.manifest_id,
        "model": _model_record(data["model"]["source"], files, location.commit),
        "dataset": {"source": dataset.source, "digest": dataset.digest, "records": len(dataset.records)},
        "runtime_closure": runtime,
        "runtime_closure_digest": closure.closure_digest(runtime),
        "software_digest": runtime["software_digest"],
    }
    lock["lock_id"] = compute_lock_id(lock)
    return lock


def _model_record(source: dict[str, Any], files: list[dict[str, Any]], commit: str | None) -> dict[str, Any]:
    """The lock's model entry; a Hugging Face source also records the commit its revision resolved to."""
    record: dict[str, Any] = {"source": source, "files": files}
    if commit is not None:
        record["commit"] = commit
    return record


def with_closure(lock: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    """A copy of `lock` with a new runtime closure and a recomputed lock_id (`build --update-lock`)."""
    updated = {key: value for key, value in lock.items() if key != "lock_id"}
    updated["runtime_closure"] = runtime
    updated["runtime_closure_digest"] = closure.closure_digest(runtime)
    updated["software_digest"] = runtime["software_digest"]
    updated["lock_id"] = compute_lock_id(updated)
    return updated


def lock_text(lock: dict[str, Any]) -> str:
    """The deterministic file form of a lock (sorted keys, 2-space indent, trailing newline)."""
    return json.dumps(lock, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def write_lock(path: Path, lock: dict[str, Any]) -> None:
    """Write a lock file atomically (temporary file, then rename)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(lock_text(lock), encoding="utf-8")
    temporary.replace(path)


def load_lock(path: Path) -> dict[str, Any]:
    """Read a lock and check its kind and lock_id; errors name the path and both digests."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkflowError(f"{path}: no lock file; run `detinf lock --config MANIFEST` first") from None
    except (OSError, UnicodeDecodeError) as error:
        raise WorkflowError(
            f"{path}: cannot read the lock ({error}); re-create it with `detinf lock`"
        ) from None
    lock = loads_strict(text, str(path))
    if not isinstance(lock, dict):
        raise WorkflowError(f"{path}: a lock must be a JSON object; re-create it with `detinf lock`")
    kind = lock.get("kind")
    if kind == SEED_LOCK_KIND:
        raise WorkflowError(
            f"{path}: this is a lock of the seed's vLLM tool; run `detinf lock` to make a detinf lock"
        )
    if kind != LOCK_KIND or lock.get("schema_version") != LOCK_SCHEMA_VERSION:
        raise WorkflowError(f"{path}: not a detinf lock (kind {kind!r}); re-create it with `detinf lock`")
    recorded = lock.get("lock_id")
    actual = compute_lock_id(lock)
    if recorded != actual:
        raise WorkflowError(
            f"{path}: lock_id {recorded} does not match the lock's content {actual}; the lock was modified: "
            "re-create it with `detinf lock`"
        )
    return lock


def check_lock_for(manifest: Manifest, lock: dict[str, Any], lock_path: Path) -> None:
    """Refuse a lock that was made for a different manifest."""
    if lock.get("manifest_id") != manifest.manifest_id:
        raise WorkflowError(
            f"{lock_path}: made for manifest {lock.get('manifest_id')}, but {manifest.path} is "
            f"{manifest.manifest_id}; run `detinf lock --config {manifest.path}` again"
        )
