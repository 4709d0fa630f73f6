"""Writing and completing manifests: ``init``, ``digest-bootstrap`` and ``build`` (closure metadata)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deterministic_inference import fingerprint
from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow import artifacts, closure
from deterministic_inference.workflow.dataset import REFERENCE_DATASET, REFERENCE_DATASET_DIGEST, load_dataset
from deterministic_inference.workflow.lock import check_lock_for, load_lock, with_closure, write_lock
from deterministic_inference.workflow.manifest import (
    MANIFEST_KIND,
    UNSET_DIGEST,
    Manifest,
    defaults,
    load_manifest,
    read_document,
)
from deterministic_inference.workflow.migrate import SEED_MANIFEST_KIND


@dataclass(frozen=True)
class HubModel:
    """A model named by Hugging Face id and revision (`init --model-id --model-revision`)."""

    repo: str
    revision: str
    quant: str | None = None  # `--model-id ID:QUANT`: the GGUF of a *-GGUF snapshot whose name has QUANT


def init_manifest(model: Path | HubModel | None, n_prompts: int, max_tokens: int,
                  model_file: str | None = None) -> dict[str, Any]:
    """A manifest for `model` (None = the embedded default model), digests filled in.

    The default model is an instruct model, so its prompts go through the chat template (request kind
    ``chat``); a model given by path or Hugging Face id gets plain completions (its template is unknown
    until loaded). A Hugging Face model is found offline in the local cache (`hf_cache`); its manifest
    records the id and revision, and its runs go to ``runs/<run_id>`` as the seed tool's did."""
    if not 1 <= n_prompts <= 100:
        raise WorkflowError(f"--n-prompts: {n_prompts} must be between 1 and 100 (the reference prompts)")
    if not 1 <= max_tokens <= 32768:
        raise WorkflowError(f"--max-tokens: {max_tokens} must be between 1 and 32768")
    source, files, root, name, directory = _model_entries(model, model_file)
    for entry in files:
        entry["digest"] = artifacts.hash_file(root / entry["path"], entry["path"])
    return {
        "schema_version": 1,
        "kind": MANIFEST_KIND,
        "metadata": {
            "name": _safe_name(f"{name}-greedy"),
            "description": f"Greedy decoding of {n_prompts} reference prompts on {name}.",
        },
        "model": {"source": source, "files": files},
        "engine": {key: value for key, value in defaults()["engine"].items() if value is not None},
        "inference": {
            "dataset": {"source": REFERENCE_DATASET, "digest": REFERENCE_DATASET_DIGEST},
            "n_prompts": n_prompts,
            "request_template": {
                "kind": "chat" if model is None else "completion",
                "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "seed": 0},
                "stop": {"sequences": [], "token_ids": []},
            },
            "batching": {"policy": "fixed", "max_num_seqs": 64, "max_num_batched_tokens": 512},
        },
        "capture": {
            "tokens": True,
            "logits": {"enabled": True, "top_k": 5},
            "activations": {"enabled": True, "full_tensors": False},
            "engine_trace": {"enabled": True},
        },
        "determinism": {
            "compare": {
                "tokens": {"rule": "exact"},
                "logits": {"rule": "exact"},
                "activations": {"rule": "exact"},
                "engine_trace": {"rule": "exact"},
            }
        },
        "runtime": {
            "network_policy": "offline_required",
            "threads": None,
            "execution": {"backend": "embedded"},
        },
        "outputs": {"directory": directory},
    }


def _model_entries(
    model: Path | HubModel | None, model_file: str | None
) -> tuple[dict[str, Any], list[dict[str, Any]], Path, str, str]:
    """What `init_manifest` records of the model: (model.source, model.files without digests, the
    directory the files are under, the model's short name, the runs' output directory)."""
    directory = "runs/${manifest_name}/${run_id}"
    if model is None:
        from deterministic_inference.model.default_model import DEFAULT_MODEL_NAME, default_model_path

        weights = default_model_path()
        source: dict[str, Any] = {"type": "default"}
        files = artifacts.discover_model_files(weights)
        root, name = weights.parent, DEFAULT_MODEL_NAME
    elif isinstance(model, HubModel):
        from deterministic_inference.workflow.hf_cache import resolve_snapshot

        snapshot = resolve_snapshot(model.repo, model.revision)
        source = {"type": "huggingface", "repo": model.repo, "revision": model.revision}
        files = _directory_files(snapshot.path, source, model_file, model.quant)
        root, name = snapshot.path, model.repo.rsplit("/", 1)[-1]
        directory = "runs/${run_id}"
    else:
        model = model.resolve()
        source = {"type": "path", "path": str(model)}
        if model.is_dir():
            files = _directory_files(model, source, model_file, None)
        elif model_file is not None:
            raise WorkflowError(f"--model-file {model_file}: --model {model} is not a directory; give "
                                "--model the directory holding the GGUF file, or drop --model-file")
        else:
            files = artifacts.discover_model_files(model)
        root, name = (model if model.is_dir() else model.parent), model.name.split(".")[0]
    return source, files, root, name, directory

def _directory_files(directory: Path, source: dict[str, Any], model_file: str | None,
                     quant: str | None) -> list[dict[str, str]]:
    """`model.files` of a model directory; when it is a directory of GGUFs, only the chosen GGUF (named
    in `source["file"]`, so the manifest and the lock pin that exact file)."""
    chosen = artifacts.choose_model_file(directory, model_file, quant, "--model-file")
    if chosen == directory:
        return artifacts.discover_model_files(directory)
    source["file"] = chosen.name
    return artifacts.discover_model_files(chosen)


def _safe_name(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in text).strip("-._")
    return cleaned or "manifest"


def write_document(path: Path, document: dict[str, Any]) -> None:
    """Write a manifest as YAML (``.yaml``/``.yml``) or JSON (2-space indent, key order kept)."""
    if path.suffix.lower() in (".yaml", ".yml"):
        text = yaml.safe_dump(document, sort_keys=False, allow_unicode=True)
    else:
        text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    temporary.replace(path)


def digest_bootstrap(path: Path, output: Path | None = None, replace_existing: bool = False) -> list[str]:
    """Replace every ``sha256:unset`` digest reachable from `path` by the file's digest (every digest with
    `replace_existing`); returns what changed. The result goes to `output` (default: `path` itself).

    Digests are written into the leaf manifest: when they came from an x_base_manifest, the filled list (or
    dataset entry) is written into the leaf as an override, so the base stays untouched. `output` must be
    next to `path`, since relative paths in a manifest are relative to its own directory."""
    target = path if output is None else output
    if target.resolve().parent != path.resolve().parent:
        raise WorkflowError(f"--output {output}: must be in the directory of --config ({path.parent}), "
                            "where the manifest's relative paths point; or use --in-place")
    manifest = load_manifest(path)
    if manifest.origin_kind == SEED_MANIFEST_KIND:
        raise WorkflowError(
            f"{path}: a seed-tool manifest pins files on its endpoint; there is "
            "nothing to hash "
            "locally (run `detinf lock` directly)"
        )
    data = manifest.data
    changed: list[str] = []
    files = [dict(entry) for entry in data["model"]["files"]]
    location = artifacts.locate_model(data["model"]["source"], manifest.base_dir)
    for index, entry in enumerate(files):
        if (replace_existing or entry["digest"] == UNSET_DIGEST) and location.root is not None:
            digest = artifacts.hash_file(location.root / entry["path"], entry["path"])
            if digest != entry["digest"]:
                entry["digest"] = digest
                changed.append(f"$.model.files[{index}].digest = {digest}")
    dataset = dict(data["inference"]["dataset"])
    if replace_existing or dataset["digest"] == UNSET_DIGEST:
        digest = load_dataset(dataset["source"], manifest.base_dir).digest
        if digest != dataset["digest"]:
            dataset["digest"] = digest
            changed.append(f"$.inference.dataset.digest = {digest}")
    if changed or target != path:
        document = read_document(path)
        if files != data["model"]["files"]:
            document.setdefault("model", {})["files"] = files
        if dataset != data["inference"]["dataset"]:
            document.setdefault("inference", {})["dataset"] = dataset
        write_document(target, document)
        load_manifest(target)  # the result must still validate
    return changed


def build_closure(manifest: Manifest, lock_path: Path | None, update_lock: bool) -> dict[str, Any]:
    """Closure metadata of this environment for a manifest; optionally rewrite the lock's closure."""
    current = closure.runtime_closure(manifest.data)
    hardware = fingerprint.hardware_fingerprint()
    document: dict[str, Any] = {
        "schema_version": 1,
        "kind": "detinf.closure",
        "manifest_id": manifest.manifest_id,
        "runtime_closure": current,
        "runtime_closure_digest": closure.closure_digest(current),
        "software_digest": current["software_digest"],
        "hardware": hardware,
        "hardware_digest": fingerprint.digest(hardware),
        "lock": None,
    }
    path = lock_path or manifest.default_lock_path()
    if path.exists() or update_lock:
        lock = load_lock(path)
        check_lock_for(manifest, lock, path)
        differences = closure.closure_differences(lock["runtime_closure"], current)
        document["lock"] = {"path": str(path), "matches": not differences, "differences": differences}
        if update_lock and differences:
            write_lock(path, with_closure(lock, current))
            document["lock"]["updated"] = True
    return document
