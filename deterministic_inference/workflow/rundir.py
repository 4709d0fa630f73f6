"""Run directories: written atomically, read back only when complete and intact.

Layout::

    bundle.json              written last: ids, fingerprint, the sha256 of every other file, and
                             bundle_digest (sha256 of its own canonical JSON without that field)
    manifest.used.json       the resolved manifest
    lock.used.json           the lock the run checked against
    requests.json            the requests sent (their digest is requests_digest)
    tokens.json              sequences[]: request_id, index, prompt_token_ids, output_token_ids, text, ...
    run_log.json             batch trace, determinism controls, warnings, timings
    captures/logits.json, captures/activations.json, captures/activations.safetensors,
    captures/engine_trace.json   (as the manifest's capture section asks)

Writing happens in ``.detinf-tmp-<name>-<pid>`` beside the target, every file fsynced, then one
``rename`` publishes the directory. A killed run leaves at most that temporary directory, which
`load_run_dir` refuses, as it refuses a directory without a complete ``bundle.json`` or with any file
whose digest differs from the one listed.
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.artifacts import hash_file
from deterministic_inference.workflow.canonical import digest_bytes, digest_json, loads_strict, run_id
from deterministic_inference.workflow.canonical import lock_id as compute_lock_id
from deterministic_inference.workflow.canonical import manifest_id as compute_manifest_id

RUN_KIND = "detinf.run"
TEMP_PREFIX = ".detinf-tmp-"
BUNDLE_FILE = "bundle.json"
REQUIRED_FILES = ("manifest.used.json", "lock.used.json", "requests.json", "tokens.json", "run_log.json")


def json_bytes(document: Any, compact: bool = False) -> bytes:
    """The file form of JSON documents in a run dir: sorted keys, UTF-8, a final newline; indented by
    one space, or with no whitespace at all when `compact` (tokens, requests and captures)."""
    if compact:
        text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False)
    else:
        text = json.dumps(document, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode()


def write_run_dir(target: Path, files: dict[str, bytes], bundle: dict[str, Any]) -> Path:
    """Write `files` and then bundle.json (with the files' digests) into `target`, atomically."""
    if target.exists():
        raise WorkflowError(f"{target}: already exists; choose another --output-dir or remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f"{TEMP_PREFIX}{target.name}-{os.getpid()}"
    if temporary.exists():
        shutil.rmtree(temporary)
    try:
        temporary.mkdir()
        digests = {}
        for name in sorted(files):
            write_synced(temporary / name, files[name])
            digests[name] = digest_bytes(files[name])
        record = seal_bundle(dict(bundle, files=digests, complete=True))
        write_synced(temporary / BUNDLE_FILE, json_bytes(record))
        sync_dir(temporary)
        os.rename(temporary, target)
        sync_dir(target.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return target


def seal_bundle(bundle: dict[str, Any]) -> dict[str, Any]:
    """`bundle` with ``bundle_digest``: the digest of its canonical JSON without that field."""
    unsealed = {key: value for key, value in bundle.items() if key != "bundle_digest"}
    return dict(unsealed, bundle_digest=digest_json(unsealed))


def write_synced(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync the file (its folder is the caller's to sync)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def sync_dir(path: Path) -> None:
    """fsync a folder, so the entries made in it survive a crash."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass(frozen=True)
class RunDir:
    """A complete, intact run directory, parsed."""

    path: Path
    bundle: dict[str, Any]
    manifest: dict[str, Any]
    lock: dict[str, Any]

    def read_json(self, name: str) -> Any:
        """A listed JSON file of the run, or None when the run did not write it."""
        if name not in self.bundle["files"]:
            return None
        return loads_strict((self.path / name).read_text(encoding="utf-8"), str(self.path / name))

    @property
    def tokens(self) -> dict[str, Any]:
        """tokens.json."""
        document: dict[str, Any] = self.read_json("tokens.json")
        return document


def load_run_dir(path: Path) -> RunDir:
    """Open a run directory, refusing anything incomplete, modified or inconsistent."""
    if path.name.startswith(TEMP_PREFIX):
        raise WorkflowError(f"{path}: incomplete run (temporary directory of an interrupted run); "
                            "run it again")
    if not path.is_dir():
        raise WorkflowError(f"{path}: not a run directory or bundle; give a run dir or a .tar.gz "
                            "from `detinf bundle`")
    bundle_path = path / BUNDLE_FILE
    if not bundle_path.is_file():
        raise WorkflowError(f"{path}: incomplete run (no {BUNDLE_FILE}); run it again")
    bundle = loads_strict(bundle_path.read_text(encoding="utf-8"), str(bundle_path))
    if not isinstance(bundle, dict) or bundle.get("kind") != RUN_KIND or bundle.get("complete") is not True:
        raise WorkflowError(f"{bundle_path}: not a complete detinf run record; run it again")
    files = bundle.get("files")
    missing = [name for name in REQUIRED_FILES if not isinstance(files, dict) or name not in files]
    if not isinstance(files, dict) or missing:
        raise WorkflowError(f"{bundle_path}: does not list {', '.join(missing)}; the run record is damaged")
    for name, expected in sorted(files.items()):
        _check_file(path, name, expected)
    run = RunDir(path=path, bundle=bundle, manifest=_read(path, "manifest.used.json"),
                 lock=_read(path, "lock.used.json"))
    _check_ids(run)
    return run


def _check_file(root: Path, name: str, expected: str) -> None:
    file_path = root / name
    if ".." in Path(name).parts or Path(name).is_absolute():
        raise WorkflowError(f"{root / BUNDLE_FILE}: file name {name!r} escapes the run directory")
    if not file_path.is_file():
        raise WorkflowError(f"{file_path}: missing; the run directory is incomplete")
    actual = hash_file(file_path, name)  # streamed; big captures show progress on stderr
    if actual != expected:
        raise WorkflowError(f"{file_path}: digest {actual} differs from {expected} in {BUNDLE_FILE}; "
                            "the run directory was modified")


def _read(root: Path, name: str) -> dict[str, Any]:
    value = loads_strict((root / name).read_text(encoding="utf-8"), str(root / name))
    if not isinstance(value, dict):
        raise WorkflowError(f"{root / name}: must be a JSON object")
    return value


def _check_ids(run: RunDir) -> None:
    bundle = run.bundle
    sealed = seal_bundle(bundle)["bundle_digest"]
    if bundle.get("bundle_digest") != sealed:
        raise WorkflowError(f"{run.path / BUNDLE_FILE}: bundle_digest {bundle.get('bundle_digest')} does not "
                            f"match its content ({sealed}); the run record was modified")
    checks = (("manifest_id", compute_manifest_id(run.manifest)), ("lock_id", compute_lock_id(run.lock)))
    for key, actual in checks:
        if bundle.get(key) != actual:
            raise WorkflowError(f"{run.path}: {key} {bundle.get(key)} in {BUNDLE_FILE} does not match the "
                                f"recorded file ({actual}); the run directory is inconsistent")
    expected_run = run_id(bundle["manifest_id"], bundle["lock_id"], bundle["requests_digest"],
                          bundle["fingerprint"]["hardware"])
    if bundle.get("run_id") != expected_run:
        raise WorkflowError(f"{run.path}: run_id {bundle.get('run_id')} does not match its ids "
                            f"({expected_run}); "
                            "the run record was modified")


@contextmanager
def open_run(path: Path) -> Iterator[RunDir]:
    """A run dir (or its bundle.json), or a `detinf bundle` tar.gz extracted to a temporary directory
    for the block."""
    if path.is_file() and path.name == BUNDLE_FILE:  # the seed tool's form: runs/<id>/bundle.json
        path = path.parent
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        with tempfile.TemporaryDirectory(prefix="detinf-bundle-") as scratch:
            yield load_run_dir(extract_bundle(path, Path(scratch)))
    else:
        yield load_run_dir(path)


def extract_bundle(archive: Path, into: Path) -> Path:
    """Extract a bundle safely (regular files and directories only, no paths leaving `into`)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()
            tops = {Path(member.name).parts[0] for member in members if member.name}
            for member in members:
                parts = Path(member.name).parts
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    raise WorkflowError(f"{archive}: unsafe entry {member.name!r}; not a detinf bundle")
            tar.extractall(into, filter="data")
    except (tarfile.TarError, OSError, EOFError) as error:
        raise WorkflowError(f"{archive}: cannot read the bundle ({error}); re-create it with "
                            "`detinf bundle`") from None
    if len(tops) != 1:
        raise WorkflowError(f"{archive}: expected one top-level directory; not a detinf bundle")
    return into / tops.pop()
