"""Model artifacts: where a manifest's model files are, hashing them, and checking them against a lock.

``model.source`` is ``{"type": "default"}`` (the GGUF file of the installed default-model package),
``{"type": "path", "path": P}`` (a GGUF file or a Hugging Face directory; relative to the manifest),
``{"type": "huggingface", "repo": ID, "revision": REV}`` (that snapshot of the local Hugging Face
cache, resolved offline by `hf_cache`); both directory kinds take ``"file": NAME.gguf``, the GGUF to load
from a directory of GGUFs (a ``*-GGUF`` snapshot), or ``{"type": "remote", "name": N}`` (served elsewhere:
nothing to hash). ``model.files[].path`` are relative to the model root: the directory of a GGUF file,
or the HF directory itself.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from deterministic_inference.errors import WorkflowError

CHUNK_BYTES = 1 << 20  # small: the engine hashes in a side thread whose malloc arena keeps what it used
PROGRESS_MIN_BYTES = 32 << 20  # files at least this big get a progress bar on stderr
_HF_PATTERNS = ("*.safetensors", "*.json", "tokenizer.model", "*.jinja", "*.txt", "*.tiktoken")


@dataclass(frozen=True)
class ModelLocation:
    """Where the engine loads the model from and the directory model.files are relative to."""

    engine_path: Path | None  # what EngineConfig.model gets (None = the embedded default model)
    root: Path | None  # directory model.files[].path are relative to (None for a remote model)
    commit: str | None = None  # the Hugging Face commit a huggingface source resolved to


def locate_model(source: dict[str, Any], base_dir: Path) -> ModelLocation:
    """Resolve a manifest's model.source."""
    kind = source["type"]
    if kind == "remote":
        return ModelLocation(engine_path=None, root=None)
    if kind == "default":
        from deterministic_inference.model.default_model import default_model_path

        path = default_model_path()
        return ModelLocation(engine_path=None, root=path.parent)
    if kind == "huggingface":
        from deterministic_inference.workflow.hf_cache import resolve_snapshot

        snapshot = resolve_snapshot(source["repo"], source["revision"])
        engine_path = choose_model_file(snapshot.path, source.get("file"))
        return ModelLocation(engine_path=engine_path, root=snapshot.path, commit=snapshot.commit)
    path = Path(source["path"])
    path = path if path.is_absolute() else base_dir / path
    if path.is_dir():
        return ModelLocation(engine_path=choose_model_file(path, source.get("file")), root=path)
    if source.get("file") is not None:
        raise WorkflowError(f"$.model.source.file: {path} is not a directory; point model.source.path at "
                            "the directory holding the GGUF file, or remove model.source.file")
    if path.is_file():
        return ModelLocation(engine_path=path, root=path.parent)
    raise WorkflowError(
        f"$.model.source.path: {path} does not exist; point it at a GGUF file or an HF directory"
    )


def choose_model_file(directory: Path, name: str | None, quant: str | None = None,
                      field: str = "$.model.source.file") -> Path:
    """What the engine loads from `directory`: the GGUF file `name` / `quant` / the only GGUF picks
    (`gguf_choice`), else the directory itself (an HF model directory). Errors become WorkflowError."""
    from deterministic_inference.errors import ModelLoadError
    from deterministic_inference.model.gguf_choice import choose_gguf

    try:
        chosen = choose_gguf(directory, name, quant, field)
    except ModelLoadError as error:
        raise WorkflowError(str(error)) from None
    return directory if chosen is None else chosen


def discover_model_files(model: Path) -> list[dict[str, str]]:
    """``model.files`` entries (digests unset) for a GGUF file or an HF model directory (for a
    directory of GGUFs, pass the file `choose_model_file` picks)."""
    if model.is_file():
        return [{"path": model.name, "digest": "sha256:unset", "role": "weights"}]
    if not model.is_dir():
        raise WorkflowError(f"--model: {model} does not exist; give a GGUF file or an HF model directory")
    found = sorted({item for pattern in _HF_PATTERNS for item in model.glob(pattern) if item.is_file()})
    if not found:
        raise WorkflowError(
            f"--model: {model} has no model files (*.safetensors, *.json); check the directory"
        )
    return [{"path": item.name, "digest": "sha256:unset", "role": file_role(item.name)} for item in found]


def file_role(name: str) -> str:
    """The role of a model file from its name."""
    if name.endswith((".safetensors", ".gguf", ".bin")):
        return "weights"
    if name.startswith("tokenizer") or name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
        return "tokenizer"
    if name.endswith(".jinja"):
        return "chat_template"
    if name.endswith(".json"):
        return "config"
    return "other"


def hash_file(
    path: Path, label: str | None = None, stream: TextIO | None = None, *, progress: bool = True
) -> str:
    """``sha256:<hex>`` of a file, with a progress bar on stderr for big files (none with
    `progress=False`). The file is read into one reused CHUNK_BYTES buffer."""
    try:
        size = path.stat().st_size
        handle = path.open("rb")
    except OSError as error:
        raise WorkflowError(f"{path}: cannot read ({error.strerror}); check the path") from None
    out = stream if stream is not None else sys.stderr
    big = progress and size >= PROGRESS_MIN_BYTES
    show = big and out.isatty()
    if big and not show:
        out.write(f"hashing {label or path.name} ({size >> 20} MiB)\n")
    digest = hashlib.sha256()
    done = 0
    buffer = bytearray(CHUNK_BYTES)
    with handle:
        while count := handle.readinto(buffer):
            digest.update(memoryview(buffer)[:count])
            done += count
            if show:
                _progress(out, label or path.name, done, size)
    if show:
        out.write("\n")
        out.flush()
    return "sha256:" + digest.hexdigest()


def _progress(out: TextIO, label: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    percent = 100 * done // max(total, 1)
    out.write(f"\rhashing {label} [{'#' * filled}{'.' * (width - filled)}] {percent:3d}% "
              f"{done >> 20}/{total >> 20} MiB")
    out.flush()


def check_digest(path: Path, expected: str, what: str) -> None:
    """Refuse when a file's digest differs from `expected`, naming the path and both digests."""
    actual = hash_file(path)
    if actual != expected:
        raise WorkflowError(
            f"{what} {path}: digest {actual} does not match the locked {expected}; restore the file, or "
            "re-pin it (`detinf digest-bootstrap` / `detinf lock`) if the change is intended"
        )
