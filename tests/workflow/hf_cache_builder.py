"""Build a Hugging Face hub cache from local files, in the layout `huggingface_hub` writes (no network):
``models--ORG--NAME/blobs/<hash>``, ``snapshots/<commit>/<file> -> ../../blobs/<hash>``, ``refs/<branch>``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO = "org/tiny-llama"  # the tiny model's id in the caches the tests build


def add_snapshot(cache: Path, repo: str, source_dir: Path, branch: str = "main") -> str:
    """Put every file of `source_dir` into `cache` as one commit of `repo` (also the head of `branch`);
    returns the commit hash (derived from the files, so the same files give the same commit)."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    files = sorted(item for item in source_dir.iterdir() if item.is_file())
    commit = hashlib.sha1(b"".join(hashlib.sha256(item.read_bytes()).digest() for item in files)).hexdigest()
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for item in files:
        blob_name = hashlib.sha256(item.read_bytes()).hexdigest()
        blob = repo_dir / "blobs" / blob_name
        if not blob.exists():
            blob.write_bytes(item.read_bytes())
        link = snapshot / item.name
        if not link.exists():
            os.symlink(Path("..") / ".." / "blobs" / blob_name, link)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / branch).write_text(commit)
    return commit
