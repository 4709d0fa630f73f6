"""Run a manifest's requests on the embedded engine and collect what the run directory records."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import capture, constraints
from deterministic_inference.workflow.artifacts import ModelLocation
from deterministic_inference.workflow.checkpoint import Checkpoint
from deterministic_inference.workflow.progress import Progress
from deterministic_inference.workflow.segments import (
    ProgressHook,
    Segment,
    joined_activations,
    joined_tensors,
    joined_trace,
    run_segment,
    segment_from_record,
    submission_groups,
)


@dataclass
class BackendResult:
    """What one backend produced for a run (files are written by `run`)."""

    backend: str  # "embedded" or "openai_compatible"
    sequences: list[dict[str, Any]]  # one per (request, choice), request order then choice index
    fingerprint: dict[str, Any]  # model / numerics / software / hardware
    system_fingerprint: str
    batch_trace: list[dict[str, Any]]  # what was submitted together
    timings: dict[str, float]
    activations: dict[str, Any] | None = None
    activation_tensors: dict[str, Any] | None = None
    engine_trace: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)
    shards: list[dict[str, Any]] | None = None  # sharded runs: each shard's requests, attempts, hardware
    hardware: dict[str, Any] | None = None  # the hardware class the engines ran on, when not this process's
    retries: list[dict[str, Any]] | None = None  # remote runs: every retried request (`retry`)


def sampling_params_for(request: dict[str, Any], logprobs: int | None) -> Any:
    """Engine SamplingParams of one workflow request."""
    from deterministic_inference.engine.sampling_params import SamplingParams

    sampling = request["sampling"]
    return SamplingParams(
        n=sampling["n"],
        max_tokens=sampling["max_tokens"],
        temperature=float(sampling["temperature"]),
        top_p=float(sampling["top_p"]),
        top_k=sampling["top_k"],
        min_p=float(sampling["min_p"]),
        seed=sampling["seed"],
        repetition_penalty=float(sampling["repetition_penalty"]),
        presence_penalty=float(sampling["presence_penalty"]),
        frequency_penalty=float(sampling["frequency_penalty"]),
        ignore_eos=sampling["ignore_eos"],
        stop=tuple(request["stop"].get("sequences", [])),
        stop_token_ids=tuple(request["stop"].get("token_ids", [])),
        logprobs=logprobs,
        structured_output=constraints.request_constraint(request),
    )


def engine_config_for(manifest: dict[str, Any], location: ModelLocation) -> Any:
    """EngineConfig from a resolved manifest."""
    from deterministic_inference.config import EngineConfig, parse_bytes

    engine, batching = manifest["engine"], manifest["inference"]["batching"]
    return EngineConfig(
        model=str(location.engine_path) if location.engine_path is not None else None,
        dtype=engine["dtype"],
        batch_invariant=engine["batch_invariant"],
        linear_tile_rows=engine["linear_tile_rows"],
        kv_block_size=engine["kv_block_size"],
        num_kv_blocks=engine["num_kv_blocks"],
        kv_cache_memory=None if engine["kv_cache_memory"] is None else parse_bytes(engine["kv_cache_memory"]),
        quantization=engine["quantization"],
        kv_cache_dtype=engine.get("kv_cache_dtype", "auto"),
        numerics_mode=engine.get("numerics", "portable"),
        max_model_len=engine["max_model_len"],
        max_num_seqs=batching["max_num_seqs"],
        max_num_batched_tokens=batching["max_num_batched_tokens"],
        enable_prefix_caching=batching["enable_prefix_caching"],
        threads=manifest["runtime"]["threads"],
        seed=engine["seed"],
        selfcheck=engine["selfcheck"],
        speculative_config=_speculative(engine.get("speculative_config")),
    )


def _speculative(value: dict[str, Any] | None) -> Any:
    """The manifest's engine.speculative_config (validated with the manifest) as a SpeculativeConfig."""
    from deterministic_inference.engine.speculative import SpeculativeConfig

    return None if value is None else SpeculativeConfig.from_json(value)


def run_embedded(
    manifest: dict[str, Any],
    location: ModelLocation,
    requests: list[dict[str, Any]],
    locked_files: list[Path],
    checkpoint: Checkpoint | None = None,
    progress: Progress | None = None,
) -> BackendResult:
    """Load the engine, check it read only locked files, run every submission group (`segments`),
    collect captures. With a `checkpoint`, groups it holds are read back instead of run, and each group
    run here is appended to it before the next starts; the result is the same bits either way."""
    from deterministic_inference.engine.engine import Engine

    started = time.perf_counter()
    engine = Engine(engine_config_for(manifest, location), record_trace=True)
    _check_loaded_files(engine.model_artifacts, locked_files)
    constraints.compile_all(engine.grammars, requests)
    if checkpoint is not None:
        checkpoint.bind_engine(engine.fingerprint, engine.system_fingerprint)
    loaded = time.perf_counter()
    if progress is not None:
        progress.begin()
    report: ProgressHook = progress if progress is not None else (lambda requests_done, tokens: None)
    top_k = manifest["capture"]["logits"]["top_k"] if manifest["capture"]["logits"]["enabled"] else None

    def submit(request: dict[str, Any]) -> None:
        engine.add_request(_prompt_for(engine, request), sampling_params_for(request, top_k),
                           request_id=request["request_id"])

    groups = submission_groups(requests, manifest["inference"]["batching"])
    done: list[Segment] = []
    for index, group in enumerate(groups):
        stored = checkpoint.segments.get(index) if checkpoint is not None else None
        if checkpoint is not None and stored is not None:
            done.append(_stored_segment(checkpoint, index, group, progress))
            continue
        segment = run_segment(engine, index, group, manifest, submit, report)
        if checkpoint is not None:
            checkpoint.add_segment(segment.record(), _tensor_file(segment))
        done.append(segment)
    finished = time.perf_counter()
    captures = manifest["capture"]
    return BackendResult(
        backend="embedded",
        sequences=[entry for segment in done for entry in segment.sequences],
        fingerprint=engine.fingerprint,
        system_fingerprint=engine.system_fingerprint,
        batch_trace=[{"submitted_together": [r["request_id"] for r in group]} for group in groups],
        timings={"load_seconds": loaded - started, "generate_seconds": finished - loaded},
        activations=joined_activations(done),
        activation_tensors=joined_tensors(done),
        engine_trace=joined_trace(done) if captures["engine_trace"]["enabled"] else None,
    )


def _stored_segment(checkpoint: Checkpoint, index: int, group: list[dict[str, Any]],
                    progress: Progress | None) -> Segment:
    record = checkpoint.segments[index]
    if record["request_ids"] != [request["request_id"] for request in group]:
        raise WorkflowError(f"checkpoint {checkpoint.path}: segment {index} holds other requests than this "
                            f"run's group {index}; remove {checkpoint.path} to start over")
    segment = segment_from_record(record, checkpoint.segment_tensors(index))
    if progress is not None:
        progress.skip(len(segment.request_ids), sum(len(s["output_token_ids"]) for s in segment.sequences))
    return segment


def _tensor_file(segment: Segment) -> bytes | None:
    return capture.tensor_bytes(segment.tensors) if segment.tensors else None


def _check_loaded_files(loaded: tuple[Path, ...], locked: list[Path]) -> None:
    pinned = {path.resolve() for path in locked}
    for path in loaded:
        if path.resolve() not in pinned:
            raise WorkflowError(
                f"the engine loaded {path}, which is not pinned in $.model.files; add it to the manifest "
                "(`detinf init` lists every model file) and run `detinf lock` again"
            )


def _prompt_for(engine: Any, request: dict[str, Any]) -> str:
    if request["kind"] == "chat":
        if "tools" in request:
            return constraints.chat_prompt(engine.tokenizer, request)
        rendered: str = engine.tokenizer.apply_chat_template(request["messages"])
        return rendered
    prompt: str = request["prompt"]
    return prompt


def sequences_of(request: dict[str, Any], output: Any) -> list[dict[str, Any]]:
    """tokens.json / logits.json entries of every choice of one request output."""
    entries = []
    for choice in output.outputs:
        entries.append(
            {
                "request_id": request["request_id"],
                "index": choice.index,
                "prompt_token_ids": list(output.prompt_token_ids),
                "output_token_ids": list(choice.token_ids),
                "text": choice.text,
                "finish_reason": choice.finish_reason,
                "token_logprobs": [float(value) for value in choice.logprobs],
                "top_logprobs": [
                    [[int(token), float(value)] for token, value in step] for step in choice.top_logprobs
                ],
            }
        )
    return entries
