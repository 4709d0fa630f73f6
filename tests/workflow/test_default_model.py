"""The workflow on the real embedded default model (slow): two runs of the default manifest are
conformant, and outputs match the committed golden input-output pairs on every machine whose numerics
part of the fingerprint matches the recording's (portable numerics: any x86-64 CPU; a non-portable
recording: only the same hardware class)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.workflow.helpers import detinf, read_json

GOLDEN = Path(__file__).with_name("golden") / "default_greedy_chat.json"


def _record_golden(golden: dict[str, Any], record: dict[str, Any], sequences: list[dict[str, Any]]) -> None:
    """Rewrite the golden file from this run (DETINF_RECORD_GOLDEN=1, after a deliberate numerics change)."""
    fingerprint = record["fingerprint"]
    golden["recorded_with"] = {"model": fingerprint["model"], "numerics": fingerprint["numerics"],
                               "hardware": fingerprint["hardware"], "hardware_class": record["hardware"],
                               "informational": fingerprint["informational"]}
    fields = ("request_id", "prompt_token_ids", "output_token_ids", "text")
    golden["sequences"] = [{field: item[field] for field in fields} for item in sequences]
    GOLDEN.write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


@pytest.mark.slow
def test_default_manifest_runs_are_conformant_and_match_golden(tmp_path: Path) -> None:
    golden = read_json(GOLDEN)
    manifest = tmp_path / "default.json"
    settings = golden["manifest"]
    made = detinf("init", "--output", manifest, "--n-prompts", str(settings["n_prompts"]),
                  "--max-tokens", str(settings["max_tokens"]))
    assert made.code == 0, made.err
    assert read_json(manifest)["model"]["source"] == {"type": "default"}
    assert detinf("lock", "--config", manifest).code == 0
    for name in ("a", "b"):
        ran = detinf("run", "--config", manifest, "--output-dir", tmp_path / name)
        assert ran.code == 0, ran.err
    verified = detinf("verify", "--bundle-a", tmp_path / "a", "--bundle-b", tmp_path / "b",
                      "--output-dir", tmp_path / "v")
    assert verified.code == 0, verified.out
    report = read_json(tmp_path / "v" / "verify_report.json")
    assert report["grade"] == "conformant"
    assert report["outputs"]["logits"]["compared"] > 0
    assert report["outputs"]["activations"]["compared_rows"] > 0

    record = read_json(tmp_path / "a" / "bundle.json")
    if os.environ.get("DETINF_RECORD_GOLDEN") == "1":
        _record_golden(golden, record, read_json(tmp_path / "a" / "tokens.json")["sequences"])
        pytest.skip(f"recorded {GOLDEN}")
    recorded = golden["recorded_with"]
    fingerprint = record["fingerprint"]
    assert recorded["numerics"].get("portable") is True  # the golden pairs hold on any CPU
    keys = ("model", "numerics")
    assert [fingerprint[key] for key in keys] == [recorded[key] for key in keys], (
        "the engine's numerics or the default model changed: after a deliberate change re-record with "
        "DETINF_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/workflow/test_default_model.py"
    )
    sequences = read_json(tmp_path / "a" / "tokens.json")["sequences"]
    fields = ("request_id", "prompt_token_ids", "output_token_ids", "text")
    expected = [[s[f] for f in fields] for s in golden["sequences"]]
    assert [[s[f] for f in fields] for s in sequences] == expected
