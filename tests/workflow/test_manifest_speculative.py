"""engine.speculative_config in a manifest: validated with the manifest (one line naming the field),
passed to the embedded engine, and absent from manifests that do not set it (old ids unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deterministic_inference.engine.speculative import SpeculativeConfig
from deterministic_inference.workflow.artifacts import ModelLocation
from deterministic_inference.workflow.backend_engine import engine_config_for
from deterministic_inference.workflow.manifest import load_manifest
from tests.workflow.helpers import detinf, write_json
from tests.workflow.test_manifest import minimal

BAD = [
    ({"method": "lookahead"}, "$.engine.speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "$.engine.speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "k": 2}, "$.engine.speculative_config.k: unknown field"),
    ("ngram", "$.engine.speculative_config"),
]


@pytest.mark.parametrize(("value", "expected"), BAD)
def test_bad_speculative_config_is_one_clear_line(tmp_path: Path, value: Any, expected: str) -> None:
    path = write_json(tmp_path / "bad.json", minimal(engine={"speculative_config": value}))
    result = detinf("lock", "--config", path)
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "fix:" in lines[0], result.err


def test_speculative_config_reaches_the_engine_config(tmp_path: Path) -> None:
    plain = load_manifest(write_json(tmp_path / "plain.json", minimal()))
    assert "speculative_config" not in plain.data["engine"]  # old manifests keep their ids
    value = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    path = write_json(tmp_path / "spec.json", minimal(engine={"speculative_config": value}))
    manifest = load_manifest(path)
    config = engine_config_for(manifest.data, ModelLocation(engine_path=None, root=None))
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)


def test_speculation_with_activation_capture_is_refused(tmp_path: Path) -> None:
    document = minimal(
        engine={"speculative_config": {"method": "ngram"}}, capture={"activations": {"enabled": True}}
    )
    result = detinf("lock", "--config", write_json(tmp_path / "bad.json", document))
    assert result.code == 2
    assert "$.engine.speculative_config: activation capture" in result.err and "fix:" in result.err
