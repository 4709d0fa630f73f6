"""Segments of an embedded-engine run: the submission groups it runs one after another, each the unit
of checkpointing and of resume.

The groups are fixed by the request list and the manifest alone: ``sequential`` runs one request per
group, ``fixed`` runs ``inference.batching.max_num_seqs`` consecutive requests per group (the most the
engine runs at once anyway). Before each group the engine's prefix cache is flushed and no request is
held, so the KV allocator hands out blocks from its lowest free id as a fresh engine does: a group's
engine trace (step ids counted from the group's first step), its activations and its outputs are then the
same whether the groups before it ran in this process or in an earlier, killed one. The run's documents
are the groups' pieces joined in order, so a resumed run and an uninterrupted one write the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deterministic_inference.workflow import capture

# progress(requests finished, tokens generated) after each request that finished or was read back
ProgressHook = Callable[[int, int], None]


@dataclass
class Segment:
    """The outputs of one submission group."""

    index: int
    request_ids: list[str]
    sequences: list[dict[str, Any]]  # sequences_of each request, in request order
    trace_steps: list[dict[str, Any]]  # engine_trace.json steps, step ids numbered 0.. in this group
    activations: dict[str, Any] | None  # activations.json document of this group's sequences
    tensors: dict[str, Any] | None  # full activation tensors of this group (name -> [positions, hidden])
    generate_seconds: float

    def record(self) -> dict[str, Any]:
        """The checkpoint record (everything but the tensors, which go in their own file)."""
        return {"index": self.index, "request_ids": self.request_ids, "sequences": self.sequences,
                "trace_steps": self.trace_steps, "activations": self.activations,
                "generate_seconds": self.generate_seconds}


def submission_groups(requests: list[dict[str, Any]], batching: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Consecutive groups of requests (see the module docstring)."""
    size = 1 if batching["policy"] == "sequential" else max(1, int(batching["max_num_seqs"]))
    return [requests[start:start + size] for start in range(0, len(requests), size)]


def run_segment(engine: Any, index: int, group: list[dict[str, Any]], manifest: dict[str, Any],
                submit: Callable[[dict[str, Any]], None], progress: ProgressHook) -> Segment:
    """Run one group to completion on a flushed engine; invariant to earlier groups (module docstring)."""
    from deterministic_inference.workflow.backend_engine import sequences_of

    captures = manifest["capture"]
    recorder = None
    if captures["activations"]["enabled"]:
        recorder = capture.ActivationRecorder(keep_tensors=captures["activations"]["full_tensors"])
    engine.flush_prefix_cache()
    engine.trace.clear()
    started = time.perf_counter()
    for request in group:
        submit(request)
    finals: dict[str, Any] = {}
    while engine.has_unfinished:
        for output in engine.step(recorder):
            finals[output.request_id] = output
            if output.finished:
                progress(1, sum(len(choice.token_ids) for choice in output.outputs))
    for request in group:
        engine.release(request["request_id"])
    plans = list(engine.trace)
    engine.trace.clear()
    steps = [dict(step, step_id=number) for number, step in enumerate(capture.trace_document(plans)["steps"])]
    return Segment(
        index=index,
        request_ids=[request["request_id"] for request in group],
        sequences=[entry for r in group for entry in sequences_of(r, finals[r["request_id"]])],
        trace_steps=steps,
        activations=recorder.document(plans) if recorder else None,
        tensors=recorder.tensors(plans) if recorder and recorder.keep_tensors else None,
        generate_seconds=time.perf_counter() - started,
    )


def segment_from_record(record: dict[str, Any], tensor_data: bytes | None) -> Segment:
    """A finished group read back from a checkpoint."""
    tensors = None
    if tensor_data is not None:
        from safetensors.torch import load

        tensors = load(tensor_data)
    return Segment(index=int(record["index"]), request_ids=list(record["request_ids"]),
                   sequences=record["sequences"], trace_steps=record["trace_steps"],
                   activations=record["activations"], tensors=tensors,
                   generate_seconds=float(record["generate_seconds"]))


def joined_trace(segments: list[Segment]) -> dict[str, Any]:
    """engine_trace.json of the whole run: the groups' steps in order, step ids continued across groups."""
    steps: list[dict[str, Any]] = []
    offset = 0
    for segment in segments:
        steps.extend(dict(step, step_id=step["step_id"] + offset) for step in segment.trace_steps)
        offset += len(segment.trace_steps)
    return {"steps": steps}


def joined_activations(segments: list[Segment]) -> dict[str, Any] | None:
    """activations.json of the whole run: every group's sequences, sorted by sequence id."""
    present = [segment.activations for segment in segments if segment.activations is not None]
    if not present:
        return None
    sequences = sorted((seq for doc in present for seq in doc["sequences"]), key=lambda s: s["sequence_id"])
    return {"layers": max(doc["layers"] for doc in present), "digest": present[0]["digest"],
            "sequences": sequences}


def joined_tensors(segments: list[Segment]) -> dict[str, Any] | None:
    """Full activation tensors of the whole run (names are unique per sequence and layer)."""
    parts = [segment.tensors for segment in segments if segment.tensors]
    if not parts:
        return None
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part)
    return merged
