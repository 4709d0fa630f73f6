"""``detinf run``: execute a locked manifest and write its run directory.

Order of checks, each refusing with the path and both digests when it fails: the lock's own lock_id,
the lock belongs to this manifest, hardware constraints, the prompt dataset's digest, every model file's
digest (skipped with ``--no-verify-artifact-digests``), the runtime closure against the lock (a warning,
or a refusal under ``runtime.closure_policy: enforce``). Then the requests run with ``runtime.env``
applied and, under ``network_policy: offline_required``, inside `network.offline_guard`. The run
directory is published atomically (see `rundir`); what finishes before that is kept in a checkpoint
beside it, which ``--resume`` continues (`resume`, `checkpoint`, `segments`). The run id is
``sha256(manifest_id + lock_id + requests_digest + hardware digest)``.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from deterministic_inference import __version__, fingerprint
from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import artifacts, capture, closure, dataset, network
from deterministic_inference.workflow.backend_engine import BackendResult
from deterministic_inference.workflow.canonical import run_id as compute_run_id
from deterministic_inference.workflow.checkpoint import Checkpoint
from deterministic_inference.workflow.lock import check_lock_for, load_lock
from deterministic_inference.workflow.manifest import GPU_BACKENDS, Manifest, load_manifest
from deterministic_inference.workflow.progress import Progress
from deterministic_inference.workflow.resume import (
    check_sharded,
    checkpoint_log,
    discard,
    identity,
    open_checkpoint,
    sharded_checkpoint_log,
)
from deterministic_inference.workflow.rundir import json_bytes, write_run_dir


@dataclass(frozen=True)
class RunOptions:
    """Command-line choices of one run."""

    output_dir: Path | None = None  # the run directory itself (default: outputs.directory template)
    base_url: str | None = None  # run against this OpenAI-compatible endpoint instead
    verify_artifact_digests: bool = True
    lock_path: Path | None = None  # default: next to the manifest
    ray_address: str | None = None  # split the requests over Ray actors (``local``: a local instance)
    shards: int | None = None  # how many (default scaleout.shards.DEFAULT_SHARDS)
    resume: bool = False  # continue from the checkpoint an interrupted run left beside the target
    quiet: bool = False  # no progress on stderr


@dataclass(frozen=True)
class Prepared:
    """Everything checked before any request runs."""

    manifest: Manifest
    lock: dict[str, Any]
    requests: list[dict[str, Any]]
    requests_digest: str
    location: artifacts.ModelLocation
    locked_files: list[Path]
    runtime_closure: dict[str, Any]  # the runtime closure of this run
    closure_notes: list[str]  # how it differs from the lock's (empty when equal)


def run_manifest(path: Path, options: RunOptions, log: TextIO | None = None) -> Path:
    """Run a manifest; returns the published run directory."""
    out = log if log is not None else sys.stderr
    started = _now()
    manifest = load_manifest(path)
    for warning in manifest.warnings:
        print(f"warning: {warning}", file=out)
    prepared = prepare(manifest, options, out)
    data = manifest.data
    backend = "openai_compatible" if options.base_url else data["runtime"]["execution"]["backend"]
    if backend in GPU_BACKENDS:  # started by `detinf serve --config`; runs reach it over HTTP
        backend = "openai_compatible"
    base_url = options.base_url or data["runtime"]["execution"]["base_url"]
    offline = data["runtime"]["network_policy"] == "offline_required"
    if backend == "openai_compatible":
        if not base_url:
            raise WorkflowError(f"{manifest.path}: $.runtime.execution.base_url: not set; pass "
                                "--base-url URL")
        if offline and not network.url_is_loopback(base_url):
            raise WorkflowError(f"--base-url {base_url}: network_policy offline_required allows "
                                "only loopback endpoints; set runtime.network_policy to online_allowed")
    _check_ray_options(options, backend, offline)
    planned = _planned_target(prepared, options)
    stored, folder = None, None
    if options.ray_address is None:  # embedded: one record per group; endpoint: one per answer
        stored = open_checkpoint(planned, prepared, options.resume, out)
    else:  # sharded: one checkpoint per shard
        folder = check_sharded(planned, identity(prepared), options.resume, out)
    progress = Progress("run", len(prepared.requests), out, enabled=not options.quiet)
    try:
        with applied_env(data["runtime"]["env"]), network.offline_guard() if offline else nullcontext():
            result = _execute(backend, base_url, prepared, options, out, (stored, folder), progress)
    except BaseException:
        progress.close(failed=True)
        if stored is not None:
            stored.remove() if stored.created and not stored.segments else stored.close()
        if folder is not None:
            discard(folder, only_if_empty=True)
        raise
    progress.close()
    for warning in result.warnings:
        print(f"warning: {warning}", file=out)
    run = compute_run_id(manifest.manifest_id, prepared.lock["lock_id"], prepared.requests_digest,
                         result.fingerprint["hardware"])
    target = planned if options.output_dir or run == _local_run_id(prepared) else _template_dir(
        data["outputs"]["directory"], manifest.name, run)
    checkpoint_section = checkpoint_log(stored) if folder is None else sharded_checkpoint_log(folder)
    files = _documents(prepared, result, options, backend, base_url, offline, started, checkpoint_section)
    bundle = _bundle_record(prepared, result, run)
    published = write_run_dir(target, files, bundle)
    if stored is not None:
        stored.remove()
    if folder is not None:
        discard(folder, only_if_empty=False)
    return published


def _local_run_id(prepared: Prepared) -> str:
    """The run id of an embedded run on this machine (its hardware digest is this CPU's)."""
    hardware = fingerprint.digest(fingerprint.hardware_fingerprint())
    return compute_run_id(prepared.manifest.manifest_id, prepared.lock["lock_id"], prepared.requests_digest,
                          hardware)


def _planned_target(prepared: Prepared, options: RunOptions) -> Path:
    """The run directory, known before generating (for the checkpoint beside it); refuses an existing one."""
    if options.output_dir is not None:
        if options.output_dir.exists():
            raise WorkflowError(f"{options.output_dir}: already exists; choose another --output-dir or "
                                "remove it")
        return options.output_dir
    manifest = prepared.manifest
    return _template_dir(manifest.data["outputs"]["directory"], manifest.name, _local_run_id(prepared))


def prepare(manifest: Manifest, options: RunOptions, out: TextIO) -> Prepared:
    """All checks before running: lock, hardware, dataset, artifacts, closure."""
    data = manifest.data
    lock_path = options.lock_path or manifest.default_lock_path()
    lock = load_lock(lock_path)
    check_lock_for(manifest, lock, lock_path)
    check_hardware(data["hardware"]["constraints"], fingerprint.hardware_fingerprint())
    prompts = dataset.load_dataset(data["inference"]["dataset"]["source"], manifest.base_dir)
    if prompts.digest != lock["dataset"]["digest"]:
        raise WorkflowError(f"prompt dataset {prompts.path}: digest {prompts.digest} does not match "
                            "the locked "
                            f"{lock['dataset']['digest']}; restore the file or run `detinf lock` again")
    location = artifacts.locate_model(data["model"]["source"], manifest.base_dir)
    locked_commit = lock["model"].get("commit")
    if locked_commit is not None and location.commit != locked_commit:
        raise WorkflowError(f"$.model.source.revision: {data['model']['source']['revision']} now resolves "
                            f"to commit {location.commit} in the Hugging Face cache, the lock has "
                            f"{locked_commit}; "
                            "pin the locked commit as the revision or run `detinf lock` again")
    root = location.root
    locked_files = [root / entry["path"] for entry in lock["model"]["files"]] if root else []
    if options.verify_artifact_digests:
        for entry, file_path in zip(lock["model"]["files"], locked_files, strict=True):
            artifacts.check_digest(file_path, entry["digest"], f"model {entry['role']} file")
    else:
        print("warning: artifact digests not verified (--no-verify-artifact-digests)", file=out)
    current, notes = _closure_check(data, lock, out)
    inference = data["inference"]
    requests = dataset.build_requests(prompts, inference["n_prompts"], inference["request_template"])
    return Prepared(manifest, lock, requests, dataset.requests_digest(requests), location, locked_files,
                    current, notes)


def check_hardware(constraints: dict[str, Any], hardware: dict[str, Any]) -> None:
    """Refuse to run on hardware outside the manifest's constraints."""
    if constraints["arch"] and hardware["arch"] not in constraints["arch"]:
        raise WorkflowError(f"$.hardware.constraints.arch: this machine is {hardware['arch']}, the manifest "
                            f"allows {constraints['arch']}; run on allowed hardware or widen the constraint")
    if constraints["vendor"] and hardware["vendor"] not in constraints["vendor"]:
        raise WorkflowError(f"$.hardware.constraints.vendor: this CPU is {hardware['vendor']}, the manifest "
                            f"allows {constraints['vendor']}; run on allowed hardware or widen the "
                            "constraint")
    missing = [name for name in constraints["require_isa"] if not hardware["isa"].get(name)]
    if missing:
        raise WorkflowError(f"$.hardware.constraints.require_isa: this CPU lacks {', '.join(missing)}; "
                            "run on a CPU that has them or remove them from the constraint")


def _closure_check(
    data: dict[str, Any], lock: dict[str, Any], out: TextIO
) -> tuple[dict[str, Any], list[str]]:
    current = closure.runtime_closure(data)
    if closure.closure_digest(current) == lock["runtime_closure_digest"]:
        return current, []
    differences = closure.closure_differences(lock["runtime_closure"], current)
    if data["runtime"]["closure_policy"] == "enforce":
        raise WorkflowError(f"runtime closure differs from the lock "
                            f"({differences[0] if differences else '?'}); "
                            "restore the locked environment or run `detinf build --update-lock`")
    print(f"warning: runtime closure differs from the lock in {len(differences)} place(s), first: "
          f"{differences[0] if differences else '?'}", file=out)
    return current, differences


@contextmanager
def applied_env(env: dict[str, str]) -> Iterator[None]:
    """Set the manifest's environment variables for the block, restoring the previous values after."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update({name: str(value) for name, value in env.items()})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _check_ray_options(options: RunOptions, backend: str, offline: bool) -> None:
    if options.ray_address is None:
        if options.shards is not None:
            raise WorkflowError("--shards: needs --ray-address (ADDR, or `local` for a local Ray instance)")
        return
    if options.shards is not None and options.shards < 1:
        raise WorkflowError(f"--shards: {options.shards} must be >= 1")
    if backend == "openai_compatible":
        raise WorkflowError("--ray-address: shards run the embedded engine; drop --base-url (or the "
                            "manifest's openai_compatible backend) or drop --ray-address")
    host = options.ray_address.rsplit(":", 1)[0]
    if offline and options.ray_address != "local" and not network.is_loopback_host(host):
        raise WorkflowError(f"--ray-address {options.ray_address}: network_policy offline_required allows "
                            "only a loopback or `local` Ray instance; set runtime.network_policy to "
                            "online_allowed")


def _execute(backend: str, base_url: str | None, prepared: Prepared, options: RunOptions,
             out: TextIO, checkpoints: tuple[Checkpoint | None, Path | None], progress: Progress
             ) -> BackendResult:
    data = prepared.manifest.data
    if backend == "openai_compatible":
        from deterministic_inference.workflow.backend_http import run_http

        return run_http(data, str(base_url), prepared.requests, progress, out, checkpoint=checkpoints[0])
    if prepared.location.root is None:
        raise WorkflowError("$.model.source: a remote model needs --base-url (backend openai_compatible)")
    if options.ray_address is not None:
        from deterministic_inference.scaleout.shards import DEFAULT_SHARDS, run_sharded

        digests = [entry["digest"] for entry in prepared.lock["model"]["files"]]
        locked = (prepared.locked_files, digests if options.verify_artifact_digests else [])
        shards = DEFAULT_SHARDS if options.shards is None else options.shards
        folder = checkpoints[1]
        return run_sharded(data, prepared.location, prepared.requests, locked, options.ray_address, shards,
                           out, None if folder is None else (folder, identity(prepared)))
    from deterministic_inference.workflow.backend_engine import run_embedded

    return run_embedded(data, prepared.location, prepared.requests, prepared.locked_files, checkpoints[0],
                        progress)


def _template_dir(template: str, name: str, run: str) -> Path:
    hex_id = run.split(":", 1)[1]
    text = template.replace("${manifest_name}", name).replace("${run_id}", hex_id[:16])
    base = Path(text)
    candidate, attempt = base, 1
    while candidate.exists():
        attempt += 1
        candidate = base.with_name(f"{base.name}-{attempt}")
    return candidate


def _documents(prepared: Prepared, result: BackendResult, options: RunOptions, backend: str,
               base_url: str | None, offline: bool, started: str, checkpoint_section: dict[str, Any]
               ) -> dict[str, bytes]:
    data = prepared.manifest.data
    tokens = {"schema_version": 1, "sequences": [
        {key: value for key, value in item.items() if key not in ("token_logprobs", "top_logprobs")}
        for item in result.sequences]}
    files = {
        "manifest.used.json": json_bytes(data),
        "lock.used.json": json_bytes(prepared.lock),
        "requests.json": json_bytes(prepared.requests, compact=True),
        "tokens.json": json_bytes(tokens, compact=True),
        "run_log.json": json_bytes(_run_log(prepared, result, options, backend, base_url, offline, started)
                                   | checkpoint_section),
    }
    if data["capture"]["logits"]["enabled"]:
        top_k = data["capture"]["logits"]["top_k"]
        logits = capture.logits_document(result.sequences, top_k)
        files["captures/logits.json"] = json_bytes(logits, compact=True)
    if result.activations is not None:
        files["captures/activations.json"] = json_bytes(result.activations, compact=True)
    if result.activation_tensors:
        files["captures/activations.safetensors"] = capture.tensor_bytes(result.activation_tensors)
    if result.engine_trace is not None:
        files["captures/engine_trace.json"] = json_bytes(result.engine_trace, compact=True)
    return files


def _run_log(prepared: Prepared, result: BackendResult, options: RunOptions, backend: str,
             base_url: str | None, offline: bool, started: str) -> dict[str, Any]:
    data = prepared.manifest.data
    return {
        "backend": backend,
        "base_url": base_url if backend == "openai_compatible" else None,
        "cli_overrides": {"base_url": options.base_url, "output_dir": str(options.output_dir or "") or None,
                          "verify_artifact_digests": options.verify_artifact_digests},
        **({"ray_address": options.ray_address, "shards": result.shards} if result.shards else {}),
        **({"retries": result.retries} if result.retries is not None else {}),
        "batch_trace": result.batch_trace,
        "determinism_controls": {
            "engine": data["engine"], "batching": data["inference"]["batching"],
            "threads": data["runtime"]["threads"], "env_applied": data["runtime"]["env"],
            "network_policy": data["runtime"]["network_policy"], "offline_guard": offline,
            "artifact_digests_verified": options.verify_artifact_digests,
            "closure_matches_lock": not prepared.closure_notes, "closure_differences": prepared.closure_notes,
        },
        "runtime_closure": prepared.runtime_closure,
        "warnings": list(prepared.manifest.warnings) + result.warnings,
        "timings": dict(result.timings),
        "started_at": started,
        "finished_at": _now(),
        "detinf_version": __version__,
    }


def _bundle_record(prepared: Prepared, result: BackendResult, run: str) -> dict[str, Any]:
    hardware = result.hardware
    if hardware is None and result.backend == "embedded":
        hardware = fingerprint.hardware_fingerprint()
    return {
        "schema_version": 1,
        "kind": "detinf.run",
        "run_id": run,
        "manifest_id": prepared.manifest.manifest_id,
        "manifest_name": prepared.manifest.name,
        "lock_id": prepared.lock["lock_id"],
        "requests_digest": prepared.requests_digest,
        "backend": result.backend,
        "fingerprint": result.fingerprint,
        "system_fingerprint": result.system_fingerprint,
        "hardware": hardware,
        "runtime_closure_digest": closure.closure_digest(prepared.runtime_closure),
        "created_by": f"detinf {__version__}",
    }


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
