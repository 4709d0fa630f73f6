"""Bundles: a run directory as a deterministic tar.gz.

The same run directory always gives the same bytes: entries sorted by path under one top-level
directory ``detinf-run-<first 16 hex digits of run_id>``, directories before their contents, mode
0755 / 0644, mtime 0, uid/gid 0 with empty owner names, PAX format, and a gzip header with mtime 0 and no
file name. Only complete, intact run directories are bundled (see `rundir.load_run_dir`); symlinks and
other special files are refused.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

from deterministic_inference.errors import WorkflowError
from deterministic_inference.workflow.rundir import load_run_dir

GZIP_LEVEL = 9


def bundle_name(run_id: str) -> str:
    """Top-level directory name inside a bundle."""
    return "detinf-run-" + run_id.split(":", 1)[-1][:16]


def bundle_bytes(run_dir: Path) -> bytes:
    """The deterministic tar.gz bytes of a complete run directory."""
    run = load_run_dir(run_dir)
    top = bundle_name(run.bundle["run_id"])
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_info(top, directory=True))
        for path in _entries(run_dir):
            relative = path.relative_to(run_dir).as_posix()
            if path.is_dir():
                tar.addfile(_info(f"{top}/{relative}", directory=True))
            else:
                data = path.read_bytes()
                tar.addfile(_info(f"{top}/{relative}", size=len(data)), io.BytesIO(data))
    compressed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=compressed, mtime=0, compresslevel=GZIP_LEVEL) as gz:
        gz.write(raw.getvalue())
    return compressed.getvalue()


def write_bundle(run_dir: Path, output: Path) -> Path:
    """Bundle `run_dir` into `output` (written via a temporary file, then renamed)."""
    data = bundle_bytes(run_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(f".{output.name}.tmp")
    temporary.write_bytes(data)
    temporary.replace(output)
    return output


def _entries(root: Path) -> list[Path]:
    found = []
    for path in sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix()):
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise WorkflowError(f"{path}: not a regular file or directory; a run dir holds only plain files")
        found.append(path)
    return found


def _info(name: str, directory: bool = False, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = 0o755 if directory else 0o644
    info.size = 0 if directory else size
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
