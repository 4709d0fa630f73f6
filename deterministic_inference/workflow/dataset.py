"""Prompt datasets and the request list a run sends.

A dataset is a JSONL file, one object per line: ``{"id": str, "category": str, "prompt": str}`` and
optionally ``"system": str``. The package ships the reference dataset (100 prompts written for this
project: chat, code, long output, multilingual, reasoning; interleaved so any prefix is varied) as
``builtin:reference_prompts``, pinned by `REFERENCE_DATASET_DIGEST` (sha256 of the file bytes).

`build_requests` turns the first ``n_prompts`` records and the manifest's request template into the list
of requests; ``requests_digest`` is the digest of its canonical JSON.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import constraints
from deterministic_inference.workflow.canonical import digest_bytes, digest_json, loads_strict

BUILTIN_PREFIX = "builtin:"
REFERENCE_DATASET = "builtin:reference_prompts"
REFERENCE_DATASET_DIGEST = "sha256:7f6398428e22b1f8993b1d3e2cad15854f8951913d710dda2df6cac199d37b87"
REFERENCE_DATASET_SIZE = 100
_BUILTIN_FILES = {"reference_prompts": "reference_prompts.jsonl"}


@dataclass(frozen=True)
class Dataset:
    """A loaded prompt dataset: where it came from, its file digest and its records."""

    source: str  # "builtin:<name>" or the path as written in the manifest
    path: Path  # the file read
    digest: str  # sha256 of the file bytes
    records: tuple[dict[str, Any], ...]


def dataset_path(source: str, base_dir: Path) -> Path:
    """The file behind a dataset source (builtin names resolve inside the installed package)."""
    if source.startswith(BUILTIN_PREFIX):
        name = source[len(BUILTIN_PREFIX):]
        if name not in _BUILTIN_FILES:
            raise WorkflowError(
                f"$.inference.dataset.source: unknown builtin dataset {source!r}; "
                f"use one of {', '.join(BUILTIN_PREFIX + key for key in _BUILTIN_FILES)} or a JSONL path"
            )
        resource = importlib.resources.files("deterministic_inference") / "data" / _BUILTIN_FILES[name]
        return Path(str(resource))
    path = Path(source)
    return path if path.is_absolute() else base_dir / path


def load_dataset(source: str, base_dir: Path) -> Dataset:
    """Read and check a dataset; errors name the file and line."""
    path = dataset_path(source, base_dir)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise WorkflowError(
            f"$.inference.dataset.source: cannot read {path}: {error.strerror}; fix the path"
        ) from None
    return Dataset(source=source, path=path, digest=digest_bytes(data), records=parse_records(data, path))


def parse_records(data: bytes, path: Path) -> tuple[dict[str, Any], ...]:
    """Records of a JSONL dataset, validated."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise WorkflowError(f"{path}: not UTF-8; save the dataset as UTF-8 JSONL") from None
    records = []
    seen: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = loads_strict(line, f"{path}:{number}")
        _check_record(record, f"{path}:{number}", seen)
        records.append(record)
    if not records:
        raise WorkflowError(f"{path}: the dataset has no records; add JSONL lines with id and prompt")
    return tuple(records)


def _check_record(record: Any, where: str, seen: set[str]) -> None:
    if not isinstance(record, dict):
        raise WorkflowError(f"{where}: each line must be a JSON object with 'id' and 'prompt'")
    for key in ("id", "prompt"):
        if not isinstance(record.get(key), str) or not record[key]:
            raise WorkflowError(f"{where}: field {key!r} must be a non-empty string")
    if "system" in record and not isinstance(record["system"], str):
        raise WorkflowError(f"{where}: field 'system' must be a string")
    if record["id"] in seen:
        raise WorkflowError(f"{where}: duplicate id {record['id']!r}; ids must be unique")
    seen.add(record["id"])


def build_requests(dataset: Dataset, n_prompts: int, template: dict[str, Any]) -> list[dict[str, Any]]:
    """The requests of a run: the first `n_prompts` records with the request template applied."""
    if n_prompts > len(dataset.records):
        raise WorkflowError(
            f"$.inference.n_prompts: {n_prompts} is more than the {len(dataset.records)} prompts of "
            f"{dataset.source}; set n_prompts between 1 and {len(dataset.records)}"
        )
    kind = template.get("kind", "completion")
    requests = []
    for index, record in enumerate(dataset.records[:n_prompts]):
        request: dict[str, Any] = {
            "request_id": f"req-{index:04d}",
            "prompt_id": record["id"],
            "kind": kind,
            "sampling": dict(template.get("sampling", {})),
            "stop": dict(template.get("stop", {})),
        }
        if kind == "chat":
            messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
            request["messages"] = messages + [{"role": "user", "content": record["prompt"]}]
        else:
            request["prompt"] = record["prompt"]
        constraints.check_record(record, f"{dataset.source}: record {record['id']!r}", kind == "chat")
        request.update({name: record[name] for name in constraints.CONSTRAINT_FIELDS if name in record})
        requests.append(request)
    return requests


def requests_digest(requests: list[dict[str, Any]]) -> str:
    """Digest of the canonical JSON of the request list."""
    return digest_json(requests)
