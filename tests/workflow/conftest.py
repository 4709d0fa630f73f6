"""Fixtures for workflow tests: manifests for the tiny random model, locked and ready to run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.tiny_models import TinyModel
from tests.workflow.helpers import detinf, edit_manifest
from tests.workflow.hf_cache_builder import REPO, add_snapshot


@pytest.fixture()
def tiny_model_copy(tiny_llama_dir: TinyModel, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama HF directory (safe to tamper with)."""
    target = tmp_path / "tiny-model"
    shutil.copytree(tiny_llama_dir.path, target)
    return target


@pytest.fixture()
def tiny_manifest(tiny_model_copy: Path, tmp_path: Path) -> Path:
    """A locked greedy manifest over the tiny model copy: 3 prompts, 6 tokens, small KV pool."""
    path = tmp_path / "tiny.json"
    result = detinf("init", "--output", path, "--model", tiny_model_copy, "--n-prompts", "3",
                    "--max-tokens", "6")
    assert result.code == 0, result.err
    edit_manifest(path, {"engine": {"num_kv_blocks": 256}})
    locked = detinf("lock", "--config", path)
    assert locked.code == 0, locked.err
    return path


@pytest.fixture()
def hf_env(
    tiny_llama_dir: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[str, dict[str, str]]:
    """A private HF cache holding the tiny model as REPO (commit, environment pointing at the cache)."""
    cache = tmp_path / "hf-cache"
    commit = add_snapshot(cache, REPO, tiny_llama_dir.path)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return commit, env
