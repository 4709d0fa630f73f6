"""Fixtures shared by the compiled-kernel tests: one build directory and the default build per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from deterministic_inference.ops.native import NativeKernels, load
from deterministic_inference.ops.native_build import ISA_FLAGS, build


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build directory for the session's kernel builds (never the user's cache)."""
    return tmp_path_factory.mktemp("native-builds")


@pytest.fixture(scope="session")
def kernels(build_dir: Path) -> NativeKernels:
    """The default build (ISA_FLAGS, i.e. -march=native)."""
    return load(build(ISA_FLAGS, build_dir))
