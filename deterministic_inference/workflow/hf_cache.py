"""Models named by Hugging Face id and revision, resolved offline from the local Hugging Face cache.

The cache is the one `huggingface_hub` writes (``models--ORG--NAME/refs/<branch>`` holding a commit,
``snapshots/<commit>/<files>``). Its location is read from the environment at call time, in the order
`huggingface_hub` uses: ``HF_HUB_CACHE``, ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME/hub``,
``XDG_CACHE_HOME/huggingface/hub``, ``~/.cache/huggingface/hub``. Nothing is ever downloaded here: a
missing snapshot is an error naming the cache path and the command that fills it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from deterministic_inference.errors import WorkflowError

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Snapshot:
    """One revision of a repository in the local cache."""

    repo: str  # "org/name"
    revision: str  # as requested (branch, tag or commit)
    commit: str  # the commit the revision resolved to
    path: Path  # snapshots/<commit>


def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache directory this process would use."""
    env = os.environ if environ is None else environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface" / "hub"


def fill_command(repo: str, revision: str) -> str:
    """The command that puts `repo` at `revision` into the cache (run where the network is allowed)."""
    return f"hf download {repo} --revision {revision}"


def resolve_snapshot(repo: str, revision: str, environ: Mapping[str, str] | None = None) -> Snapshot:
    """The cached snapshot of `repo` at `revision` (a branch, tag or commit), without any network access."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir(environ)
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=True)
    except HFValidationError as error:
        raise WorkflowError(f"--model-id {repo!r}: not a Hugging Face repository id "
                            f"({' '.join(str(error).split())[:120]}); write it as ORG/NAME") from None
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise WorkflowError(
            f"model {repo} at revision {revision} is not in the Hugging Face cache {cache}; fill it with "
            f"`{fill_command(repo, revision)}` (or point HF_HUB_CACHE / HF_HOME at the cache that has it)"
        ) from None
    path = Path(folder)
    commit = path.name
    if not _COMMIT.match(commit) or not path.is_dir() or not any(path.iterdir()):
        raise WorkflowError(
            f"model {repo} at revision {revision}: the cached snapshot {path} is empty or malformed; "
            f"fill it again with `{fill_command(repo, revision)}`"
        )
    return Snapshot(repo=repo, revision=revision, commit=commit, path=path)
