"""``detinf inspect``: a short summary of a manifest, lock, bundle.json, run directory or tar.gz bundle."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.canonical import lock_id
from deterministic_inference.workflow.lock import LOCK_KIND
from deterministic_inference.workflow.manifest import load_manifest, read_document, unset_digests
from deterministic_inference.workflow.migrate import SEED_LOCK_KIND, SEED_MANIFEST_KIND
from deterministic_inference.workflow.rundir import BUNDLE_FILE, RUN_KIND, RunDir, open_run


def inspect_path(path: Path) -> dict[str, Any]:
    """A JSON-ready summary of whatever `path` is."""
    if path.is_dir() or path.name.endswith((".tar.gz", ".tgz")):
        with open_run(path) as run:
            return run_summary(run)
    if not path.is_file():
        raise WorkflowError(f"{path}: no such file or directory")
    document = read_document(path)
    kind = document.get("kind")
    if kind == LOCK_KIND or kind == SEED_LOCK_KIND:
        return lock_summary(document, path)
    if kind == RUN_KIND:
        if path.name == BUNDLE_FILE:
            with open_run(path.parent) as run:
                return run_summary(run)
        return {"type": "run record", "run_id": document.get("run_id"), "complete": document.get("complete")}
    if kind == "detinf.verify_report":
        return {"type": "verify report", "grade": document.get("grade"), "reasons": document.get("reasons")}
    if kind in (None, "detinf.manifest", SEED_MANIFEST_KIND) or "x_base_manifest" in document:
        return manifest_summary(path)
    raise WorkflowError(f"{path}: unknown kind {kind!r}; inspect reads manifests, locks, "
                        "bundle.json and bundles")


def manifest_summary(path: Path) -> dict[str, Any]:
    """Summary of a manifest (inheritance resolved)."""
    manifest = load_manifest(path)
    data = manifest.data
    inference = data["inference"]
    return {
        "type": "manifest",
        "name": manifest.name,
        "kind": manifest.origin_kind,
        "manifest_id": manifest.manifest_id,
        "inherits": [str(item) for item in manifest.chain[1:]],
        "model_source": data["model"]["source"],
        "model_files": len(data["model"]["files"]),
        "unset_digests": unset_digests(data),
        "dataset": inference["dataset"]["source"],
        "n_prompts": inference["n_prompts"],
        "sampling": inference["request_template"]["sampling"],
        "backend": data["runtime"]["execution"]["backend"],
        "network_policy": data["runtime"]["network_policy"],
        "captures": {name: (value if isinstance(value, bool) else value.get("enabled"))
                     for name, value in data["capture"].items()},
        "warnings": list(manifest.warnings),
    }


def lock_summary(document: dict[str, Any], path: Path) -> dict[str, Any]:
    """Summary of a lock (ours or the seed tool's)."""
    if document.get("kind") == SEED_LOCK_KIND:
        items = document.get("artifacts", [])
        unset = [item.get("name") for item in items if item.get("digest") == "sha256:unset"]
        return {"type": "seed-tool lock", "lock_id": document.get("lock_id"),
                "manifest_id": document.get("manifest_id"), "artifacts": len(document.get("artifacts", [])),
                "unset_digests": len(unset), "note": "not a detinf lock; run `detinf lock` for one"}
    software = document.get("runtime_closure", {}).get("software", {})
    return {
        "type": "lock",
        "lock_id": document.get("lock_id"),
        "lock_id_valid": document.get("lock_id") == lock_id(document),
        "manifest_id": document.get("manifest_id"),
        "model_files": [f"{item['path']} {item['digest']}"
                        for item in document.get("model", {}).get("files", [])],
        "dataset": document.get("dataset"),
        "runtime_closure_digest": document.get("runtime_closure_digest"),
        "software_digest": document.get("software_digest"),
        "python": software.get("python", {}).get("version"),
        "torch": software.get("torch", {}).get("version"),
        "distributions": len(software.get("distributions", [])),
    }


def run_summary(run: RunDir) -> dict[str, Any]:
    """Summary of a complete run directory or bundle."""
    bundle = run.bundle
    sequences = run.tokens["sequences"]
    run_log = run.read_json("run_log.json") or {}
    return {
        "type": "run",
        "path": str(run.path),
        "run_id": bundle["run_id"],
        "manifest": bundle.get("manifest_name"),
        "manifest_id": bundle["manifest_id"],
        "lock_id": bundle["lock_id"],
        "backend": bundle["backend"],
        "system_fingerprint": bundle["system_fingerprint"],
        "fingerprint": bundle["fingerprint"],
        "sequences": len(sequences),
        "output_tokens": sum(len(item.get("output_token_ids") or []) for item in sequences),
        "finish_reasons": dict(sorted(Counter(str(item.get("finish_reason")) for item in sequences).items())),
        "files": sorted(bundle["files"]),
        "timings": run_log.get("timings"),
        "warnings": run_log.get("warnings", []),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """`key: value` lines of a summary, nested values as compact JSON."""
    import json

    lines = []
    for key, value in summary.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)
        lines.append(f"{key}: {text}")
    return lines

