"""`detinf run --ray-address ADDR --shards N`: a manifest's requests split over N Ray actors, each with
its own engine, merged into the one-process run's result.

Why the run directory is the same as one process's: each shard runs `backend_engine.run_embedded` on
its requests (the same code as a one-process run), and an output is a pure function of its request for
a fixed fingerprint (batch composition, neighbours and timing do not change it), so a request gives the
same tokens and logprob bits in whichever shard it lands. Shards are contiguous slices of the request
list, merged back in shard order = request order. The shards must report one engine fingerprint (same
model, numerics, software and hardware class); a mixed run is refused, never written.

Failures: a shard whose actor dies (worker killed, node lost) or raises is run again once on a new
actor; a second failure fails the run before anything is written (the run directory is only published
after every shard succeeded). `run_log.json` records each shard's requests, attempts, worker and
hardware fingerprint.

Checkpoints: each shard's worker keeps its finished groups in its own checkpoint
(`workflow.resume.shard_folder`), so a shard run again, by the retry above or by `run --resume` after
the whole run was killed, continues from it and gives the same bits (see `workflow.segments`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.artifacts import ModelLocation
from deterministic_inference.workflow.backend_engine import BackendResult

ATTEMPTS = 2  # a failed shard is retried once
DEFAULT_SHARDS = 2


@dataclass(frozen=True)
class ShardJob:
    """What one shard runs (the same inputs as a one-process run, for a slice of the requests)."""

    index: int
    manifest: dict[str, Any]
    location: ModelLocation
    requests: list[dict[str, Any]]
    locked_files: list[Path]
    locked_digests: list[str]  # checked again on the worker's node when non-empty
    checkpoint_folder: Path | None = None  # this shard's checkpoint (`workflow.resume.shard_folder`)
    checkpoint_header: dict[str, Any] | None = None  # what it is made for (`workflow.resume.shard_identity`)


@dataclass
class ShardRecord:
    """run_log.json's account of one shard."""

    index: int
    request_ids: list[str]
    attempts: list[dict[str, Any]] = field(default_factory=list)  # worker + outcome of each attempt
    hardware: dict[str, Any] | None = None
    hardware_digest: str | None = None

    def document(self) -> dict[str, Any]:
        """The JSON form."""
        return {"index": self.index, "num_requests": len(self.request_ids), "request_ids": self.request_ids,
                "attempts": self.attempts, "hardware": self.hardware, "hardware_digest": self.hardware_digest}


class ShardWorker:
    """Ray actor: one engine for one shard."""

    def describe(self) -> dict[str, Any]:
        """Where this worker runs and its hardware class."""
        from deterministic_inference.fingerprint import digest, hardware_fingerprint

        hardware = hardware_fingerprint()
        return {"pid": os.getpid(), "host": socket.gethostname(), "hardware": hardware,
                "hardware_digest": digest(hardware)}

    def run(self, job: ShardJob) -> BackendResult:
        """Run the shard's requests exactly as a one-process run would (same env, network policy,
        hardware constraints and artifact digests, checked on this node)."""
        from contextlib import nullcontext

        from deterministic_inference.fingerprint import hardware_fingerprint
        from deterministic_inference.workflow import artifacts, network
        from deterministic_inference.workflow.backend_engine import run_embedded
        from deterministic_inference.workflow.run import applied_env, check_hardware

        check_hardware(job.manifest["hardware"]["constraints"], hardware_fingerprint())
        for path, expected in zip(job.locked_files, job.locked_digests, strict=False):
            artifacts.check_digest(path, expected, "model file")
        runtime = job.manifest["runtime"]
        offline = runtime["network_policy"] == "offline_required"
        stored = None
        if job.checkpoint_folder is not None and job.checkpoint_header is not None:
            from deterministic_inference.workflow.resume import open_for

            stored = open_for(job.checkpoint_folder, job.checkpoint_header)
        try:
            with applied_env(runtime["env"]), network.offline_guard() if offline else nullcontext():
                return run_embedded(job.manifest, job.location, job.requests, job.locked_files, stored)
        finally:
            if stored is not None:
                stored.close()


def split(requests: Sequence[dict[str, Any]], shards: int) -> list[list[dict[str, Any]]]:
    """Contiguous slices of near-equal size (the first ones one longer); never an empty shard."""
    count = max(1, min(shards, len(requests)))
    size, extra = divmod(len(requests), count)
    slices, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        slices.append(list(requests[start:end]))
        start = end
    return slices


def run_sharded(
    manifest: dict[str, Any],
    location: ModelLocation,
    requests: list[dict[str, Any]],
    locked: tuple[list[Path], list[str]],
    ray_address: str,
    shards: int,
    log: TextIO,
    checkpoint: tuple[Path, dict[str, Any]] | None = None,
) -> BackendResult:
    """Run the requests over `shards` Ray actors (see the module docstring); the merged result. With
    `checkpoint` (the run's checkpoint folder and header), each shard keeps and continues its own."""
    if shards < 1:
        raise WorkflowError(f"--shards: {shards} must be >= 1")
    import ray

    from deterministic_inference.scaleout import cluster

    threads = manifest["runtime"]["threads"] or 1
    connected = cluster.connect(ray_address, shards * threads)
    try:
        worker_class = ray.remote(num_cpus=threads, max_restarts=0, max_task_retries=0)(ShardWorker)
        slices = split(requests, shards)
        jobs = [_job(i, manifest, location, part, locked, checkpoint, len(slices))
                for i, part in enumerate(slices)]
        records = [ShardRecord(job.index, [r["request_id"] for r in job.requests]) for job in jobs]
        started = time.perf_counter()
        results = _run_jobs(worker_class, jobs, records, log)
        wall = time.perf_counter() - started
    finally:
        if connected:
            cluster.disconnect()
    return merge(results, records, wall)


def _job(index: int, manifest: dict[str, Any], location: ModelLocation, part: list[dict[str, Any]],
         locked: tuple[list[Path], list[str]], checkpoint: tuple[Path, dict[str, Any]] | None,
         shards: int) -> ShardJob:
    if checkpoint is None:
        return ShardJob(index, manifest, location, part, locked[0], locked[1])
    from deterministic_inference.workflow.resume import shard_folder, shard_identity

    header = shard_identity(checkpoint[1], index, shards, part)
    return ShardJob(index, manifest, location, part, locked[0], locked[1], shard_folder(checkpoint[0], index),
                    header)


def _run_jobs(worker_class: Any, jobs: list[ShardJob], records: list[ShardRecord],
              log: TextIO) -> list[BackendResult]:
    """Start every shard, wait for all; retry a failed shard once on a new actor."""
    import ray

    pending: dict[Any, tuple[ShardJob, Any]] = {}
    results: dict[int, BackendResult] = {}

    def launch(job: ShardJob) -> None:
        actor = worker_class.remote()
        where = ray.get(actor.describe.remote())
        record = records[job.index]
        record.hardware, record.hardware_digest = where["hardware"], where["hardware_digest"]
        record.attempts.append({"pid": where["pid"], "host": where["host"], "outcome": "running"})
        print(f"shard {job.index + 1}/{len(jobs)}: {len(job.requests)} request(s) on worker pid "
              f"{where['pid']} ({where['host']}), attempt {len(record.attempts)}", file=log, flush=True)
        pending[actor.run.remote(job)] = (job, actor)

    try:
        for job in jobs:
            launch(job)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            job, actor = pending.pop(ready[0])
            attempt = records[job.index].attempts[-1]
            try:
                results[job.index] = ray.get(ready[0])
                attempt["outcome"] = "ok"
            except Exception as error:  # noqa: BLE001 - the worker died or the shard raised
                attempt["outcome"] = f"failed: {_summary(error)}"
                ray.kill(actor)
                if len(records[job.index].attempts) >= ATTEMPTS:
                    raise WorkflowError(f"shard {job.index + 1}/{len(jobs)} failed {ATTEMPTS} times, last: "
                                        f"{_summary(error)}; no run directory was written") from None
                print(f"shard {job.index + 1}/{len(jobs)} failed ({_summary(error)}); retrying once",
                      file=log, flush=True)
                launch(job)
            else:
                ray.kill(actor)
    finally:
        for _, actor in pending.values():
            ray.kill(actor)
    return [results[job.index] for job in jobs]


def _summary(error: BaseException) -> str:
    cause = getattr(error, "cause", None)
    shown = cause if isinstance(cause, BaseException) else error
    text = str(shown).strip().splitlines()
    return f"{type(shown).__name__}: {text[-1] if text else ''}"[:300]


def merge(results: list[BackendResult], records: list[ShardRecord], wall: float) -> BackendResult:
    """One BackendResult from the shards' (in shard order = request order); refuses mixed fingerprints."""
    first = results[0]
    for index, result in enumerate(results[1:], start=1):
        if result.fingerprint != first.fingerprint:
            raise WorkflowError(f"shard {index + 1} ran with fingerprint {result.system_fingerprint}, "
                                f"shard 1 with {first.system_fingerprint}; run all shards on one hardware "
                                "class and software closure")
    return BackendResult(
        backend="embedded",
        sequences=[entry for result in results for entry in result.sequences],
        fingerprint=first.fingerprint,
        system_fingerprint=first.system_fingerprint,
        batch_trace=[{"shard": i, **group} for i, r in enumerate(results) for group in r.batch_trace],
        timings={"load_seconds": max(r.timings["load_seconds"] for r in results),
                 "generate_seconds": max(r.timings["generate_seconds"] for r in results),
                 "sharded_wall_seconds": wall},
        activations=_merge_activations([r.activations for r in results]),
        activation_tensors=_merge_tensors([r.activation_tensors for r in results]),
        engine_trace=None,
        warnings=[warning for result in results for warning in result.warnings] + _trace_note(results),
        shards=[record.document() for record in records],
        hardware=records[0].hardware,
    )


def _trace_note(results: list[BackendResult]) -> list[str]:
    if all(result.engine_trace is None for result in results):
        return []
    return ["capture.engine_trace: not written for a sharded run (each shard's engine has its own step "
            "trace, which depends on its share of the requests); verify skips it"]


def _merge_activations(documents: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [doc for doc in documents if doc is not None]
    if not present:
        return None
    sequences = sorted((seq for doc in present for seq in doc["sequences"]), key=lambda s: s["sequence_id"])
    return {"layers": max(doc["layers"] for doc in present), "digest": present[0]["digest"],
            "sequences": sequences}


def _merge_tensors(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [part for part in parts if part]
    if not present:
        return None
    merged: dict[str, Any] = {}
    for part in present:
        merged.update(part)
    return merged
