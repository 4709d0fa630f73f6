"""Manifests: what a run pins. Loading (JSON or YAML), inheritance, defaults and validation.

A manifest file may name a parent with ``x_base_manifest`` (a path relative to the file). The parent is
resolved first, then the child is deep-merged over it: objects merge key by key, every other value
(lists included) replaces the parent's. Chains are followed to any depth; a cycle is an error naming the
chain. Relative paths inside the resolved manifest (model path, dataset, golden bundle) are relative to
the directory of the file that was loaded (the leaf), ``outputs.directory`` to the working directory.

After merging, a seed-tool manifest (``kind: vllm.deterministic_inference_manifest``) is translated
(see `migrate`), the defaults below are filled in, and the result is validated against
``manifest.schema.json``. Every error is one line naming the file, the JSON path and the fix. The id of
a manifest is the digest of this resolved form, so spelling out a default does not change it.
"""

from __future__ import annotations

import copy
import datetime
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from deterministic_inference.config import EngineConfig
from deterministic_inference.errors import ConfigError, WorkflowError
from deterministic_inference.workflow import migrate
from deterministic_inference.workflow.canonical import loads_strict, manifest_id
from deterministic_inference.workflow.dataset import (
    REFERENCE_DATASET,
    REFERENCE_DATASET_DIGEST,
    REFERENCE_DATASET_SIZE,
)
from deterministic_inference.workflow.schema_errors import describe_error

MANIFEST_KIND = "detinf.manifest"
GPU_BACKENDS = ("vllm", "sglang")  # served by `detinf serve --config` in a container (workflow/gpu_serve)
UNSET_DIGEST = "sha256:unset"
MAX_INHERITANCE_DEPTH = 32


def defaults() -> dict[str, Any]:
    """The values a manifest gets for every field it leaves out (a fresh copy)."""
    return {
        "model": {"files": []},
        "engine": _engine_defaults(),
        "inference": _inference_defaults(),
        "capture": {
            "tokens": True,
            "logits": {"enabled": True, "top_k": 5},
            "activations": {"enabled": False, "full_tensors": False},
            "engine_trace": {"enabled": True},
        },
        "determinism": {
            "compare": {
                "tokens": {"rule": "exact"},
                "logits": {"rule": "exact", "max_ulp": 0},
                "activations": {"rule": "exact"},
                "engine_trace": {"rule": "exact"},
            }
        },
        "hardware": {
            "constraints": {"arch": [], "vendor": [], "require_isa": []},
            "record": {"cpu_flags": True},
        },
        "runtime": {
            "env": {},
            "threads": None,
            "network_policy": "offline_required",
            "closure_policy": "record",
            "execution": {"backend": "embedded", "base_url": None, "model": None, "timeout_seconds": 600},
        },
        "outputs": {
            "directory": "runs/${manifest_name}/${run_id}",
            "golden": {"enabled": False, "bundle": None},
        },
    }


def _engine_defaults() -> dict[str, Any]:
    """How the engine computes: the numeric settings that enter the fingerprint, and the KV pool."""
    return {
        "dtype": "auto",
        "batch_invariant": True,
        "linear_tile_rows": EngineConfig.linear_tile_rows,
        "kv_block_size": 16,
        "seed": 0,
        "max_model_len": None,
        "num_kv_blocks": None,
        "kv_cache_memory": None,
        "quantization": "auto",
        "kv_cache_dtype": "auto",
        "numerics": "portable",
        "selfcheck": True,
    }


def _inference_defaults() -> dict[str, Any]:
    """What is asked (the dataset and the request every prompt gets: greedy, 32 tokens) and how the
    requests are batched."""
    sampling = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": 32,
        "seed": None,
        "n": 1,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "ignore_eos": False,
    }
    return {
        "dataset": {"source": REFERENCE_DATASET},
        "request_template": {
            "kind": "completion",
            "sampling": sampling,
            "stop": {"sequences": [], "token_ids": []},
        },
        "batching": {
            "policy": "fixed",
            "max_num_seqs": 64,
            "max_num_batched_tokens": 512,
            "enable_prefix_caching": True,
            "concurrency": 1,
        },
    }


@dataclass(frozen=True)
class Manifest:
    """A resolved, validated manifest and where it came from."""

    data: dict[str, Any]  # resolved form: inheritance applied, seed fields mapped, defaults filled
    path: Path  # the file that was loaded (the leaf of the inheritance chain)
    chain: tuple[Path, ...]  # leaf first, then each x_base_manifest
    origin_kind: str  # kind as written ("detinf.manifest" or the seed tool's kind)
    warnings: tuple[str, ...] = field(default=())  # one line per seed field that was not mapped

    @property
    def base_dir(self) -> Path:
        """Directory relative paths in the manifest are resolved against."""
        return self.path.parent

    @property
    def manifest_id(self) -> str:
        """sha256 of the canonical resolved manifest (see `canonical.manifest_id`)."""
        return manifest_id(self.data)

    @property
    def name(self) -> str:
        """metadata.name."""
        return str(self.data["metadata"]["name"])

    def default_lock_path(self) -> Path:
        """``<manifest file without .json/.yaml/.yml>.lock.json`` next to the manifest."""
        stem = self.path.name
        for suffix in (".json", ".yaml", ".yml"):
            if stem.endswith(suffix):
                stem = stem[: -len(suffix)]
                break
        return self.path.with_name(stem + ".lock.json")


def load_manifest(path: str | Path) -> Manifest:
    """Load, resolve and validate a manifest file."""
    leaf = Path(path)
    raw, chain = resolve_inheritance(leaf)
    kind = raw.get("kind")
    warnings: list[str] = []
    if kind == migrate.SEED_MANIFEST_KIND:
        raw, warnings = migrate.from_seed_manifest(raw)
    engine = raw.get("engine")
    if isinstance(engine, dict) and "attention_kv_tile" in engine:
        engine = {key: value for key, value in engine.items() if key != "attention_kv_tile"}
        raw = {**raw, "engine": engine}
        warnings.append(
            "$.engine.attention_kv_tile is ignored since ops revision 3 (attention is computed row by row, "
            "with no key tile); remove it"
        )
    data = apply_defaults(raw)
    validate_manifest(data, str(leaf))
    return Manifest(
        data=data, path=leaf.resolve(), chain=tuple(chain), origin_kind=str(kind), warnings=tuple(warnings)
    )


def read_document(path: Path) -> dict[str, Any]:
    """One manifest file as a dict (``.yaml``/``.yml`` as YAML, anything else as strict JSON)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkflowError(f"{path}: no such manifest file; check the path") from None
    except (OSError, UnicodeDecodeError) as error:
        raise WorkflowError(f"{path}: cannot read the manifest ({error}); fix the file") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            value = _plain_json(yaml.safe_load(text), str(path), "$")
        except yaml.YAMLError as error:
            raise WorkflowError(f"{path}: invalid YAML: {' '.join(str(error).split())}") from None
    else:
        value = loads_strict(text, str(path))
    if not isinstance(value, dict):
        raise WorkflowError(f"{path}: $: a manifest must be an object; wrap the settings in {{...}}")
    return value


def resolve_inheritance(leaf: Path) -> tuple[dict[str, Any], list[Path]]:
    """The leaf deep-merged over its x_base_manifest chain, and the chain (leaf first)."""
    chain: list[Path] = []
    documents: list[dict[str, Any]] = []
    current: Path | None = leaf
    while current is not None:
        resolved = current.resolve()
        if resolved in chain:
            names = " -> ".join(str(item) for item in chain + [resolved])
            raise WorkflowError(
                f"{leaf}: $.x_base_manifest: inheritance cycle {names}; fix: remove one x_base_manifest"
            )
        if len(chain) >= MAX_INHERITANCE_DEPTH:
            raise WorkflowError(
                f"{leaf}: $.x_base_manifest: more than {MAX_INHERITANCE_DEPTH} levels; fix: flatten the chain"
            )
        chain.append(resolved)
        document = read_document(current)
        documents.append(document)
        current = _base_of(document, current)
    merged: dict[str, Any] = {}
    for document in reversed(documents):
        merged = deep_merge(merged, {k: v for k, v in document.items() if k != "x_base_manifest"})
    return merged, chain


def _base_of(document: dict[str, Any], path: Path) -> Path | None:
    base = document.get("x_base_manifest")
    if base is None:
        return None
    if not isinstance(base, str) or not base:
        raise WorkflowError(f"{path}: $.x_base_manifest: must be a file path string; fix or remove it")
    base_path = Path(base)
    return base_path if base_path.is_absolute() else path.parent / base_path


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A new dict: objects merged recursively, any other override value replaces the base value."""
    result = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = deep_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def apply_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """The manifest with every omitted field set to its default."""
    data = deep_merge(defaults(), raw)
    dataset = data["inference"].get("dataset")
    if isinstance(dataset, dict) and "digest" not in dataset:
        builtin = dataset.get("source") == REFERENCE_DATASET
        dataset["digest"] = REFERENCE_DATASET_DIGEST if builtin else UNSET_DIGEST
    return data


def load_schema() -> dict[str, Any]:
    """The manifest JSON Schema shipped with the package."""
    resource = resources.files("deterministic_inference.workflow").joinpath("manifest.schema.json")
    text = resource.read_text("utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def validate_manifest(data: dict[str, Any], where: str) -> None:
    """Raise a one-line WorkflowError (file, JSON path, fix) for the first problem found."""
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = list(validator.iter_errors(data))
    if errors:
        first = min(errors, key=lambda e: (len(e.absolute_path), [str(p) for p in e.absolute_path]))
        raise WorkflowError(f"{where}: {describe_error(first)}")
    _check_cross_fields(data, where)


def _check_cross_fields(data: dict[str, Any], where: str) -> None:
    inference = data["inference"]
    builtin = inference["dataset"]["source"] == REFERENCE_DATASET
    if builtin and inference["n_prompts"] > REFERENCE_DATASET_SIZE:
        raise WorkflowError(
            f"{where}: $.inference.n_prompts: {inference['n_prompts']} is more than the "
            f"{REFERENCE_DATASET_SIZE} reference prompts; "
            f"fix: use an integer between 1 and {REFERENCE_DATASET_SIZE}"
        )
    engine = data["engine"]
    if engine["num_kv_blocks"] is not None and engine["kv_cache_memory"] is not None:
        raise WorkflowError(
            f"{where}: $.engine.kv_cache_memory: num_kv_blocks also sizes the KV pool; "
            "fix: set only one of them (the other null)"
        )
    _check_speculative(where, engine.get("speculative_config"), data["capture"]["activations"]["enabled"])
    source_type = data["model"]["source"]["type"]
    backend = data["runtime"]["execution"]["backend"]
    if source_type == "remote" and backend != "openai_compatible":
        raise WorkflowError(
            f"{where}: $.runtime.execution.backend: a remote model needs backend 'openai_compatible'; "
            "fix: set it, or point model.source at a local model"
        )
    if backend in GPU_BACKENDS and source_type != "huggingface":
        raise WorkflowError(
            f"{where}: $.model.source: backend {backend!r} loads the model by Hugging Face id and revision; "
            "fix: use {\"type\": \"huggingface\", \"repo\": ORG/NAME, \"revision\": REV} "
            "(`detinf init --model-id ID --model-revision REV` writes it)"
        )
    if backend in GPU_BACKENDS and "file" in data["model"]["source"]:
        raise WorkflowError(
            f"{where}: $.model.source.file: backend {backend!r} loads a Hugging Face model directory, not "
            "one GGUF file of a snapshot; fix: remove model.source.file and use a non-GGUF repository"
        )


def unset_digests(data: dict[str, Any]) -> list[str]:
    """JSON paths of every ``sha256:unset`` digest in a resolved manifest."""
    paths = [
        f"$.model.files[{index}].digest"
        for index, entry in enumerate(data["model"]["files"])
        if entry["digest"] == UNSET_DIGEST
    ]
    if data["inference"]["dataset"]["digest"] == UNSET_DIGEST:
        paths.append("$.inference.dataset.digest")
    return paths


def _plain_json(value: Any, where: str, path: str) -> Any:
    """YAML values restricted to JSON types; dates become ISO strings."""
    if isinstance(value, datetime.date | datetime.datetime):
        return value.isoformat()
    if isinstance(value, dict):
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise WorkflowError(f"{where}: {path}: key {key!r} is not a string; quote it")
            result[key] = _plain_json(item, where, f"{path}.{key}")
        return result
    if isinstance(value, list):
        return [_plain_json(item, where, f"{path}[{index}]") for index, item in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise WorkflowError(f"{where}: {path}: a {type(value).__name__} has no JSON form; write a string instead")


def _check_speculative(where: str, value: Any, activations: bool) -> None:
    """$.engine.speculative_config (optional, vLLM's field names): WorkflowError naming the field. Not
    with activation capture: that records every computed row, rejected drafts' rows included."""
    if value is None:
        return
    if activations:
        raise WorkflowError(
            f"{where}: $.engine.speculative_config: activation capture records every computed row, "
            "rejected drafts included; fix: set capture.activations.enabled to false or remove it"
        )
    from deterministic_inference.engine.speculative import SpeculativeConfig

    try:
        SpeculativeConfig.from_json(value)
    except ConfigError as error:
        raise WorkflowError(
            f"{where}: $.engine.{error}; fix: write vLLM's fields, e.g. "
            '{"method": "ngram", "num_speculative_tokens": 4}, or null'
        ) from None
