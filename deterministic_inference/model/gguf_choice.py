"""Which GGUF file of a directory to load: the usual ``*-GGUF`` Hugging Face snapshots hold one GGUF per
quantization (``name-q4_k_m.gguf``, ``name-q8_0.gguf``, ...) and no ``config.json``.

One home for that choice: `load_model` (``--model DIR``), the CLI's ``--model-file`` and the workflow's
``model.source.file`` / ``init --model-id ID:QUANT`` all call `choose_gguf`, so the file that is loaded
is the file that is hashed and locked.
"""

from __future__ import annotations

import re
from pathlib import Path

from deterministic_inference.errors import ModelLoadError

# llama.cpp's gguf-split names its parts NAME-00001-of-00003.gguf; we load single-file GGUFs only
_SPLIT_PART = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_LISTED = 4  # file names an error lists before "and N more"


def gguf_files(directory: Path) -> list[Path]:
    """The ``.gguf`` files directly in `directory` (symlinks of an HF snapshot included), sorted by name."""
    return sorted(item for item in directory.iterdir()
                  if item.name.lower().endswith(".gguf") and item.is_file())


def is_hf_model_directory(directory: Path) -> bool:
    """True when `directory` is a Hugging Face model directory (it has a ``config.json``)."""
    return (directory / "config.json").is_file()


def choose_gguf(directory: Path, name: str | None = None, quant: str | None = None,
                field: str = "--model-file") -> Path | None:
    """The GGUF file of `directory` to load, or None when it is an HF model directory to load as such.

    `name` picks a file by its name (`field` is the option or manifest field that gave it); `quant` picks
    the one file whose name contains it, case-insensitively (llama.cpp's ``-hf ID:QUANT``). With neither,
    a directory without ``config.json`` holding exactly one GGUF gives that file. Anything ambiguous or
    absent is a ModelLoadError of one line naming the option and a few of the files."""
    if name is None and quant is None and is_hf_model_directory(directory):
        return None
    files = gguf_files(directory)
    if name is not None:
        chosen = _by_name(directory, files, name, field)
    elif quant is not None:
        chosen = _by_quant(directory, files, quant, field)
    elif not files:
        return None  # neither config.json nor a GGUF: the HF loader names what is missing
    elif len(files) > 1 and not _one_split_set(files):
        raise ModelLoadError(
            f"{directory}: holds {len(files)} GGUF files ({_listing(files)}); pick one with "
            f"{field} NAME"
        )
    else:
        chosen = files[0]
    if _SPLIT_PART.search(chosen.name):
        raise ModelLoadError(
            f"{chosen}: a split GGUF (part files -0000K-of-0000N.gguf) is not supported; merge the parts "
            "into one file with llama.cpp's `llama-gguf-split --merge FIRST_PART OUT.gguf` and load that"
        )
    return chosen


def _by_name(directory: Path, files: list[Path], name: str, field: str) -> Path:
    """The file `name` of `directory` (a plain file name, ending in .gguf)."""
    if "/" in name or "\\" in name or name in (".", ".."):
        raise ModelLoadError(f"{field} {name}: give a file name inside {directory}, not a path")
    candidate = directory / name
    if not name.lower().endswith(".gguf") or not candidate.is_file():
        raise ModelLoadError(
            f"{field} {name}: no such GGUF file in {directory}; it holds: "
            f"{_listing(files) or 'no GGUF files'}"
        )
    return candidate


def _by_quant(directory: Path, files: list[Path], quant: str, field: str) -> Path:
    """The one file whose name contains `quant` (case-insensitive), else a one-line error."""
    matches = [item for item in files if quant.lower() in item.name.lower()]
    if not matches:
        raise ModelLoadError(
            f"--model-id ...:{quant}: no GGUF file in {directory} has {quant!r} in its name; it holds: "
            f"{_listing(files) or 'no GGUF files'}"
        )
    if len(matches) > 1 and not _one_split_set(matches):
        raise ModelLoadError(
            f"--model-id ...:{quant}: {len(matches)} GGUF files match ({_listing(matches)}); "
            f"name one with {field} NAME or a longer quant tag"
        )
    return matches[0]


def _one_split_set(files: list[Path]) -> bool:
    """True when every file is a part of the same split GGUF (refused later with its own message)."""
    stems = {_SPLIT_PART.sub("", item.name) for item in files if _SPLIT_PART.search(item.name)}
    return len(stems) == 1 and all(_SPLIT_PART.search(item.name) for item in files)


def _listing(files: list[Path]) -> str:
    """A few file names, then how many more."""
    names = ", ".join(item.name for item in files[:_LISTED])
    more = len(files) - _LISTED
    return names + (f" and {more} more" if more > 0 else "")
